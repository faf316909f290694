"""Caches for a batch of sequences of different lengths, left-padded to a common timeline:
mlx-lm's :class:`BatchKVCache` and :class:`BatchRotatingKVCache`, as mlx-lm's batch generator
drives them (``prepare`` / ``finalize`` around a right-padded prefill, ``filter`` / ``extend``
as sequences leave and join, ``extract`` / ``merge`` to and from single-sequence caches).

Every row shares the token axis (axis 2) of ``(B, H, T, D)`` buffers. Row ``r`` is padded by
``left_padding[r]`` slots, so its tokens start later on the common timeline; ``offset[r]`` is
the position (RoPE offset) of its next token. The per-row bookkeeping is kept in small int
arrays, as mlx-lm keeps it, so that it can change without a device sync.

Views: the timeline position of a slot is the padded one; row ``r``'s own position is that
minus ``view.left_padding[r]`` (negative: padding). For the linear layout
``CacheView.slot_positions()`` applies the padding itself.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np

from ..core import ring
from ..core.units import STEP
from ..introspect import CacheView
from .base import (
    LayerCache,
    array_bytes,
    causal_mask,
    check_array,
    check_int,
    check_kv_pair,
    check_trim,
    dtype_name,
    per_token_bytes,
    write_linear,
    zeros_like_tokens,
)
from .kv import KVCache
from .rotating import RotatingKVCache


def roll_rows(x: mx.array, shifts: mx.array) -> mx.array:
    """Each batch row of ``x`` (B, H, T, D) rolled right along the token axis by its own
    ``shifts[b]`` (shape (B, 1))."""
    n = x.shape[2]
    src = (mx.arange(n)[:, None] - shifts[..., None, None]) % n  # (B, 1, T, 1)
    return mx.take_along_axis(x, src, axis=2)


def _batch_state_checks(keys, values, offset, left_padding, where: str) -> tuple[mx.array, mx.array]:
    """Check a batch state; returns (offset, left_padding) with one entry per batch row.

    mlx-lm sets a state without checking it, and a single offset / left_padding entry then
    broadcasts over every row of the keys (its masks and RoPE take it so). Such a state is
    loaded, with a warning, by repeating the entry for every row; entries that cannot
    broadcast (2 for 3 rows) are refused: mlx-lm's first forward fails on them too."""
    check_array("keys", keys, where)
    check_array("values", values, where)
    check_kv_pair(keys, values, where)
    check_array("offset", offset, where, optional=False)
    check_array("left_padding", left_padding, where, optional=False)
    if offset.ndim != 1 or left_padding.ndim != 1:
        raise ValueError(
            f"{where} state: offset {tuple(offset.shape)} and left_padding {tuple(left_padding.shape)} "
            "must be 1-D with one entry per batch row"
        )
    rows = keys.shape[0] if keys is not None else max(offset.shape[0], left_padding.shape[0])
    for name, x in (("left_padding", left_padding), ("offset", offset)):
        if x.shape[0] not in (rows, 1):
            held = f"keys hold {rows} batch rows" if keys is not None else f"the other entry has {rows} rows"
            raise ValueError(
                f"{where} state: {held} but {name} has {x.shape[0]} entries; it needs one per row "
                "(or a single one for every row)"
            )
    if offset.shape[0] == left_padding.shape[0] == rows:
        return offset, left_padding
    warnings.warn(
        f"{where} state: {offset.shape[0]} offset and {left_padding.shape[0]} left_padding entries for "
        f"{rows} batch rows; a single entry is taken for every row (as mlx-lm's masks broadcast it)",
        stacklevel=3,
    )
    return mx.broadcast_to(offset, (rows,)) + 0, mx.broadcast_to(left_padding, (rows,)) + 0


def _aligned(caches, *, wanted_idx: int, width: int, H: int, D: int, M: int, dtype):
    """Each cache's buffers padded so that its write index lands on ``wanted_idx`` and its
    length on ``width``; returns (keys, values, offset, left_padding) per cache."""
    out = []
    for c in caches:
        k, v = c.keys, c.values
        if k is None:
            rows = c.offset.shape[0]
            k = mx.zeros((rows, H, 0, D), dtype=dtype)
            v = mx.zeros((rows, H, 0, M), dtype=dtype)
        left = wanted_idx - c._idx
        right = width - k.shape[2] - left
        if right < 0:
            k, v = k[..., :right, :], v[..., :right, :]
            right = 0
        if left or right:
            pad = [(0, 0), (0, 0), (left, right), (0, 0)]
            k, v = mx.pad(k, pad), mx.pad(v, pad)
        out.append((k, v, c.offset, c.left_padding + left))
    return out


