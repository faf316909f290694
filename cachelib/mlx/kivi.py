"""A KIVI-style cache on MLX with the bookkeeping of transformers' ``QuantizedCache`` (which
``cachelib.torch.QuantizedLayer`` reproduces), so the ``kivi`` strategy means the same thing on
both backends: the first update quantizes the whole prompt; after that, new tokens collect in a
full-precision residual until ``residual + new >= residual``-length, when residual and new tokens
are quantized together, appended to the quantized store, and the residual empties. The residual
therefore holds at most ``residual - 1`` tokens. Each token is quantized once, in groups along
the head dimension.

``update_and_fetch`` hands back ``dequantized store + residual + new`` as plain arrays (the first
update hands back its input), so the model's standard attention runs: the cache has no ``bits``
attribute on purpose, which keeps mlx-lm's attention off its quantized path. The memory saved is
the store's; the arrays handed back are transient.

Slot order (for views): the quantized store's tokens first, then the residual's, all in time
order, so slot ``j`` holds position ``j``.
"""

from __future__ import annotations

import mlx.core as mx

from ..introspect import CacheView
from .base import Written, array_bytes, attention_mask, check_array, check_int, check_trim, dtype_name, token_length
from .quantized import QuantizingCache, check_bits, dequantize, error_terms, quantize


