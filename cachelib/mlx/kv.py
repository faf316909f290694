"""Full-precision caches whose slots hold tokens in order: :class:`KVCache` (step-allocated,
mlx-lm's default), :class:`ConcatenateKVCache` (grown by concatenation), :class:`ChunkedKVCache`
(drops tokens before the current chunk when the model asks) and :class:`StaticKVCache`
(preallocated to a fixed length, transformers' StaticCache on MLX).

Every array here is ``(B, H, T, D)`` with the token axis at 2; slot ``j`` holds the token at
absolute position ``start_position + j``.
"""

from __future__ import annotations

import mlx.core as mx

from ..core.units import STEP
from ..introspect import CacheView
from .base import (
    HeldInOrder,
    LayerCache,
    Written,
    array_bytes,
    check_array,
    check_int,
    check_kv_pair,
    check_trim,
    dtype_name,
    per_token_bytes,
    write_linear,
    zeros_like_tokens,
)
from .quantized import QuantizedKVCache, check_bits, check_group_size, quantize


def _linear_view(cache, held: int, capacity: int, max_capacity=None, start: int = 0, write_index=None) -> CacheView:
    total = cache.nbytes
    keys = cache.keys
    return CacheView(
        kind=type(cache).__name__,
        layout="linear",
        offset=cache.offset,
        tokens_held=held,
        capacity=capacity,
        max_capacity=max_capacity,
        bytes_used=per_token_bytes(total, capacity) * held,
        bytes_allocated=total,
        write_index=held if write_index is None else write_index,
        start_position=start,
        batch_size=1 if keys is None else keys.shape[0],
        dtype=dtype_name(keys),
    )


class KVCache(HeldInOrder, LayerCache):
    """mlx-lm's default cache: a buffer grown by whole steps of ``step`` tokens (256), written
    in place; ``update_and_fetch`` returns the filled prefix.

    ``step`` (keyword-only, beyond mlx-lm) sets the growth; the default is mlx-lm's.
    """

    step = STEP
    _STATE = ("keys", "values", "offset")

    def __init__(self, *, step: int | None = None):
        self.keys = None
        self.values = None
        self.offset = 0
        if step is not None:
            self.step = check_int("step", step, 1, "KVCache")

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        prev = self.offset
        self.keys = write_linear(self.keys, prev, keys, self.step)
        self.values = write_linear(self.values, prev, values, self.step)
        self.offset = prev + keys.shape[2]
        self.written = Written(prev, self.offset, True)
        return self.keys_and_values()

    def keys_and_values(self):
        n = self.offset
        if n < self.keys.shape[2]:
            return self.keys[..., :n, :], self.values[..., :n, :]
        return self.keys, self.values

    def size(self) -> int:
        return self.offset

    @property
    def state(self):
        return self.keys, self.values, self.offset

    @state.setter
    def state(self, v):
        keys, values, offset = self._unpack_state(v, 3)
        _check_linear_state(keys, values, offset, "KVCache")
        self.keys, self.values, self.offset = keys, values, offset

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> QuantizedKVCache:
        """The same tokens in a :class:`QuantizedKVCache` (the whole buffer is quantized)."""
        where = "KVCache.to_quantized"
        check_group_size(group_size, where)
        check_bits("bits", bits, where)
        out = QuantizedKVCache(group_size=group_size, bits=bits)
        out.offset = self.offset
        if self.keys is not None:
            out._check_dims(self.keys, self.values)
            out.keys = quantize(self.keys, group_size, bits)
            out.values = quantize(self.values, group_size, bits)
        return out

    # The batch cache that merge() builds; set by .batch, which imports this module.
    batch_class: type[LayerCache]

    @classmethod
    def merge(cls, caches):
        """One left-padded :class:`~cachelib.mlx.batch.BatchKVCache` holding each cache as a
        batch row."""
        return cls.batch_class.merge(caches)

    def introspect(self) -> CacheView:
        cap = 0 if self.keys is None else self.keys.shape[2]
        return _linear_view(self, min(self.offset, cap), cap, write_index=self.offset)


def _check_linear_state(keys, values, offset, where: str) -> None:
    check_array("keys", keys, where)
    check_array("values", values, where)
    check_kv_pair(keys, values, where)
    check_int("offset", offset, 0, where + " state")
    if keys is not None and offset > keys.shape[2]:
        raise ValueError(f"{where} state: offset={offset} exceeds the {keys.shape[2]} slots stored")


class ConcatenateKVCache(HeldInOrder, LayerCache):
    """The simplest cache: every update is concatenated onto what is held.

    As in mlx-lm, ``trim`` lowers ``offset`` only; the held arrays keep the trimmed tokens and
    the next update sets ``offset`` back to the number of tokens held.
    """

    _STATE = ("keys", "values")

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.keys is None:
            held = 0
            self.keys, self.values = keys, values
        else:
            held = self.keys.shape[2]
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        self.offset = self.keys.shape[2]
        self.written = Written(held, self.offset, True)
        return self.keys, self.values

    def keys_and_values(self):
        return self.keys, self.values

    @property
    def state(self):
        return self.keys, self.values

    @state.setter
    def state(self, v):
        keys, values = self._unpack_state(v, 2)
        where = "ConcatenateKVCache"
        check_array("keys", keys, where)
        check_array("values", values, where)
        check_kv_pair(keys, values, where)
        self.keys, self.values = keys, values
        self.offset = 0 if keys is None else keys.shape[2]

    def introspect(self) -> CacheView:
        cap = 0 if self.keys is None else self.keys.shape[2]
        return _linear_view(self, cap, cap)