def _extend(self, other) -> None:
    """Append ``other``'s rows, both right-aligned at the larger write index (shared by the
    two batch caches)."""
    if self.keys is None and other.keys is None:
        self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
        self.offset = mx.concatenate([self.offset, other.offset])
        return
    widths = [0, 0]
    for i, c in enumerate((self, other)):
        if c.keys is not None:
            _, H, widths[i], D = c.keys.shape
            M = c.values.shape[3]
    dtype = (self.keys if self.keys is not None else other.keys).dtype
    wanted = max(self._idx, other._idx)
    parts = _aligned((self, other), wanted_idx=wanted, width=max(widths), H=H, D=D, M=M, dtype=dtype)
    self.keys, self.values, self.offset, self.left_padding = (mx.concatenate(list(x)) for x in zip(*parts))
    self._idx = wanted


def _row_view(cache, layout: str, offset: int, capacity: int, held: int, write_index, left_padding, **extra):
    total = array_bytes(cache.keys, cache.values)
    return CacheView(
        kind=type(cache).__name__,
        layout=layout,
        offset=offset,
        tokens_held=held,
        capacity=capacity,
        max_capacity=extra.pop("max_capacity", None),
        bytes_used=per_token_bytes(total, capacity) * held,
        bytes_allocated=total,
        write_index=write_index,
        batch_size=int(cache.offset.shape[0]),
        left_padding=left_padding,
        dtype=dtype_name(cache.keys),
        **extra,
    )


class BatchKVCache(LayerCache):
    """mlx-lm's ``BatchKVCache(left_padding)``: a step-allocated cache for left-padded rows.

    E.g. prompts ``[1, 3, 5]``, ``[7]``, ``[2, 6, 8, 9]`` go in as ``[0, 1, 3, 5]``,
    ``[0, 0, 0, 7]``, ``[2, 6, 8, 9]`` with ``left_padding=[1, 3, 0]``.
    """

    step = STEP
    _right_padding = None
    _STATE = ("keys", "values", "offset", "left_padding", "_idx")

    def __init__(self, left_padding: list[int]):
        self.keys = None
        self.values = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self._right_padding = None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        prev = self._idx
        self.keys = write_linear(self.keys, prev, keys, self.step)
        self.values = write_linear(self.values, prev, values, self.step)
        self.offset = self.offset + keys.shape[2]
        self._idx = prev + keys.shape[2]
        return self.keys_and_values()

    def keys_and_values(self):
        n = self._idx
        return self.keys[..., :n, :], self.values[..., :n, :]

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """Before a prefill: extra left padding (only while empty), or the right padding of a
        right-padded prompt batch, undone by :meth:`finalize`."""
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("BatchKVCache.prepare: left_padding can only be added while the cache is empty")
            left_padding = mx.array(left_padding)
            self.left_padding += left_padding
            self.offset = self.offset - left_padding
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        """After a right-padded prefill: roll each row right by its padding, so that rows end
        together and the padding moves to the left."""
        if self._right_padding is not None:
            shift = self._right_padding
            self.keys = roll_rows(self.keys, shift[:, None])
            self.values = roll_rows(self.values, shift[:, None])
            self.offset = self.offset - shift
            self.left_padding += shift
            self._right_padding = None

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v):
        keys, values, offset, left_padding, idx = self._unpack_state(v, 5)
        where = "BatchKVCache"
        offset, left_padding = _batch_state_checks(keys, values, offset, left_padding, where)
        if not isinstance(idx, int) or isinstance(idx, bool):
            raise ValueError(f"{where} state: _idx must be an integer, got {idx!r}")
        if keys is not None and idx > keys.shape[2]:
            raise ValueError(f"{where} state: _idx={idx} exceeds the {keys.shape[2]} slots stored")
        self.keys, self.values, self.offset, self.left_padding, self._idx = keys, values, offset, left_padding, idx

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, check_trim(n, "BatchKVCache"))
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        return causal_mask(N, self._idx, window_size, self.left_padding)

    def filter(self, batch_indices) -> None:
        """Keep only the rows ``batch_indices``, in place; padding every row shares is cut off."""
        if self.keys is not None:
            self.keys = self.keys[batch_indices]
            self.values = self.values[batch_indices]
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shared = min(self.left_padding.tolist())
        if shared > 0:
            if self.keys is not None:
                self.keys = self.keys[..., shared:, :]
                self.values = self.values[..., shared:, :]
            self._idx -= shared
            self.left_padding -= shared

    def extend(self, other: BatchKVCache) -> None:
        """Append ``other``'s rows, in place."""
        _extend(self, other)

    def extract(self, idx: int) -> KVCache:
        """Row ``idx`` without its padding, as a :class:`KVCache`."""
        out = KVCache()
        pad = self.left_padding.tolist()[idx]
        out.keys = mx.contiguous(self.keys[idx : idx + 1, :, pad : self._idx])
        out.values = mx.contiguous(self.values[idx : idx + 1, :, pad : self._idx])
        out.offset = out.keys.shape[2]
        return out

    @classmethod
    def merge(cls, caches) -> BatchKVCache:
        """Single-sequence caches as the rows of one batch cache, left-padded to the longest."""
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls([0] * len(caches))
        padding = [longest - n for n in lengths]
        held = [c for c in caches if c.keys is not None]
        H = max(c.keys.shape[1] for c in held)
        Dk = max(c.keys.shape[3] for c in held)
        Dv = max(c.values.shape[3] for c in held)
        dtype = held[0].keys.dtype
        keys = mx.zeros((len(caches), H, longest, Dk), dtype=dtype)
        values = mx.zeros((len(caches), H, longest, Dv), dtype=dtype)
        for i, (p, c) in enumerate(zip(padding, caches)):
            if c.keys is None:
                continue
            keys[i : i + 1, :, p : p + c.offset] = c.keys[..., : c.offset, :]
            values[i : i + 1, :, p : p + c.offset] = c.values[..., : c.offset, :]
        out = cls(padding)
        out.keys, out.values = keys, values
        out.offset += longest
        out._idx = longest
        return out

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return array_bytes(self.keys, self.values)

    def introspect(self) -> CacheView:
        """Offsets are on the padded timeline; reads the B left-padding ints."""
        cap = 0 if self.keys is None else self.keys.shape[2]
        held = min(self._idx, cap)
        pads = tuple(int(p) for p in self.left_padding.tolist())
        return _row_view(self, "linear", self._idx, cap, held, self._idx, pads)


