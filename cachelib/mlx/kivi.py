"""A KIVI-style cache on MLX: the newest ``residual`` tokens at full precision, every older one
group-wise quantized (transformers' QuantizedCache keeps the same split on PyTorch).

Each update appends to the full-precision residual; whatever no longer fits in it is quantized
and appended to the quantized store (both grown by concatenation, so every slot holds a token).
``update_and_fetch`` hands back ``dequantized store + residual`` as plain arrays, so the model's
standard attention runs: the cache has no ``bits`` attribute on purpose, which keeps mlx-lm's
attention off its quantized path. The memory saved is the store's; the arrays handed back are
transient.

Slot order (for views): the quantized store's tokens first, then the residual's, all in time
order, so slot ``j`` holds position ``j``.
"""

from __future__ import annotations

import mlx.core as mx

from ..introspect import CacheView
from .base import array_bytes, attention_mask, check_array, check_int, check_trim, dtype_name, token_length
from .quantized import QuantizingCache, check_bits, dequantize, error_terms, quantize


class KIVICache(QuantizingCache):
    """``KIVICache(residual=128, group_size=64, bits=4)``: newest ``residual`` tokens full
    precision, older ones stored at ``bits`` bits in groups of ``group_size``."""

    _STATE = ("keys", "values", "residual_keys", "residual_values", "offset", "residual", "group_size", "bits")

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
        if self.residual_keys is None:
            self._check_dims(keys, values)
            res_k, res_v = keys, values
        else:
            res_k = mx.concatenate([self.residual_keys, keys], axis=2)
            res_v = mx.concatenate([self.residual_values, values], axis=2)
        excess = res_k.shape[2] - self.residual
        if excess > 0:
            gs, bits = self.group_size, self.key_bits
            old_k, old_v = res_k[..., :excess, :], res_v[..., :excess, :]
            qk, qv = quantize(old_k, gs, bits), quantize(old_v, gs, bits)
            if self.keys is None:
                self.keys, self.values = qk, qv
            else:
                self.keys = [mx.concatenate([a, b], axis=2) for a, b in zip(self.keys, qk)]
                self.values = [mx.concatenate([a, b], axis=2) for a, b in zip(self.values, qv)]
            res_k, res_v = res_k[..., excess:, :], res_v[..., excess:, :]
            if self.track_error:
                self._record(error_terms(old_k, qk, gs, bits), error_terms(old_v, qv, gs, bits))
        elif self.track_error:
            self._error = None
        self.residual_keys, self.residual_values = res_k, res_v
        self.offset += keys.shape[2]
        return self.keys_and_values()

    def keys_and_values(self):
        if self.keys is None:
            return self.residual_keys, self.residual_values
        gs, bits = self.group_size, self.key_bits
        keys = mx.concatenate([dequantize(self.keys, gs, bits), self.residual_keys], axis=2)
        values = mx.concatenate([dequantize(self.values, gs, bits), self.residual_values], axis=2)
        return keys, values

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
