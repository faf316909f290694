"""Helpers for the cachelib.torch tests: seeded random K/V, tensor comparison, slot-table checks."""

from __future__ import annotations

import numpy as np
import torch


def rand_kv(rng: np.random.Generator, batch: int, heads: int, n: int, dim: int, dtype=torch.float32):
    """Random (B, H, n, D) keys and values."""
    k = torch.from_numpy(rng.standard_normal((batch, heads, n, dim)).astype(np.float32)).to(dtype)
    v = torch.from_numpy(rng.standard_normal((batch, heads, n, dim)).astype(np.float32)).to(dtype)
    return k, v


def positional_kv(batch: int, heads: int, start: int, n: int, dim: int):
    """Keys and values whose every element is ``position + 1`` (0 marks a never-written slot)."""
    pos = torch.arange(start + 1, start + n + 1, dtype=torch.float32)
    x = pos.view(1, 1, n, 1).expand(batch, heads, n, dim).clone()
    return x, x.clone()


def same(a, b) -> bool:
    """Bitwise-equal tensors (shape, dtype and values); None equals None."""
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def assert_slots_true(view, stored: torch.Tensor) -> None:
    """``view.slot_positions()`` names exactly the positions written into each slot of
    ``stored`` (B, H, capacity, D) by :func:`positional_kv`; unfilled slots say -1."""
    table = view.slot_positions()
    assert table.shape == (view.capacity,), (table.shape, view.capacity)
    assert stored.shape[-2] == view.capacity
    found = stored[0, 0, :, 0].round().long().numpy() - 1  # the position each slot holds
    filled = table >= 0
    assert int(filled.sum()) == view.tokens_held
    np.testing.assert_array_equal(found[filled], table[filled])
