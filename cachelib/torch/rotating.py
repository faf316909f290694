"""mlx-lm's ``RotatingKVCache`` on PyTorch: a true ring buffer of ``max_size`` slots whose first
``keep`` slots (attention sinks) are never overwritten.

Slot layout, growth and returned arrays follow mlx-lm 0.32, so bytes and slot tables match the
MLX class of the same name:

- one-token updates write in place at the ring pointer (``write_index``, mlx-lm's ``_idx``):
  O(1), no roll or copy of the window; the buffer grows ``step`` slots at a time up to
  ``max_size`` and then wraps to ``keep``;
- multi-token updates put the held tokens back in temporal order, keep the sinks and the most
  recent ``max_size - 1 - keep``, and append the new tokens, so every new token sees at least
  ``max_size`` tokens of context; that array is returned whole.

Masks: transformers builds them from ``get_mask_sizes`` as if key slot j held position
``kv_offset + j``. A ring's slots are not in temporal order, but every token it returns is
visible to every new query except the new tokens among themselves (causal), so the layer
reports the held tokens as the ``kv_length - n_new`` positions just before the first query and
the new tokens at their true positions: the causal mask is then exact. (mlx-lm's own
multi-token mask also limits each new token to a window of ``max_size``; transformers'
full-attention mask has no window, so a multi-token chunk that overflows the ring is not
windowed here. Prompts that fit, and every one-token step, see exactly what mlx-lm sees.)

Beyond mlx-lm: the ring can be stored quantized (``bits`` / ``key_bits`` / ``value_bits``).
The slot arithmetic is :mod:`cachelib.core.ring`'s, shared with the MLX class and the planner.
"""

from __future__ import annotations

from ..core import ring
from ..core.units import STEP
from ..introspect import CacheView, Written
from .base import (
    AttentionLayer,
    CropError,
    QuantErrorProbe,
    cat,
    changed_slots,
    check_crop,
    dequantized,
    dtype_name,
    tokens,
)
from .mlx_style import StrategyCache, check_step
from .quantizer import check_bits, check_group_size, check_head_dim
from .storage import DENSE, QuantizedCodec, clone, encode_pair, grow, head, span, write, zeros


