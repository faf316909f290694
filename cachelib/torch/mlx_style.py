"""mlx-lm's step-allocated strategies on PyTorch: ``KVCache``, ``QuantizedKVCache`` and
``ChunkedKVCache``, as whole-model transformers caches over per-layer classes.

Slot layout and growth follow mlx-lm 0.32 exactly, so byte counts match the MLX classes of the
same name: storage grows ``step`` (256) slots at a time, new tokens are written in place (no
per-step concatenation), and ``update`` returns a view of the filled slots. A quantized layer
returns its states dequantized, because transformers' attention takes plain tensors.

Beyond mlx-lm: ``QuantizedKVCache`` takes ``start`` (stay at full precision until that many
tokens were seen, then quantize everything held: mlx-lm's ``--quantized-kv-start``) and
separate ``key_bits`` / ``value_bits``. ``ChunkedKVCacheLayer`` drops tokens before the current
chunk window at each update itself (mlx-lm leaves that call, ``maybe_trim_front``, to the model,
and transformers models do not make it).
"""

from __future__ import annotations

import torch

from ..core.units import STEP
from ..introspect import CacheView, Written
from .base import (
    AttentionLayer,
    Dequantized,
    QuantErrorProbe,
    changed_slots,
    check_crop,
    dequantized,
    dtype_name,
    tokens,
)
from .cache import Cache, build_layers
from .quantizer import check_bits, check_group_size, check_head_dim
from .storage import DENSE, QuantizedCodec, clone, encode_pair, grow, head, span, write, zeros


def check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1 (tokens added per growth), got {step!r}")
    return step


def _growth(step: int, n_new: int) -> int:
    """Slots added when ``n_new`` tokens do not fit: whole steps covering them."""
    return (step + n_new - 1) // step * step


class StepLayer(AttentionLayer):
    """Shared by the step-allocated layers: bookkeeping of ``offset``, trim and introspection."""

    def __init__(self, step: int = STEP):
        super().__init__()
        self.step = check_step(step)
        self.offset = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        # Storage is allocated by the first update, as in mlx-lm.
        self.device = key_states.device
        self.is_initialized = True

    def _codecs(self):
        return DENSE, DENSE

    def _fetch(self, held: int, key_dtype, value_dtype):
        """The first ``held`` slots, as plain tensors (views when stored at full precision)."""
        key_codec, value_codec = self._codecs()
        keys, values = head(self.keys, held), head(self.values, held)
        return key_codec.decode(keys, key_dtype), value_codec.decode(values, value_dtype)

    def _store(self, key_states, value_states) -> int:
        """Store the new tokens (setting :attr:`written`); returns the slots ``update`` returns."""
        raise NotImplementedError

    def update(self, key_states, value_states, *args, **kwargs):
        held = self._store(key_states, value_states)
        return self._fetch(held, key_states.dtype, value_states.dtype)

    def update_changed(self, key_states, value_states, held: int, need: int):
        length = self._store(key_states, value_states)
        start, end = changed_slots(self.written, held, need, length)
        key_codec, value_codec = self._codecs()
        keys, values = span(self.keys, start, end), span(self.values, start, end)
        return start, key_codec.decode(keys, key_states.dtype), value_codec.decode(values, value_states.dtype), length

    def get_seq_length(self) -> int:
        return self.offset

    def is_trimmable(self) -> bool:
        return True

    def reset(self) -> None:
        self.keys = self.values = None
        self.offset = 0
        self.is_initialized = False

    def _introspect(self, held: int, start_position: int = 0, max_capacity: int | None = None, **extra) -> CacheView:
        capacity = tokens(self.keys)
        allocated = self.nbytes
        scales = self.keys[1] if isinstance(self.keys, tuple) else self.keys
        return self._view(
            layout="linear",
            offset=self.offset,
            tokens_held=held,
            capacity=capacity,
            max_capacity=max_capacity,
            bytes_used=allocated * held // capacity if capacity else 0,
            write_index=held,
            start_position=start_position,
            dtype=dtype_name(scales.dtype) if scales is not None else "",
            **extra,
        )


