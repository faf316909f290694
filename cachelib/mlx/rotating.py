"""Ring-buffer caches that hold at most ``max_size`` tokens, the first ``keep`` of them forever
(attention sinks): mlx-lm's :class:`RotatingKVCache` and, beyond mlx-lm, the same ring stored
group-wise quantized (:class:`QuantizedRotatingKVCache`).

Layout (token axis 2 of every stored array): slots ``[0, keep)`` hold positions ``0..keep-1``;
the ring slots ``[keep, max_size)`` are overwritten in turn, ``_idx`` pointing at the next slot
to write. A single-token update writes in place (the buffer first grows in steps of 256 up to
``max_size``); a multi-token update first puts the held tokens in temporal order, then drops the
oldest ring tokens so that every new token still sees ``max_size`` tokens, and appends - so the
buffer briefly holds up to ``max_size + S - 1`` tokens. Keys come back in slot order, which is
why a single query needs a rolled mask when a window narrower than the ring applies.

The slot arithmetic (what grows, what is cut, which slot is written) is :mod:`cachelib.core.ring`'s;
the classes here apply it to their arrays.
"""

from __future__ import annotations

import mlx.core as mx

from ..core import ring
from ..core.masks import visible
from ..core.units import STEP
from ..introspect import CacheView
from .base import (
    LayerCache,
    Written,
    array_bytes,
    causal_mask,
    check_int,
    check_kv_pair,
    check_trim,
    dtype_name,
    each,
    per_token_bytes,
    token_length,
    zeros_like_tokens,
)
from .quantized import QuantizingCache, check_bits, dequantize, error_terms, quantize


def _cut(x, keep: int, n: int, tail=None):
    """``x`` without its ring slots ``[keep, keep + n)`` (when n > 0), ``tail`` appended;
    part by part for quantized storage."""
    if isinstance(x, (list, tuple)):
        tails = tail if tail is not None else [None] * len(x)
        return [_cut(p, keep, n, t) for p, t in zip(x, tails)]
    pieces = [x[..., :keep, :], x[..., n + keep :, :]] if n > 0 else [x]
    if tail is not None:
        pieces.append(tail)
    return mx.concatenate(pieces, axis=2)


def _check_ring(max_size, keep, where: str) -> None:
    check_int("max_size", max_size, 1, where)
    check_int("keep", keep, 0, where)
    if keep >= max_size:
        raise ValueError(f"{where}: keep={keep} must be < max_size={max_size} (allowed: 0..{max_size - 1})")


