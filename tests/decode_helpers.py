"""Helpers for the bundled-model decode checks of both backends (tests/mlx, tests/torch)."""

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