class ChunkedKVCache(LayerCache):
    """mlx-lm's ``ChunkedKVCache(chunk_size)``: a step-allocated cache whose front is dropped by
    :meth:`maybe_trim_front` (called by the model, e.g. llama4, before each forward) so that at
    most ``chunk_size`` tokens remain. Slot 0 holds position ``start_position``.

    Like mlx-lm's, it has no ``make_mask``: the model builds the chunk mask itself, and
    ``size()`` is 0. Only chunked-attention models (llama4) call ``maybe_trim_front``; with
    ``trim_front=True`` (what ``make_cache`` uses for the ``chunked`` strategy) the cache calls it
    itself before every update, so it bounds memory under any model.
    """

    step = STEP
    trim_front = False  # not part of state: a cache rebuilt from a file waits for the model's call
    _STATE = ("keys", "values", "offset", "chunk_size", "start_position")

    def __init__(self, chunk_size: int, *, trim_front: bool = False):
        self.chunk_size = check_int("chunk_size", chunk_size, 1, "ChunkedKVCache")
        self.trim_front = trim_front
        self.keys = None
        self.values = None
        self.offset = 0
        self.start_position = 0

    def maybe_trim_front(self) -> None:
        """Drop the oldest tokens so that at most ``chunk_size`` remain."""
        if self.keys is None:
            return
        held = self.offset - self.start_position
        excess = held - self.chunk_size
        if excess > 0:
            self.start_position += excess
            self.keys = self.keys[..., excess:held, :]
            self.values = self.values[..., excess:held, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.trim_front:
            self.maybe_trim_front()
        prev = self.offset - self.start_position
        self.keys = write_linear(self.keys, prev, keys, self.step)
        self.values = write_linear(self.values, prev, values, self.step)
        self.offset += keys.shape[2]
        return self.keys_and_values()

    def keys_and_values(self):
        n = self.offset - self.start_position
        return self.keys[..., :n, :], self.values[..., :n, :]

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.chunk_size, self.start_position

    @state.setter
    def state(self, v):
        keys, values, offset, chunk_size, start = self._unpack_state(v, 5)
        where = "ChunkedKVCache"
        check_int("chunk_size", chunk_size, 1, where + " state")
        check_int("start_position", start, 0, where + " state")
        if offset < start:
            raise ValueError(f"{where} state: offset={offset} is before start_position={start}")
        _check_linear_state(keys, values, offset - start, where)
        self.keys, self.values, self.offset = keys, values, offset
        self.chunk_size, self.start_position = chunk_size, start

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset - self.start_position, check_trim(n, "ChunkedKVCache"))
        self.offset -= n
        return n

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return array_bytes(self.keys, self.values)

    def introspect(self) -> CacheView:
        cap = 0 if self.keys is None else self.keys.shape[2]
        held = min(self.offset - self.start_position, cap)
        return _linear_view(self, held, cap, start=self.start_position, write_index=held)


class StaticKVCache(HeldInOrder, LayerCache):
    """A cache preallocated to ``max_len`` tokens at the first update (transformers' StaticCache
    on MLX). An update that would pass ``max_len`` is refused with a ValueError and leaves the
    cache unchanged."""

    _STATE = ("keys", "values", "offset", "max_len")

    def __init__(self, max_len: int):
        self.max_len = check_int("max_len", max_len, 1, "StaticKVCache")
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        prev = self.offset
        end = prev + keys.shape[2]
        if end > self.max_len:
            raise ValueError(
                f"StaticKVCache: max_len={self.max_len} tokens are preallocated and {prev} are held; "
                f"an update of {keys.shape[2]} tokens does not fit (allowed: at most {self.max_len - prev})"
            )
        if self.keys is None:
            self.keys = zeros_like_tokens(keys, self.max_len)
            self.values = zeros_like_tokens(values, self.max_len)
        self.keys[..., prev:end, :] = keys
        self.values[..., prev:end, :] = values
        self.offset = end
        self.written = Written(prev, end, True)
        return self.keys_and_values()

    def keys_and_values(self):
        n = self.offset
        if n < self.max_len:
            return self.keys[..., :n, :], self.values[..., :n, :]
        return self.keys, self.values

    def size(self) -> int:
        return self.offset

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.max_len

    @state.setter
    def state(self, v):
        keys, values, offset, max_len = self._unpack_state(v, 4)
        where = "StaticKVCache"
        check_int("max_len", max_len, 1, where + " state")
        _check_linear_state(keys, values, offset, where)
        if keys is not None and keys.shape[2] != max_len:
            raise ValueError(f"{where} state: keys hold {keys.shape[2]} slots but max_len={max_len}")
        if offset > max_len:
            raise ValueError(f"{where} state: offset={offset} exceeds max_len={max_len}")
        self.keys, self.values, self.offset, self.max_len = keys, values, offset, max_len

    def introspect(self) -> CacheView:
        cap = 0 if self.keys is None else self.max_len
        return _linear_view(self, min(self.offset, cap), cap, max_capacity=self.max_len, write_index=self.offset)


# --- builders named by the strategy table (cachelib.spec.STRATEGIES): (spec) -> layer cache


def build_standard(spec) -> KVCache:
    return KVCache(step=spec.get("step"))


def build_concat(spec) -> ConcatenateKVCache:
    return ConcatenateKVCache()


def build_chunked(spec) -> ChunkedKVCache:
    # the front is trimmed before every update, as mlx-lm's llama4 drives its chunked layers
    return ChunkedKVCache(spec.get("chunk_size"), trim_front=True)


def build_static(spec) -> StaticKVCache:
    return StaticKVCache(spec.get("max_len"))
