"""How far a strategy's next-token distribution is from the baseline's (KL, top-1 agreement, the
target's log-prob), from raw logits.

The baseline's distribution is computed once per step (:class:`Baseline`) and shared by every
strategy compared against it; the arithmetic is the same whichever way ``compare`` is called, so
a profile's numbers do not depend on it.
"""

from __future__ import annotations

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax of one row of logits (vocab,)."""
    x = np.array(logits, dtype=np.float64)  # our own copy: the steps below work in place
    x -= x.max()
    x -= np.log(np.exp(x).sum())
    return x


class Baseline:
    """The baseline's next-token distribution at one step: float64 log-probabilities, probabilities
    and top token, computed once and shared by every strategy's :func:`compare`."""

    __slots__ = ("logits", "log_probs", "probs", "top1")

    def __init__(self, logits: np.ndarray):
        self.logits = np.asarray(logits)  # a row with these very logits compares without arithmetic
        self.log_probs = log_softmax(logits)
        self.probs = np.exp(self.log_probs)
        self.top1 = int(np.argmax(logits))

    def logprob(self, target: int) -> float:
        """Log-probability of token ``target`` under the baseline."""
        return float(self.log_probs[target])


def compare(
    baseline: Baseline | np.ndarray, logits: np.ndarray, target: int | None
) -> tuple[float, bool, float | None]:
    """(KL(baseline || strategy) in nats, top-1 agreement, log-prob of ``target`` under the strategy).

    ``baseline`` is the step's :class:`Baseline` (computed once for all strategies) or its raw logits."""
    base = baseline if isinstance(baseline, Baseline) else Baseline(baseline)
    if np.array_equal(base.logits, logits):  # the same logits: the arithmetic below gives exactly these
        return 0.0, True, (base.logprob(target) if target is not None else None)
    lq = log_softmax(logits)
    diff = base.log_probs - lq
    diff *= base.probs  # p * (log p - log q), elementwise: the same products as the textbook order
    kl = float(np.sum(diff))
    agree = bool(base.top1 == int(np.argmax(logits)))
    return max(kl, 0.0), agree, (float(lq[target]) if target is not None else None)
