"""Fixtures for the cachelib.mlx tests: random and position-encoding keys, a lazy comparer of
our results against mlx-lm's, and a reader of what each slot of a cache really holds."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest


class Same:
    """Collects ours-vs-mlx-lm comparisons; array equality is checked lazily in one batch.

    ``check(label, ours, theirs)`` compares arrays (shape, dtype, every element), nested
    lists/tuples, None, strings and scalars (value and type). ``flush()`` evaluates the pending
    array comparisons and fails with the first label that differs.
    """

    def __init__(self):
        self.pending: list[tuple[str, mx.array]] = []

    def check(self, label: str, ours, theirs) -> None:
        if isinstance(theirs, mx.array):
            assert isinstance(ours, mx.array), f"{label}: ours is {type(ours).__name__}, mlx-lm's an array"
            assert ours.shape == theirs.shape, f"{label}: shape {ours.shape} != mlx-lm's {theirs.shape}"
            assert ours.dtype == theirs.dtype, f"{label}: dtype {ours.dtype} != mlx-lm's {theirs.dtype}"
            self.pending.append((label, mx.array_equal(ours, theirs)))
        elif isinstance(theirs, (list, tuple)):
            assert isinstance(ours, (list, tuple)), f"{label}: ours is {type(ours).__name__}, mlx-lm's a sequence"
            assert len(ours) == len(theirs), f"{label}: {len(ours)} entries != mlx-lm's {len(theirs)}"
            for i, (a, b) in enumerate(zip(ours, theirs)):
                self.check(f"{label}[{i}]", a, b)
        else:
            assert type(ours) is type(theirs) and ours == theirs, f"{label}: {ours!r} != mlx-lm's {theirs!r}"

    def flush(self) -> int:
        if not self.pending:
            return 0
        labels, flags = zip(*self.pending)
        self.pending = []
        ok = np.array(mx.stack(list(flags)))
        bad = np.flatnonzero(~ok)
        assert bad.size == 0, f"differs from mlx-lm: {labels[bad[0]]} (and {bad.size - 1} more)"
        return len(labels)


@pytest.fixture
def same() -> Same:
    return Same()


def random_kv(rng: np.random.Generator, B: int, H: int, S: int, D: int, Dv: int | None = None):
    k = rng.standard_normal((B, H, S, D), dtype=np.float32)
    v = rng.standard_normal((B, H, S, Dv or D), dtype=np.float32)
    return mx.array(k), mx.array(v)


def position_kv(rng: np.random.Generator, B: int, H: int, start: int, S: int, D: int):
    """Keys whose every element encodes the absolute position: position p -> p + 1 plus a
    small ramp across D (so group-wise quantization keeps round(key[..., 0]) == p + 1); zero
    therefore means "never written". Values are random."""
    pos = np.arange(start, start + S, dtype=np.float32)[None, None, :, None] + 1
    ramp = np.linspace(0.0, 0.25, D, dtype=np.float32)[None, None, None, :]
    k = np.broadcast_to(pos + ramp, (B, H, S, D)).copy()
    v = rng.standard_normal((B, H, S, D), dtype=np.float32)
    return mx.array(k), mx.array(v)


@pytest.fixture
def kv():
    """``kv(rng, B, H, S, D)``: random keys and values (float32, (B, H, S, D))."""
    return random_kv


@pytest.fixture
def positions_kv():
    """``positions_kv(rng, B, H, start, S, D)``: keys that encode their positions."""
    return position_kv


def stored_positions(keys) -> np.ndarray:
    """What each slot of a stored key buffer holds: the encoded position, -1 if never written.

    ``keys``: an array (B, H, T, D) or quantized parts; returns (B, T) from head 0.
    """
    if isinstance(keys, (list, tuple)):
        raise TypeError("quantized parts: dequantize first (stored_positions_q)")
    first = np.array(keys[:, 0, :, 0])
    return np.rint(first).astype(np.int64) - 1


def stored_positions_q(keys, group_size: int, bits: int) -> np.ndarray:
    return stored_positions(mx.dequantize(*keys, group_size=group_size, bits=bits))


@pytest.fixture
def read_slots():
    """``read_slots(keys, group_size=None, bits=None)``: per batch row, the position encoded in
    each slot of a stored key buffer (-1: never written)."""

    def read(keys, group_size=None, bits=None):
        if isinstance(keys, (list, tuple)):
            return stored_positions_q(keys, group_size, bits)
        return stored_positions(keys)

    return read