class _Ring(LayerCache):
    """The ring bookkeeping shared by the plain and the quantized ring. Subclasses say how
    incoming keys/values are stored (:meth:`_stored`) and handed back (:meth:`_fetched`)."""

    step = STEP
    keep = 0
    max_size = 0
    offset = 0
    _idx = 0

    def _stored(self, keys: mx.array, values: mx.array):
        return keys, values

    def _fetched(self, keys, values):
        return keys, values

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.shape[2] == 1:
            return self._write_one(keys, values)
        return self._append_block(keys, values)

    def _in_order(self, x, wrapped: bool, held: int):
        """``x``'s held tokens oldest first (the sink slots first), unused slots cut off."""
        if wrapped:
            idx, keep = self._idx, self.keep
            return each(lambda p: mx.concatenate([p[..., :keep, :], p[..., idx:, :], p[..., keep:idx, :]], axis=2), x)
        if held < token_length(x):
            return each(lambda p: p[..., :held, :], x)
        return x

    def _time_ordered(self, x):
        """The held tokens of ``x`` (keys or values) oldest first."""
        return self._in_order(x, *ring.temporal_order(self.offset, self._idx, token_length(x), self.keep))

    def _append_block(self, keys: mx.array, values: mx.array):
        new_k, new_v = self._stored(keys, values)
        n = keys.shape[2]
        cap = 0 if self.keys is None else token_length(self.keys)
        plan = ring.write_block(n, self.offset, self._idx, cap, self.max_size, self.keep)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = _cut(self._in_order(self.keys, plan.wrapped, plan.held), self.keep, plan.drop, new_k)
            self.values = _cut(self._in_order(self.values, plan.wrapped, plan.held), self.keep, plan.drop, new_v)
        self.offset += n
        self._idx = plan.capacity
        self.written = None  # the held tokens were put in time order: slots may all have moved
        return self._fetched(self.keys, self.values)

    def _write_one(self, keys: mx.array, values: mx.array):
        new_k, new_v = self._stored(keys, values)
        cap = 0 if self.keys is None else token_length(self.keys)
        w = ring.write_one(self.offset, self._idx, cap, self.max_size, self.keep, self.step)
        if w.grow is not None:
            fresh_k = each(lambda p: zeros_like_tokens(p, w.grow), new_k)
            fresh_v = each(lambda p: zeros_like_tokens(p, w.grow), new_v)
            if self.keys is None:
                self.keys, self.values = fresh_k, fresh_v
            else:
                self.keys = _cut(self.keys, self.keep, 0, fresh_k)
                self.values = _cut(self.values, self.keep, 0, fresh_v)
        if w.cut:
            self.keys = _cut(self.keys, self.keep, w.cut)
            self.values = _cut(self.values, self.keep, w.cut)
        i = w.slot
        if isinstance(new_k, (list, tuple)):
            for buf, p in zip(self.keys, new_k):
                buf[..., i : i + 1, :] = p
            for buf, p in zip(self.values, new_v):
                buf[..., i : i + 1, :] = p
        else:
            self.keys[..., i : i + 1, :] = new_k
            self.values[..., i : i + 1, :] = new_v
        self.offset += 1
        self._idx = i + 1
        # one slot written, the others where they were (a cut moves them all)
        self.written = None if w.cut else Written(i, i + 1, new_k is keys)
        return self.keys_and_values()

    def keys_and_values(self):
        n = self.offset
        keys, values = self.keys, self.values
        if n < token_length(keys):
            keys = each(lambda p: p[..., :n, :], keys)
            values = each(lambda p: p[..., :n, :], values)
        return self._fetched(keys, values)

    def size(self) -> int:
        return min(self.offset, self.max_size)

    def is_trimmable(self) -> bool:
        return ring.trimmable(self.offset, self.max_size)

    def trim(self, n: int) -> int:
        n, self.offset, self._idx = ring.trim(check_trim(n, type(self).__name__), self.offset, self._idx)
        return n

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        if N > 1:
            window = window_size or self.max_size
            # After a block update the first returned key is max_size - 1 tokens back.
            offset = min(self.max_size - 1, self.offset)
            if offset + N > window or return_array:
                return causal_mask(N, offset, window)
            return "causal"
        if window_size is None:
            return None
        if self.offset >= window_size and self.max_size > window_size:
            # One query over the ring in slot order: the window over the n keys in time order,
            # rolled so that the newest lands in the slot being written.
            n = min(self.offset + 1, self.max_size)
            in_time = visible(n - 1, mx.arange(n), window_size)
            return mx.roll(in_time, shift=ring.mask_slot(self._idx, self.max_size) + 1)
        return None

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return array_bytes(self.keys, self.values)

    def _view(self, **quant) -> CacheView:
        keys = self.keys
        cap = 0 if keys is None else token_length(keys)
        held = min(self.offset, cap)
        total = array_bytes(keys, self.values)
        return CacheView(
            kind=type(self).__name__,
            layout="ring",
            offset=self.offset,
            tokens_held=held,
            capacity=cap,
            max_capacity=self.max_size,
            bytes_used=per_token_bytes(total, cap) * held,
            bytes_allocated=total,
            write_index=self._idx,
            keep=self.keep,
            batch_size=1 if keys is None else (keys[0] if isinstance(keys, (list, tuple)) else keys).shape[0],
            dtype=dtype_name(keys),
            **quant,
        )

    def _set_ring_state(self, keys, values, offset, keep, max_size, idx) -> None:
        where = type(self).__name__
        _check_ring(max_size, keep, where + " state")
        check_int("offset", offset, 0, where + " state")
        if not isinstance(idx, int) or isinstance(idx, bool):
            raise ValueError(f"{where} state: _idx must be an integer, got {idx!r}")
        check_kv_pair(keys, values, where)
        self.keys, self.values, self.offset = keys, values, offset
        self.keep, self.max_size, self._idx = keep, max_size, idx


class RotatingKVCache(_Ring):
    """mlx-lm's ``RotatingKVCache(max_size, keep=0)``: at most ``max_size`` tokens, the first
    ``keep`` never evicted. :meth:`to_quantized` (mlx-lm: not implemented) gives the same ring
    as a :class:`QuantizedRotatingKVCache`."""

    _STATE = ("keys", "values", "offset", "keep", "max_size", "_idx")

    def __init__(self, max_size: int, keep: int = 0):
        _check_ring(max_size, keep, "RotatingKVCache")
        self.keep = keep
        self.keys = None
        self.values = None
        self.offset = 0
        self.max_size = max_size
        self._idx = 0

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.keep, self.max_size, self._idx

    @state.setter
    def state(self, v):
        keys, values, offset, keep, max_size, idx = self._unpack_state(v, 6)
        for name, x in (("keys", keys), ("values", values)):
            if x is not None and not isinstance(x, mx.array):
                raise ValueError(f"RotatingKVCache state: {name} must be an mx.array or None")
        self._set_ring_state(keys, values, offset, keep, max_size, idx)

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> QuantizedRotatingKVCache:
        """The same ring, its stored tokens quantized (beyond mlx-lm)."""
        out = QuantizedRotatingKVCache(self.max_size, self.keep, group_size=group_size, bits=bits)
        out.offset, out._idx = self.offset, self._idx
        if self.keys is not None:
            out._check_dims(self.keys, self.values)
            out.keys = quantize(self.keys, group_size, bits)
            out.values = quantize(self.values, group_size, bits)
        return out

    # The batch cache that merge() builds; set by .batch, which imports this module.
    batch_class: type[LayerCache]

    @classmethod
    def merge(cls, caches):
        """One left-padded :class:`~cachelib.mlx.batch.BatchRotatingKVCache` holding each cache
        as a batch row."""
        return cls.batch_class.merge(caches)

    def introspect(self) -> CacheView:
        return self._view()


