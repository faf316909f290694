"""What a layer cache holds right now, in one small record shared by both backends.

Every cache class of ``cachelib.mlx`` and ``cachelib.torch`` answers ``introspect()`` with a
:class:`CacheView`. The profiler reads only this record; it never reaches into private fields.
A view is built from a handful of integers the cache already keeps, so it is cheap enough to
take every decode step; the one per-slot table (:meth:`CacheView.slot_positions`) is computed
only when asked for, from those integers alone.

A layer cache that can be a row of a strategy batch also says, after each update, which slots
of what it handed back the update changed (:class:`Written`), so the batch copies only those.

This module knows nothing of MLX or PyTorch: it holds the record, the slot tables of the cache
layouts (append-only, chunked, left-padded batches; the ring's comes from
:mod:`cachelib.core.ring`) and the quantization-error summary.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, NamedTuple

import numpy as np

from .core.masks import visible_held
from .core.ring import ring_slot_positions

Layout = Literal["linear", "ring", "selected", "recurrent", "none"]


class Written(NamedTuple):
    """What one ``update_and_fetch`` changed in the keys/values it handed back, against those
    the update before handed back: slots ``[start, end)`` are new; every other slot below the
    new length holds what it held. ``verbatim``: those slots hold the update's input keys and
    values as given (stored at full precision, not quantized, nothing else moved)."""

    start: int
    end: int
    verbatim: bool


@dataclass(frozen=True, slots=True)
class QuantError:
    """Distortion of the K/V that one update quantized, against the full-precision input."""

    key_rel_rms: float  # ||K - deq(q(K))||_2 / ||K||_2
    key_max_abs: float  # max |K - deq(q(K))|
    value_rel_rms: float
    value_max_abs: float


@dataclass(frozen=True, slots=True)
class CacheView:
    """A read-only summary of one layer cache.

    Token counts are per sequence (batch row); byte counts cover the whole batch.
    """

    kind: str  # the cache class name, e.g. "RotatingKVCache"
    layout: Layout  # how slots map to positions: see slot_positions()
    offset: int  # tokens seen so far = absolute position of the next token
    tokens_held: int  # tokens whose K/V the cache holds now (what attention can see)
    capacity: int  # token slots allocated now (0 for caches without a token axis)
    max_capacity: int | None  # the bound on slots (max_size, max_cache_len, ...); None: unbounded
    bytes_used: int  # bytes of the slots that hold tokens (+ all recurrent state)
    bytes_allocated: int  # bytes of every array the cache holds (== its nbytes)
    write_index: int | None  # slot the next token goes to (the ring pointer for ring caches)
    keep: int = 0  # leading slots never evicted (attention sinks)
    start_position: int = 0  # absolute position held by slot 0 of a linear layout (chunked caches)
    batch_size: int = 1
    left_padding: tuple[int, ...] = ()  # per batch row, for left-padded batch caches
    key_bits: int | None = None  # None: keys stored unquantized
    value_bits: int | None = None
    group_size: int | None = None
    quantized_tokens: int = 0  # tokens stored quantized (the rest, if any, at full precision)
    dtype: str = ""  # element type of the stored keys (or of the scales for quantized storage)
    quant_error: QuantError | None = field(default=None, compare=False)
    # "selected" layout (importance caches): absolute position per (KV head, slot) of batch row 0
    head_positions: np.ndarray | None = field(default=None, compare=False)
    score_seconds: float = field(default=0.0, compare=False)  # spent scoring keys this step

    @property
    def evicted(self) -> int:
        """Tokens seen but no longer held (dropped by a window, ring or chunk boundary)."""
        if self.layout in ("recurrent", "none"):
            return 0
        return max(0, self.offset - self.tokens_held)

    @property
    def bits(self) -> int | None:
        """The quantization width when keys and values share it (mlx-lm's ``bits``)."""
        return self.key_bits if self.key_bits == self.value_bits else None

    def slot_positions(self) -> np.ndarray:
        """Absolute token position held in each slot, -1 where a slot holds nothing.

        Shape ``(capacity,)``, or ``(batch_size, capacity)`` for left-padded batch caches.
        """
        if self.layout == "ring":
            return ring_slot_positions(self.offset, self.write_index, self.keep, self.capacity)
        if self.layout == "selected":  # each KV head keeps its own positions: head 0's here
            if self.head_positions is None:
                return np.full((self.capacity,), -1, dtype=np.int64)
            return np.asarray(self.head_positions[0], dtype=np.int64)
        if self.layout == "linear":
            if self.left_padding:
                rows = [linear_slot_positions(self.write_index, self.capacity, start=-pad) for pad in self.left_padding]
                return np.maximum(np.stack(rows), -1)
            return linear_slot_positions(self.tokens_held, self.capacity, self.start_position)
        return np.full((self.capacity,), -1, dtype=np.int64)

    def with_error(self, error: QuantError | None) -> CacheView:
        return replace(self, quant_error=error)


def linear_slot_positions(filled: int, capacity: int, start: int = 0) -> np.ndarray:
    """Append-only layout: slot j holds position ``start + j`` for the first ``filled`` slots."""
    out = np.full((capacity,), -1, dtype=np.int64)
    filled = max(0, min(filled, capacity))
    out[:filled] = np.arange(start, start + filled, dtype=np.int64)
    return out


def quant_error(x: np.ndarray, x_hat: np.ndarray) -> tuple[float, float]:
    """(relative RMS, max abs) of the reconstruction ``x_hat`` of ``x``."""
    x = np.asarray(x, dtype=np.float64)
    diff = np.asarray(x_hat, dtype=np.float64) - x
    norm = float(np.sqrt(np.sum(x * x)))
    rel = float(np.sqrt(np.sum(diff * diff))) / norm if norm > 0 else 0.0
    return rel, float(np.max(np.abs(diff))) if diff.size else 0.0


def dense_causal_mask(
    n_queries: int, kv_positions: np.ndarray, query_start: int, window: int | None = None
) -> np.ndarray:
    """Boolean (query x key) mask: key slot ``k`` holding position ``p`` is visible to query
    position ``q`` iff ``0 <= p <= q`` and, with a window, ``q - p < window``.

    ``kv_positions`` is a slot table as returned by :meth:`CacheView.slot_positions`; the mask's
    key axis is therefore in slot order.
    """
    q = np.arange(query_start, query_start + n_queries, dtype=np.int64)[:, None]
    p = np.asarray(kv_positions, dtype=np.int64)[None, :]
    return visible_held(q, p, window)