class RotatingKVCacheLayer(QuantErrorProbe, AttentionLayer):
    kind = "RotatingKVCache"

    def __init__(
        self,
        max_size: int,
        keep: int = 0,
        step: int = STEP,
        *,
        bits: int | None = None,
        group_size: int = 64,
        key_bits: int | None = None,
        value_bits: int | None = None,
    ):
        super().__init__()
        where = "RotatingKVCacheLayer"
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
            raise ValueError(f"{where}: max_size must be an int >= 1, got {max_size!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or not 0 <= keep < max_size:
            raise ValueError(f"{where}: keep={keep!r} must be an int in 0..{max_size - 1} (below max_size={max_size})")
        self.max_size, self.keep, self.step = max_size, keep, check_step(step)
        self.offset = 0
        self._idx = 0
        self.group_size = None
        self.key_codec = self.value_codec = DENSE
        if bits is not None or key_bits is not None or value_bits is not None:
            key_bits = bits if key_bits is None else key_bits
            value_bits = bits if value_bits is None else value_bits
            if key_bits is None or value_bits is None:
                raise ValueError(f"{where}: a quantized ring needs bits=, or both key_bits= and value_bits=")
            check_bits(key_bits, where, "key_bits")
            check_bits(value_bits, where, "value_bits")
            self.group_size = check_group_size(group_size, where)
            self.key_codec = QuantizedCodec(key_bits, group_size)
            self.value_codec = QuantizedCodec(value_bits, group_size)
            self.kind = "QuantizedRotatingKVCache"  # the MLX class of this strategy

    @property
    def write_index(self) -> int:
        """Slot the next one-token update writes (mlx-lm's ``_idx``)."""
        return self._idx

    def lazy_initialization(self, key_states, value_states) -> None:
        if self.group_size is not None:
            check_head_dim(key_states.shape[-1], self.group_size, "RotatingKVCacheLayer")
            check_head_dim(value_states.shape[-1], self.group_size, "RotatingKVCacheLayer")
        self.device = key_states.device
        self.is_initialized = True

    # --- updates ---------------------------------------------------------------------------

    def _encode(self, key_states, value_states):
        new_keys, new_values = encode_pair(self.key_codec, self.value_codec, key_states, value_states)
        if self.track_error and self.group_size is not None:
            self._record_error(
                [
                    (
                        key_states,
                        dequantized(self.key_codec, new_keys),
                        value_states,
                        dequantized(self.value_codec, new_values),
                    )
                ]
            )
        return new_keys, new_values

    def update(self, key_states, value_states, *args, **kwargs):
        held = self._store(key_states, value_states)
        return (
            self.key_codec.decode(head(self.keys, held), key_states.dtype),
            self.value_codec.decode(head(self.values, held), value_states.dtype),
        )

    def update_changed(self, key_states, value_states, held: int, need: int):
        length = self._store(key_states, value_states)
        start, end = changed_slots(self.written, held, need, length)
        keys = self.key_codec.decode(span(self.keys, start, end), key_states.dtype)
        values = self.value_codec.decode(span(self.values, start, end), value_states.dtype)
        if self._pending_error is not None:  # the new tokens just decoded are the error's reconstruction
            self._decoded(start, keys, values, key_states, value_states)
        return start, keys, values, length

    def _store(self, key_states, value_states) -> int:
        """Store the new tokens (setting :attr:`written`); returns the slots ``update`` returns."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new_keys, new_values = self._encode(key_states, value_states)
        if key_states.shape[-2] == 1:
            self._write_one(new_keys, new_values)
        else:
            self._append(new_keys, new_values, key_states.shape[-2])
            self.written = None  # the held tokens were put back in time order: every slot may have moved
        return min(self.offset, tokens(self.keys))

    def _write_one(self, new_keys, new_values) -> None:
        size = tokens(self.keys)
        w = ring.write_one(self.offset, self._idx, size, self.max_size, self.keep, self.step)
        if w.grow is not None:
            if self.keys is None:
                self.keys, self.values = zeros(new_keys, w.grow), zeros(new_values, w.grow)
            else:
                self.keys, self.values = grow(self.keys, size, w.grow), grow(self.values, size, w.grow)
        if w.cut:  # a multi-token update left more than max_size slots
            self.keys, self.values = self._drop_oldest(w.cut, self.keys), self._drop_oldest(w.cut, self.values)
        write(self.keys, w.slot, new_keys)
        write(self.values, w.slot, new_values)
        self.offset += 1
        self._idx = w.slot + 1
        # one slot written, the others where they were (a cut moves them all)
        self.written = None if w.cut else Written(w.slot, w.slot + 1, self.key_codec is DENSE)

    def _append(self, new_keys, new_values, n_new: int) -> None:
        plan = ring.write_block(n_new, self.offset, self._idx, tokens(self.keys), self.max_size, self.keep)
        if self.keys is None:
            # Own the storage: a later one-token update writes into it in place.
            self.keys = clone(new_keys) if self.key_codec is DENSE else new_keys
            self.values = clone(new_values) if self.value_codec is DENSE else new_values
        else:
            keys, values = self._in_order(self.keys, plan), self._in_order(self.values, plan)
            self.keys = self._drop_oldest(plan.drop, keys, new_keys)
            self.values = self._drop_oldest(plan.drop, values, new_values)
        self.offset += n_new
        self._idx = plan.capacity

    def _in_order(self, x, plan: ring.BlockWrite):
        """The held slots in temporal order: sinks, then oldest to newest."""
        if plan.wrapped:  # the oldest ring slot is the write index
            return cat([span(x, 0, self.keep), span(x, self._idx), span(x, self.keep, self._idx)])
        if plan.held < tokens(x):
            return head(x, plan.held)
        return x

    def _drop_oldest(self, n: int, x, append=None):
        """Drop the ``n`` oldest non-sink slots of a temporally ordered ``x`` and append."""
        parts = [span(x, 0, self.keep), span(x, n + self.keep)] if n > 0 else [x]
        if append is not None:
            parts.append(append)
        return cat(parts)

    # --- sizes -------------------------------------------------------------------------------

    def _returned_length(self, n_new: int) -> int:
        """Tokens ``update`` will return for ``n_new`` new tokens, from the current state."""
        size = tokens(self.keys)
        if n_new == 1:
            w = ring.write_one(self.offset, self._idx, size, self.max_size, self.keep, self.step)
            return min(self.offset + 1, w.capacity)
        return ring.write_block(n_new, self.offset, self._idx, size, self.max_size, self.keep).capacity

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Returned old tokens sit just before the first query position, new ones at their own.
        kv_length = self._returned_length(query_length)
        return kv_length, self.offset + query_length - kv_length

    def get_seq_length(self) -> int:
        return self.offset

    def get_max_length(self) -> int:
        return self.max_size

    # --- edits -------------------------------------------------------------------------------

    def is_trimmable(self) -> bool:
        """Trimming is exact only before the ring first drops a token."""
        return ring.trimmable(self.offset, self.max_size)

    def trim(self, n: int) -> int:
        n, self.offset, self._idx = ring.trim(n, self.offset, self._idx)
        return n

    def crop(self, tokens_to_remove: int) -> None:
        n = check_crop(tokens_to_remove, self.offset, "RotatingKVCacheLayer")
        if n and not self.is_trimmable():
            raise CropError(
                f"RotatingKVCacheLayer.crop: the ring of max_size={self.max_size} has already overwritten "
                f"tokens ({self.offset} seen), so it cannot roll back"
            )
        self.trim(n)

    @property
    def is_croppable(self) -> bool:
        return self.is_trimmable()

    def reset(self) -> None:
        self.keys = self.values = None
        self.offset = self._idx = 0
        self.is_initialized = False

    def introspect(self) -> CacheView:
        capacity = tokens(self.keys)
        held = min(self.offset, capacity)
        allocated = self.nbytes
        quantized = self.group_size is not None
        scales = self.keys[1] if isinstance(self.keys, tuple) else self.keys
        return self._view(
            layout="ring",
            offset=self.offset,
            tokens_held=held,
            capacity=capacity,
            max_capacity=self.max_size,
            bytes_used=allocated * held // capacity if capacity else 0,
            write_index=self._idx,
            keep=self.keep,
            key_bits=self.key_codec.bits,
            value_bits=self.value_codec.bits,
            group_size=self.group_size,
            quantized_tokens=held if quantized else 0,
            dtype=dtype_name(scales.dtype) if scales is not None else "",
            quant_error=self.quant_error,
        )


class RotatingKVCache(StrategyCache):
    """mlx-lm's ``RotatingKVCache`` on every full-attention layer (``rotating`` strategy);
    with ``bits`` (or ``key_bits`` and ``value_bits``) the ring is stored quantized."""

    def __init__(
        self,
        max_size: int,
        keep: int = 0,
        config=None,
        *,
        step: int = STEP,
        bits: int | None = None,
        group_size: int = 64,
        key_bits: int | None = None,
        value_bits: int | None = None,
    ):
        super().__init__(
            lambda: RotatingKVCacheLayer(
                max_size, keep, step, bits=bits, group_size=group_size, key_bits=key_bits, value_bits=value_bits
            ),
            config,
        )


# --- the builder named by the strategy table (cachelib.spec.STRATEGIES): (spec, config) -> Cache


def build_rotating(spec, config) -> RotatingKVCache:
    quant = {}
    if spec.key_bits is not None:
        quant = dict(key_bits=spec.key_bits, value_bits=spec.value_bits, group_size=spec.get("group_size"))
    return RotatingKVCache(spec.get("max_size"), spec.get("keep"), config=config, **quant)