class KIVICache(QuantizingCache):
    """``KIVICache(residual=128, group_size=64, bits=4)``: newest ``residual`` tokens full
    precision, older ones stored at ``bits`` bits in groups of ``group_size``."""

    _STATE = ("keys", "values", "residual_keys", "residual_values", "offset", "residual", "group_size", "bits")
    _store_returned = None  # store tokens behind the arrays the last update handed back (None: not known)

    def __init__(self, residual: int = 128, group_size: int = 64, bits: int = 4):
        where = "KIVICache"
        self.residual = check_int("residual", residual, 1, where)
        check_bits("bits", bits, where)
        self._set_widths(group_size, bits, bits, where)
        self.keys = None  # quantized store: [packed, scales, biases], (B, H, T_q, *)
        self.values = None
        self.residual_keys = None  # full precision, (B, H, T_r, D), T_r <= residual
        self.residual_values = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.residual_keys is None:  # the prompt: quantized at once, handed back as it came
            self._check_dims(keys, values)
            self._append_quantized(keys, values)
            self.residual_keys, self.residual_values = keys[..., :0, :], values[..., :0, :]
            self.written = Written(self.offset, self.offset + keys.shape[2], True)
            self._store_returned = 0
            self.offset += keys.shape[2]
            return keys, values
        # What comes back is the store as it is now, dequantized, then residual and new tokens at
        # full precision; against the last return, the tokens the store took since are new.
        stored, prev = self.quantized_tokens, self.offset
        if self._store_returned == stored:
            self.written = Written(prev, prev + keys.shape[2], True)
        else:
            self.written = (
                None if self._store_returned is None else Written(self._store_returned, prev + keys.shape[2], False)
            )
        self._store_returned = stored
        out_k, out_v = self._with_store(
            mx.concatenate([self.residual_keys, keys], axis=2), mx.concatenate([self.residual_values, values], axis=2)
        )
        if self.residual_keys.shape[2] + keys.shape[2] >= self.residual:
            self._append_quantized(
                mx.concatenate([self.residual_keys, keys], axis=2),
                mx.concatenate([self.residual_values, values], axis=2),
            )
            self.residual_keys, self.residual_values = keys[..., :0, :], values[..., :0, :]
        else:
            if self.track_error:
                self._error = None
            self.residual_keys = mx.concatenate([self.residual_keys, keys], axis=2)
            self.residual_values = mx.concatenate([self.residual_values, values], axis=2)
        self.offset += keys.shape[2]
        return out_k, out_v

    def _append_quantized(self, keys: mx.array, values: mx.array) -> None:
        gs, bits = self.group_size, self.key_bits
        qk, qv = quantize(keys, gs, bits), quantize(values, gs, bits)
        if self.keys is None:
            self.keys, self.values = qk, qv
        else:
            self.keys = [mx.concatenate([a, b], axis=2) for a, b in zip(self.keys, qk)]
            self.values = [mx.concatenate([a, b], axis=2) for a, b in zip(self.values, qv)]
        if self.track_error:
            self._record(error_terms(keys, qk, gs, bits), error_terms(values, qv, gs, bits))

    def _with_store(self, keys: mx.array, values: mx.array):
        """The dequantized store followed by ``keys`` / ``values`` (full precision)."""
        if self.keys is None:
            return keys, values
        gs, bits = self.group_size, self.key_bits
        return (
            mx.concatenate([dequantize(self.keys, gs, bits).astype(keys.dtype), keys], axis=2),
            mx.concatenate([dequantize(self.values, gs, bits).astype(values.dtype), values], axis=2),
        )

    def keys_and_values(self):
        return self._with_store(self.residual_keys, self.residual_values)

    @property
    def quantized_tokens(self) -> int:
        return 0 if self.keys is None else token_length(self.keys)

    def size(self) -> int:
        return self.offset

    @property
    def state(self):
        return (
            self.keys,
            self.values,
            self.residual_keys,
            self.residual_values,
            self.offset,
            self.residual,
            self.group_size,
            self.key_bits,
        )

    @state.setter
    def state(self, v):
        keys, values, res_k, res_v, offset, residual, group_size, bits = self._unpack_state(v, 8)
        where = "KIVICache"
        check_int("residual", residual, 1, where + " state")
        check_bits("bits", bits, where + " state")
        self._set_widths(group_size, bits, bits, where + " state")
        check_int("offset", offset, 0, where + " state")
        for name, x in (("keys", keys), ("values", values)):
            if x is not None and (not isinstance(x, (list, tuple)) or len(x) != 3):
                raise ValueError(f"{where} state: {name} must be 3 quantized parts (packed, scales, biases) or None")
        check_array("residual_keys", res_k, where)
        check_array("residual_values", res_v, where)
        if (res_k is None) != (res_v is None) or (keys is None) != (values is None):
            raise ValueError(f"{where} state: keys and values must both be present or both be None")
        held = (0 if keys is None else token_length(keys)) + (0 if res_k is None else res_k.shape[2])
        if held != offset:
            raise ValueError(f"{where} state: offset={offset} but {held} tokens are stored")
        self.keys, self.values = None if keys is None else list(keys), None if values is None else list(values)
        self.residual_keys, self.residual_values = res_k, res_v
        self.offset, self.residual = offset, residual
        self._store_returned = None

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the newest ``n`` tokens (from the residual first, then from the store)."""
        n = min(self.offset, check_trim(n, "KIVICache"))
        if n == 0:
            return 0
        in_residual = self.residual_keys.shape[2]
        from_residual = min(n, in_residual)
        if from_residual:
            keep = in_residual - from_residual
            self.residual_keys = self.residual_keys[..., :keep, :]
            self.residual_values = self.residual_values[..., :keep, :]
        from_store = n - from_residual
        if from_store:
            keep = token_length(self.keys) - from_store
            if keep == 0:  # mx.dequantize refuses empty parts: an empty store is None
                self.keys = self.values = None
            else:
                self.keys = [p[..., :keep, :] for p in self.keys]
                self.values = [p[..., :keep, :] for p in self.values]
        self.offset -= n
        self._store_returned = None
        return n

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        return attention_mask(N, self.offset, window_size, return_array)

    def empty(self) -> bool:
        return self.residual_keys is None

    @property
    def nbytes(self) -> int:
        return array_bytes(self.keys, self.values, self.residual_keys, self.residual_values)

    def introspect(self) -> CacheView:
        quantized = self.quantized_tokens
        held = quantized + (0 if self.residual_keys is None else self.residual_keys.shape[2])
        total = self.nbytes
        return CacheView(
            kind="KIVICache",
            layout="linear",
            offset=self.offset,
            tokens_held=held,
            capacity=held,
            max_capacity=None,
            bytes_used=total,
            bytes_allocated=total,
            write_index=held,
            batch_size=1 if self.residual_keys is None else self.residual_keys.shape[0],
            key_bits=self.key_bits,
            value_bits=self.value_bits,
            group_size=self.group_size,
            quantized_tokens=quantized,
            dtype=dtype_name(self.residual_keys),
            quant_error=self._last_error(),
        )


# --- the builder named by the strategy table (cachelib.spec.STRATEGIES): (spec) -> layer cache


def build_kivi(spec) -> KIVICache:
    return KIVICache(residual=spec.get("residual"), group_size=spec.get("group_size"), bits=spec.get("bits"))