class BatchRotatingKVCache(LayerCache):
    """mlx-lm's ``BatchRotatingKVCache(max_size, left_padding)``: a ring of ``max_size`` slots
    (no sink tokens) for left-padded rows. ``_offset`` counts the padded timeline, ``rotated``
    says the ring has wrapped and ``_idx`` is the next slot to write; ``left_padding`` counts
    the padding slots still inside the window (it goes negative once they are evicted)."""

    step = STEP
    _lengths = None
    _STATE = ("keys", "values", "offset", "left_padding", "max_size", "_offset", "_idx", "rotated")

    def __init__(self, max_size: int, left_padding: list[int]):
        self.max_size = check_int("max_size", max_size, 1, "BatchRotatingKVCache")
        self.keys = None
        self.values = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self._offset = 0
        self.rotated = False
        # Right-padded prefills: each row's true end, so padding never evicts real tokens.
        self._lengths = None

    def _time_order(self) -> None:
        """Unwrap the ring in place: oldest slot first.

        mlx-lm's batch ring knows it wrapped by ``rotated`` (which a trim leaves set), not by
        ``_idx < offset`` as the single ring does, so this stays apart from core.ring's order.
        """
        if self.rotated:
            self.keys = mx.roll(self.keys, -self._idx, axis=2)
            self.values = mx.roll(self.values, -self._idx, axis=2)
            self._idx = self.keys.shape[2]
            self.rotated = False

    def _append_block(self, keys: mx.array, values: mx.array):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self._time_order()
            if self.keys.shape[2] > self._idx:
                self.keys = self.keys[..., : self._idx, :]
                self.values = self.values[..., : self._idx, :]
            if self._lengths is not None:
                # Rows already past their true length roll right, so the cut below drops padding.
                shift = mx.maximum(0, self.offset - self._lengths)
                self.keys = roll_rows(self.keys, shift[:, None])
                self.values = roll_rows(self.values, shift[:, None])
                self.left_padding += shift
                self.offset = self.offset - shift
            drop, _ = ring.make_room(self._idx, keys.shape[2], self.max_size)
            if drop:
                self.left_padding -= drop
                self.keys = self.keys[..., drop:, :]
                self.values = self.values[..., drop:, :]
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        self.offset = self.offset + keys.shape[2]
        self._offset += keys.shape[2]
        self._idx = self.keys.shape[2]
        # The per-row bookkeeping is computed with the keys, never left pending.
        self.keys = mx.depends(self.keys, (self.left_padding, self.offset))
        return self.keys, self.values

    def _write_one(self, keys: mx.array, values: mx.array):
        if self._lengths is not None:
            raise RuntimeError("BatchRotatingKVCache: call finalize() after a right-padded prefill before decoding")
        S = keys.shape[2]
        cap = 0 if self.keys is None else self.keys.shape[2]
        w = ring.write_one(self._offset, self._idx, cap, self.max_size, 0, self.step)
        if w.grow is not None:
            fresh_k, fresh_v = zeros_like_tokens(keys, w.grow), zeros_like_tokens(values, w.grow)
            if self.keys is None:
                self.keys, self.values = fresh_k, fresh_v
            else:
                self.keys = mx.concatenate([self.keys, fresh_k], axis=2)
                self.values = mx.concatenate([self.values, fresh_v], axis=2)
        if w.cut:
            self.keys = self.keys[..., w.cut :, :]
            self.values = self.values[..., w.cut :, :]
            self.left_padding -= w.cut
        if w.wraps:
            self.rotated = True
        if self.rotated:
            self.left_padding -= S
        i = w.slot
        self.keys[..., i : i + S, :] = keys
        self.values[..., i : i + S, :] = values
        self._offset += S
        self.offset = self.offset + S
        self._idx = i + S
        self.keys = mx.depends(self.keys, (self.left_padding, self.offset))
        return self.keys_and_values()

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.shape[2] == 1:
            return self._write_one(keys, values)
        return self._append_block(keys, values)

    def keys_and_values(self):
        n = self._offset
        if n < self.keys.shape[2]:
            return self.keys[..., :n, :], self.values[..., :n, :]
        return self.keys, self.values

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """Before a prefill: extra left padding (only while empty), or the true ``lengths`` of a
        right-padded prompt batch, undone by :meth:`finalize`."""
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError(
                    "BatchRotatingKVCache.prepare: left_padding can only be added while the cache is empty"
                )
            left_padding = mx.array(left_padding)
            self.left_padding += left_padding
            self.offset = self.offset - left_padding
        if right_padding is not None and max(right_padding) > 0:
            self._lengths = mx.array(lengths) + self.offset

    def finalize(self) -> None:
        if self._lengths is not None:
            shift = mx.maximum(0, self.offset - self._lengths)
            self.keys = roll_rows(self.keys, shift[:, None])
            self.values = roll_rows(self.values, shift[:, None])
            self.left_padding += shift
            self.offset = self.offset - shift
            self._lengths = None

    @property
    def state(self):
        return (
            self.keys,
            self.values,
            self.offset,
            self.left_padding,
            self.max_size,
            self._offset,
            self._idx,
            self.rotated,
        )

    @state.setter
    def state(self, v):
        keys, values, offset, left_padding, max_size, tokens, idx, rotated = self._unpack_state(v, 8)
        where = "BatchRotatingKVCache"
        offset, left_padding = _batch_state_checks(keys, values, offset, left_padding, where)
        check_int("max_size", max_size, 1, where + " state")
        check_int("_offset", tokens, 0, where + " state")
        if not isinstance(idx, int) or isinstance(idx, bool):
            raise ValueError(f"{where} state: _idx must be an integer, got {idx!r}")
        if not isinstance(rotated, (bool, int)):
            raise ValueError(f"{where} state: rotated must be a bool, got {rotated!r}")
        self.keys, self.values, self.offset, self.left_padding = keys, values, offset, left_padding
        self.max_size, self._offset, self._idx, self.rotated = max_size, tokens, idx, bool(rotated)

    def is_trimmable(self) -> bool:
        return ring.trimmable(self._offset, self.max_size)

    def trim(self, n: int) -> int:
        n, self._offset, self._idx = ring.trim(check_trim(n, "BatchRotatingKVCache"), self._offset, self._idx)
        self.offset = self.offset - n
        return n

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        raise NotImplementedError(
            "BatchRotatingKVCache cannot be quantized (nor in mlx-lm); quantize the single-sequence "
            "RotatingKVCache instead (RotatingKVCache.to_quantized)"
        )

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        window = window_size or self.max_size
        offset = min(self.max_size - 1, self._offset)
        padding = self.left_padding
        # A block update will drop this many more of the oldest slots first.
        dropping = self._idx - self.max_size + int(N > 1)
        if dropping > 0:
            padding = padding - dropping
        wrapped = N == 1 and (self.rotated or self._idx >= self.max_size)
        if wrapped:
            padding = padding - 1
        mask = causal_mask(N, offset, window, padding)
        if wrapped:
            mask = mx.roll(mask, shift=ring.mask_slot(self._idx, self.max_size) + 1, axis=-1)
        return mask

    def filter(self, batch_indices) -> None:
        if self.keys is not None:
            self.keys = self.keys[batch_indices]
            self.values = self.values[batch_indices]
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]

    def extend(self, other: BatchRotatingKVCache) -> None:
        """Append ``other``'s rows, in place (both unwrapped first unless their rings line up)."""
        if self.keys is None and other.keys is None:
            _extend(self, other)
            return
        if self.rotated != other.rotated or self._idx != other._idx:
            self._time_order()
            other._time_order()
        _extend(self, other)
        self._offset = max(self._offset, other._offset)

    def extract(self, idx: int) -> RotatingKVCache:
        """Row ``idx`` without its padding, as a :class:`RotatingKVCache` (keep=0)."""
        out = RotatingKVCache(self.max_size)
        pad = max(0, self.left_padding.tolist()[idx])
        keys, values = self.keys[idx : idx + 1], self.values[idx : idx + 1]
        end = self._idx
        if self.rotated:
            keys = mx.roll(keys, -self._idx, axis=2)
            values = mx.roll(values, -self._idx, axis=2)
            end = self.max_size
        out.keys = mx.contiguous(keys[:, :, pad:end])
        out.values = mx.contiguous(values[:, :, pad:end])
        out.offset = self.offset.tolist()[idx]
        out._idx = out.keys.shape[2]
        return out

    @classmethod
    def merge(cls, caches) -> BatchRotatingKVCache:
        """Single-sequence rotating caches as the rows of one batch cache."""
        if not all(c.max_size == caches[0].max_size for c in caches):
            raise ValueError(
                "BatchRotatingKVCache.merge: caches must share max_size, got "
                + ", ".join(str(c.max_size) for c in caches)
            )
        offsets = [c.offset for c in caches]
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls(caches[0].max_size, [0] * len(caches))
        padding = [longest - n for n in lengths]
        held = [c for c in caches if c.keys is not None]
        H = max(c.keys.shape[1] for c in held)
        Dk = max(c.keys.shape[3] for c in held)
        Dv = max(c.values.shape[3] for c in held)
        dtype = held[0].keys.dtype
        keys = mx.zeros((len(caches), H, longest, Dk), dtype=dtype)
        values = mx.zeros((len(caches), H, longest, Dv), dtype=dtype)
        for i, (p, n, c) in enumerate(zip(padding, lengths, caches)):
            if c.keys is None:
                continue
            keys[i : i + 1, :, p : p + n] = c._time_ordered(c.keys)[..., -n:, :]
            values[i : i + 1, :, p : p + n] = c._time_ordered(c.values)[..., -n:, :]
        out = cls(caches[0].max_size, padding)
        out.keys, out.values = keys, values
        out.offset = mx.array(offsets)
        out._idx = out._offset = longest
        return out

    def size(self) -> int:
        return min(self._offset, self.max_size)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return array_bytes(self.keys, self.values)

    def row_slot_positions(self) -> np.ndarray:
        """(B, capacity): the position of row r's token in each slot, -1 where the slot holds
        nothing for that row (unused, padding, or a token a right-padded prefill pushed out).

        The view's ring table is on the padded timeline; a row's position there is the
        timeline position minus ``view.left_padding[r]``, and its held tokens are those at or
        after its ``left_padding`` (mlx-lm's count of padding slots still in the window).
        """
        view = self.introspect()
        timeline = view.slot_positions()  # (capacity,), -1: unused
        used = timeline >= 0
        if not used.any():
            return np.full((view.batch_size, view.capacity), -1, dtype=np.int64)
        oldest = timeline[used].min()
        pads = np.array(self.left_padding.tolist(), dtype=np.int64)[:, None]
        rows = timeline[None, :] - np.array(view.left_padding, dtype=np.int64)[:, None]
        held = used[None, :] & (timeline[None, :] >= oldest + pads) & (rows >= 0)
        return np.where(held, rows, -1)

    def introspect(self) -> CacheView:
        """Ring view on the padded timeline; ``left_padding[r]`` is where row r's position 0
        sits on it (reads the B row offsets). See :meth:`row_slot_positions` for rows."""
        cap = 0 if self.keys is None else self.keys.shape[2]
        held = min(self._offset, cap)
        starts = tuple(self._offset - int(o) for o in self.offset.tolist())
        return _row_view(self, "ring", self._offset, cap, held, self._idx, starts, max_capacity=self.max_size)


# merge() of the single-sequence caches builds these; kv.py and rotating.py are imported here,
# so the link is made here and imports run one way.
KVCache.batch_class = BatchKVCache
RotatingKVCache.batch_class = BatchRotatingKVCache
