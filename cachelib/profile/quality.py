"""Quality of a strategy's next-token distribution against the baseline's, from raw logits."""

from __future__ import annotations

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def compare(baseline_logits: np.ndarray, logits: np.ndarray, target: int | None) -> tuple[float, bool, float | None]:
    """(KL(baseline || strategy) in nats, top-1 agreement, log-prob of ``target`` under the strategy)."""
    lp = log_softmax(baseline_logits)
    lq = log_softmax(logits)
    p = np.exp(lp)
    kl = float(np.sum(p * (lp - lq)))
    agree = bool(int(np.argmax(baseline_logits)) == int(np.argmax(logits)))
    return max(kl, 0.0), agree, (float(lq[target]) if target is not None else None)