class KVCacheLayer(StepLayer):
    """mlx-lm's ``KVCache``: slots grow by whole steps; slot j holds position j."""

    kind = "KVCache"

    def update(self, key_states, value_states, *args, **kwargs):
        keys, prev, n_new = self.keys, self.offset, key_states.shape[-2]
        if type(keys) is torch.Tensor and prev + n_new <= keys.shape[2] and type(self) is KVCacheLayer:
            # The decode step of the full-precision cache: two in-place writes, two views.
            end = self.offset = prev + n_new
            keys.narrow(2, prev, n_new).copy_(key_states)
            self.values.narrow(2, prev, n_new).copy_(value_states)
            self.written = Written(prev, end, True)
            return keys.narrow(2, 0, end), self.values.narrow(2, 0, end)
        return super().update(key_states, value_states)

    def _store(self, key_states, value_states) -> int:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        converted = getattr(self, "quantized", False)
        new_keys, new_values = self._encode(key_states, value_states)
        prev, n_new = self.offset, key_states.shape[-2]
        if self.keys is None:
            self.keys, self.values = (
                zeros(new_keys, _growth(self.step, n_new)),
                zeros(new_values, _growth(self.step, n_new)),
            )
        elif prev + n_new > tokens(self.keys):
            # Drop unused slots past a partial step first (mlx-lm does), then add whole steps.
            keep = prev if prev % self.step else tokens(self.keys)
            extra = _growth(self.step, n_new)
            self.keys, self.values = grow(self.keys, keep, extra), grow(self.values, keep, extra)
        self.offset += n_new
        write(self.keys, prev, new_keys)
        write(self.values, prev, new_values)
        # a conversion to quantized (``start`` reached) rewrote every held slot
        rewritten = converted != getattr(self, "quantized", False)
        self.written = None if rewritten else Written(prev, self.offset, self._codecs()[0] is DENSE)
        return self.offset

    def _encode(self, key_states, value_states):
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.offset + query_length, 0

    def trim(self, n: int) -> int:
        """mlx-lm's trim: forget the last ``n`` tokens (at most all); returns how many."""
        n = min(self.offset, n)
        self.offset -= n
        return n

    def crop(self, tokens_to_remove: int) -> None:
        self.trim(check_crop(tokens_to_remove, self.offset, type(self).__name__))

    def introspect(self) -> CacheView:
        return self._introspect(self.offset)


