"""Helpers for the bundled-model decode checks of both backends (tests/mlx, tests/torch), and the
quality probe's numbers in their textbook form (tests/profile)."""

from __future__ import annotations

import numpy as np

from cachelib.decode import Runner, encode_prompt


def lockstep(loaded, mine, theirs, prompt: str, tokens: int) -> list[int]:
    """Greedy decode of ``prompt`` through both caches, one step at a time: every step's logits
    (the prefill's included) must be the same bits; returns the generated ids."""
    runner = Runner(loaded)
    feed, ids = encode_prompt(loaded.tokenizer, prompt), []
    for step in range(tokens):
        got, want = runner.step(mine, feed), runner.step(theirs, feed)
        assert np.array_equal(got, want), f"step {step}: logits differ by up to {np.abs(got - want).max()}"
        ids.append(int(np.argmax(want)))
        feed = [ids[-1]]
    return ids


def textbook_quality(baseline_logits, logits, target):
    """KL(p || q), top-1 agreement and log q[target] of two rows of logits, in their textbook
    float64 form (``compare``'s, which the evaluation uses)."""
    lp = np.asarray(baseline_logits, dtype=np.float64)
    lp = lp - lp.max()
    lp = lp - np.log(np.exp(lp).sum())
    lq = np.asarray(logits, dtype=np.float64)
    lq = lq - lq.max()
    lq = lq - np.log(np.exp(lq).sum())
    kl = float(np.sum(np.exp(lp) * (lp - lq)))
    agree = bool(int(np.argmax(baseline_logits)) == int(np.argmax(logits)))
    return max(kl, 0.0), agree, (float(lq[target]) if target is not None else None)