class QuantizedRotatingKVCache(_Ring, QuantizingCache):
    """The ring of :class:`RotatingKVCache` stored group-wise quantized (beyond mlx-lm, where
    ``RotatingKVCache.to_quantized`` is not implemented). With one width for keys and values
    it exposes ``bits`` and hands mlx-lm's quantized attention the (packed, scales, biases)
    parts; with ``key_bits != value_bits`` it hands back dequantized arrays."""

    _hands_back_codes = True

    _STATE = ("keys", "values", "offset", "keep", "max_size", "_idx", "group_size", "key_bits", "value_bits")

    def __init__(
        self,
        max_size: int,
        keep: int = 0,
        group_size: int = 64,
        bits: int = 8,
        *,
        key_bits: int | None = None,
        value_bits: int | None = None,
    ):
        where = "QuantizedRotatingKVCache"
        _check_ring(max_size, keep, where)
        check_bits("bits", bits, where)
        self._set_widths(
            group_size, bits if key_bits is None else key_bits, bits if value_bits is None else value_bits, where
        )
        self.keep = keep
        self.keys = None
        self.values = None
        self.offset = 0
        self.max_size = max_size
        self._idx = 0

    @property
    def bits(self) -> int:
        if self.key_bits != self.value_bits:
            raise AttributeError("bits: keys and values use different widths; see key_bits, value_bits")
        return self.key_bits

    @bits.setter
    def bits(self, value: int) -> None:
        self.key_bits = self.value_bits = check_bits("bits", value, "QuantizedRotatingKVCache")

    def _stored(self, keys: mx.array, values: mx.array):
        if self.keys is None:
            self._check_dims(keys, values)
        gs = self.group_size
        qk = quantize(keys, gs, self.key_bits)
        qv = quantize(values, gs, self.value_bits)
        if self.track_error:
            self._record(error_terms(keys, qk, gs, self.key_bits), error_terms(values, qv, gs, self.value_bits))
        return qk, qv

    def _fetched(self, keys, values):
        if self.key_bits != self.value_bits:
            gs = self.group_size
            return dequantize(keys, gs, self.key_bits), dequantize(values, gs, self.value_bits)
        return keys, values

    @property
    def state(self):
        return (
            self.keys,
            self.values,
            self.offset,
            self.keep,
            self.max_size,
            self._idx,
            self.group_size,
            self.key_bits,
            self.value_bits,
        )

    @state.setter
    def state(self, v):
        keys, values, offset, keep, max_size, idx, group_size, key_bits, value_bits = self._unpack_state(v, 9)
        where = "QuantizedRotatingKVCache"
        for name, x in (("keys", keys), ("values", values)):
            if x is not None and (not isinstance(x, (list, tuple)) or len(x) != 3):
                raise ValueError(f"{where} state: {name} must be 3 quantized parts (packed, scales, biases) or None")
        self._set_widths(group_size, key_bits, value_bits, where)
        self._set_ring_state(keys, values, offset, keep, max_size, idx)

    def introspect(self) -> CacheView:
        held = min(self.offset, 0 if self.keys is None else token_length(self.keys))
        return self._view(
            key_bits=self.key_bits,
            value_bits=self.value_bits,
            group_size=self.group_size,
            quantized_tokens=held,
            quant_error=self._last_error(),
        )


# --- builders named by the strategy table (cachelib.spec.STRATEGIES): (spec) -> layer cache


def build_rotating(spec) -> RotatingKVCache | QuantizedRotatingKVCache:
    max_size, keep = spec.get("max_size"), spec.get("keep")
    if spec.key_bits is None:
        return RotatingKVCache(max_size, keep)
    return QuantizedRotatingKVCache(
        max_size,
        keep,
        group_size=spec.get("group_size"),
        bits=spec.key_bits,
        key_bits=spec.key_bits,
        value_bits=spec.value_bits,
    )


def build_sliding(spec) -> RotatingKVCache:
    # a sliding window is a ring without sink tokens, as mlx-lm gives its sliding layers
    return RotatingKVCache(spec.get("window"), keep=0)