class QuantizedKVCacheLayer(QuantErrorProbe, KVCacheLayer):
    """mlx-lm's ``QuantizedKVCache``: ``KVCache`` slots holding quantized K/V.

    Until ``start`` tokens were seen it stores full precision; the first update after that
    quantizes all slots held (as mlx-lm's ``to_quantized``) and every later token on arrival.
    """

    kind = "QuantizedKVCache"
    _arrays = ("keys", "values")

    def __init__(
        self,
        group_size: int = 64,
        bits: int = 8,
        *,
        start: int = 0,
        key_bits: int | None = None,
        value_bits: int | None = None,
        step: int = STEP,
    ):
        super().__init__(step)
        where = type(self).__name__
        check_group_size(group_size, where)
        check_bits(bits, where)
        key_bits = check_bits(bits if key_bits is None else key_bits, where, "key_bits")
        value_bits = check_bits(bits if value_bits is None else value_bits, where, "value_bits")
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"{where}: start must be an int >= 0 (tokens kept at full precision), got {start!r}")
        self.group_size, self.bits, self.start = group_size, bits, start
        self.key_codec = QuantizedCodec(key_bits, group_size)
        self.value_codec = QuantizedCodec(value_bits, group_size)
        self.quantized = False

    def lazy_initialization(self, key_states, value_states) -> None:
        check_head_dim(key_states.shape[-1], self.group_size, type(self).__name__)
        check_head_dim(value_states.shape[-1], self.group_size, type(self).__name__)
        super().lazy_initialization(key_states, value_states)

    def _codecs(self):
        return (self.key_codec, self.value_codec) if self.quantized else (DENSE, DENSE)

    def _encode(self, key_states, value_states):
        pairs = []
        if not self.quantized and self.offset >= self.start:
            if self.keys is not None:
                dense_keys, dense_values = self.keys, self.values
                self.keys, self.values = encode_pair(self.key_codec, self.value_codec, dense_keys, dense_values)
                if self.track_error:
                    n = self.offset
                    k_hat = self.key_codec.dense(head(self.keys, n))
                    v_hat = self.value_codec.dense(head(self.values, n))
                    pairs.append((head(dense_keys, n), k_hat, head(dense_values, n), v_hat))
            self.quantized = True
        if not self.quantized:
            if self.track_error:
                self._record_error([])
            return key_states, value_states
        if self.track_error and not pairs and self._together(key_states, value_states):
            # keys and values quantized in one pass (as encode_pair), that pass's stack kept
            # for the error probe: nothing more to do here
            both_states = torch.stack((key_states, value_states))
            both = self.key_codec.encode(both_states)
            self._record_stacked(both_states, Dequantized(self.key_codec.quantizer, both))
            return tuple(t[0] for t in both), tuple(t[1] for t in both)
        new_keys, new_values = encode_pair(self.key_codec, self.value_codec, key_states, value_states)
        if self.track_error:
            pairs.append(
                (
                    key_states,
                    dequantized(self.key_codec, new_keys),
                    value_states,
                    dequantized(self.value_codec, new_values),
                )
            )
            self._record_error(pairs)
        return new_keys, new_values

    def update_changed(self, key_states, value_states, held: int, need: int):
        start, keys, values, length = super().update_changed(key_states, value_states, held, need)
        if self._pending_error is not None:  # the new tokens just decoded are the error's reconstruction
            self._decoded(start, keys, values, key_states, value_states)
        return start, keys, values, length

    def _together(self, key_states, value_states) -> bool:
        """Whether encode_pair quantizes these keys and values in one pass."""
        return (
            self.key_codec.bits == self.value_codec.bits
            and key_states.shape == value_states.shape
            and key_states.dtype == value_states.dtype
        )

    def reset(self) -> None:
        super().reset()
        self.quantized = False

    def introspect(self) -> CacheView:
        key_codec, value_codec = self._codecs()
        return self._introspect(
            self.offset,
            key_bits=key_codec.bits,
            value_bits=value_codec.bits,
            group_size=self.group_size if self.quantized else None,
            quantized_tokens=self.offset if self.quantized else 0,
            quant_error=self.quant_error,
        )


class ChunkedKVCacheLayer(StepLayer):
    """mlx-lm's ``ChunkedKVCache``: a ``KVCache`` that holds at most the last ``chunk_size``
    tokens before each update; slot j holds position ``start_position + j``."""

    kind = "ChunkedKVCache"

    def __init__(self, chunk_size: int, step: int = STEP):
        super().__init__(step)
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"ChunkedKVCacheLayer: chunk_size must be an int >= 1, got {chunk_size!r}")
        self.chunk_size = chunk_size
        self.start_position = 0

    def _excess(self) -> int:
        """Tokens the next front trim drops."""
        if self.keys is None:
            return 0
        return max(0, self.offset - self.start_position - self.chunk_size)

    def maybe_trim_front(self) -> None:
        """Keep only the last ``chunk_size`` tokens (mlx-lm's call, made by ``update`` here)."""
        excess = self._excess()
        if excess:
            valid = self.offset - self.start_position
            self.start_position += excess
            self.keys = clone(span(self.keys, excess, valid))
            self.values = clone(span(self.values, excess, valid))

    def _store(self, key_states, value_states) -> int:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n_new = key_states.shape[-2]
        excess, valid = self._excess(), self.offset - self.start_position
        # a front trim moved every held slot
        self.written = None if excess else Written(valid, valid + n_new, True)
        extra = _growth(self.step, n_new)
        if self.keys is None:
            self.keys, self.values = zeros(key_states, extra), zeros(value_states, extra)
        elif excess:
            # Trimming leaves exactly `chunk_size` slots, so the new tokens always need a step
            # more: trim and grow in one copy.
            self.start_position += excess
            kept = valid - excess
            self.keys = grow(span(self.keys, excess, valid), kept, extra)
            self.values = grow(span(self.values, excess, valid), kept, extra)
        elif valid + n_new > tokens(self.keys):
            keep = valid if valid % self.step else tokens(self.keys)
            self.keys, self.values = grow(self.keys, keep, extra), grow(self.values, keep, extra)
        prev = self.offset - self.start_position
        self.offset += n_new
        write(self.keys, prev, key_states)
        write(self.values, prev, value_states)
        return self.offset - self.start_position

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        start = self.start_position + self._excess()
        return self.offset - start + query_length, start

    def trim(self, n: int) -> int:
        n = min(self.offset - self.start_position, n)
        self.offset -= n
        return n

    def crop(self, tokens_to_remove: int) -> None:
        self.trim(check_crop(tokens_to_remove, self.offset - self.start_position, "ChunkedKVCacheLayer"))

    def reset(self) -> None:
        super().reset()
        self.start_position = 0

    def introspect(self) -> CacheView:
        # No max_capacity: the slots grow by steps past chunk_size (as on the MLX side).
        return self._introspect(self.offset - self.start_position, start_position=self.start_position)


class StrategyCache(Cache):
    """A whole-model cache whose full-attention layers all get ``make_layer()``; with a
    ``config``, sliding-window and recurrent layers keep their own layer classes, without one
    layers are created as the model updates them."""

    def __init__(self, make_layer, config=None):
        make_layer()  # validate the arguments now, not at the first update
        if config is None:
            super().__init__(layer_class_to_replicate=make_layer)
        else:
            super().__init__(layers=build_layers(config, make_layer))


class KVCache(StrategyCache):
    """mlx-lm's ``KVCache`` on every full-attention layer (``standard`` strategy)."""

    def __init__(self, config=None, step: int = STEP):
        super().__init__(lambda: KVCacheLayer(step), config)


class QuantizedKVCache(StrategyCache):
    """mlx-lm's ``QuantizedKVCache`` on every full-attention layer (``quantized`` strategy)."""

    def __init__(
        self,
        group_size: int = 64,
        bits: int = 8,
        *,
        start: int = 0,
        key_bits: int | None = None,
        value_bits: int | None = None,
        config=None,
        step: int = STEP,
    ):
        super().__init__(
            lambda: QuantizedKVCacheLayer(
                group_size, bits, start=start, key_bits=key_bits, value_bits=value_bits, step=step
            ),
            config,
        )


class ChunkedKVCache(StrategyCache):
    """mlx-lm's ``ChunkedKVCache`` on every full-attention layer (``chunked`` strategy)."""

    def __init__(self, chunk_size: int, config=None, step: int = STEP):
        super().__init__(lambda: ChunkedKVCacheLayer(chunk_size, step), config)


__all__ = [
    "KVCacheLayer",
    "QuantizedKVCacheLayer",
    "ChunkedKVCacheLayer",
    "KVCache",
    "QuantizedKVCache",
    "ChunkedKVCache",
    "StrategyCache",
    "check_step",
]


# --- builders named by the strategy table (cachelib.spec.STRATEGIES): (spec, config) -> Cache


def build_standard(spec, config) -> KVCache:
    return KVCache(config=config, step=spec.get("step"))


def build_quantized(spec, config) -> QuantizedKVCache:
    return QuantizedKVCache(
        spec.get("group_size"),
        spec.get("bits"),
        start=spec.get("start"),
        key_bits=spec.key_bits,
        value_bits=spec.value_bits,
        config=config,
    )


def build_chunked(spec, config) -> ChunkedKVCache:
    return ChunkedKVCache(spec.get("chunk_size"), config=config)
