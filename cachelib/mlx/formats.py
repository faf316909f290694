"""The runtimes' own KV storage formats on MLX: :class:`FormatKVCache` stores every key and value
as vLLM's fp8 or llama.cpp's q8_0 / q4_0 store them, in those formats' bytes, and hands back the
values those runtimes dequantize, bit for bit.

Formats (the facts, and what each is checked against in tests/mlx/test_mlx_formats.py):

- ``fp8``: vLLM's ``--kv-cache-dtype fp8`` (float8 e4m3, CUDA): each element divided by the
  layer's per-tensor scale, saturated to +-448 and rounded to nearest-even e4m3
  (``__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, __NV_E4M3)`` in vLLM's
  csrc/quantization/fp8/nvidia/quant_utils.cuh); read back as ``e4m3 * scale``. The scale is vLLM's
  default, 1.0 (no ``--calculate-kv-scales``, no checkpoint scales). Checked against
  ``torch.float8_e4m3fn``.
- ``q8_0`` / ``q4_0``: ggml's blocks of 32 elements along each K/V row (ggml-quants.c
  ``quantize_row_q8_0_ref`` / ``quantize_row_q4_0_ref``): q8_0 an fp16 scale ``amax / 127`` and 32
  int8 codes ``roundf(x / d)``; q4_0 an fp16 scale ``max / -8`` (``max``: the element of largest
  magnitude, sign kept) and 16 bytes of nibbles, ``qs[j] = q[j] | q[j + 16] << 4`` with
  ``q = min(15, trunc(x / d + 8.5))``. Checked against the ``gguf`` package's quantizers.

Storage: ``codes`` uint8 ``(B, H, T, D)`` (q4_0: ``D / 2``) and, for the block formats, ``scales``
float16 ``(B, H, T, D / 32)``: 1 byte an element for fp8, 34 bytes per 32 for q8_0, 18 per 32
for q4_0, as in the runtimes. Blocks run along ``head_dim``, which equals ggml's blocks along the
whole ``heads x head_dim`` row when ``head_dim`` is a multiple of 32 (required here). Slots grow in
steps of 256 tokens like :class:`~cachelib.mlx.kv.KVCache`. The cache has no ``bits`` attribute:
mlx-lm's standard attention runs over the dequantized keys and values.
"""

from __future__ import annotations

import mlx.core as mx

from ..core.formats import BLOCK, FORMATS, FP8_MAX, check_format, check_format_dim
from ..core.units import STEP
from ..introspect import CacheView
from .base import (
    HeldInOrder,
    Written,
    check_int,
    per_token_bytes,
    token_length,
    write_linear,
)
from .quantized import QuantizingCache, Terms


def _blocks(x: mx.array) -> mx.array:
    """(..., D) -> (..., D / 32, 32) in float32, as ggml quantizes from F32 rows."""
    return mx.unflatten(x.astype(mx.float32), -1, (x.shape[-1] // BLOCK, BLOCK))


def _roundf(v: mx.array) -> mx.array:
    """C's roundf (halves away from zero), exact for every float32 (no ``floor(a + 0.5)``)."""
    a = mx.abs(v)
    whole = mx.floor(a)
    return mx.sign(v) * (whole + mx.floor(2 * (a - whole)))


def _encode_fp8(x: mx.array) -> list[mx.array]:
    return [mx.to_fp8(mx.clip(x.astype(mx.float32), -FP8_MAX, FP8_MAX))]  # per-tensor scale 1.0: x / 1.0 is x


def _encode_q8_0(x: mx.array) -> list[mx.array]:
    b = _blocks(x)
    d = mx.max(mx.abs(b), axis=-1, keepdims=True) / 127
    inv = mx.where(d == 0, 0, 1 / d)
    codes = _roundf(b * inv).astype(mx.int8).view(mx.uint8)
    return [mx.flatten(codes, -2, -1), d[..., 0].astype(mx.float16)]


def _encode_q4_0(x: mx.array) -> list[mx.array]:
    b = _blocks(x)
    mag = mx.abs(b)  # the scale: the first element of largest magnitude, its sign kept, over -8
    first = mx.argmin(mx.where(mag == mx.max(mag, axis=-1, keepdims=True), mx.arange(BLOCK), BLOCK), axis=-1)
    d = mx.take_along_axis(b, first[..., None], axis=-1) / -8
    inv = mx.where(d == 0, 0, 1 / d)
    q = mx.minimum(mx.trunc(b * inv + 8.5), 15).astype(mx.uint8)  # (..., 32) in 0..15
    codes = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)
    return [mx.flatten(codes, -2, -1), d[..., 0].astype(mx.float16)]


def _decode_fp8(parts: list[mx.array]) -> mx.array:
    return mx.from_fp8(parts[0], dtype=mx.float32)


def _decode_q8_0(parts: list[mx.array]) -> mx.array:
    codes, scales = parts
    q = mx.unflatten(codes.view(mx.int8), -1, (scales.shape[-1], BLOCK)).astype(mx.float32)
    return mx.flatten(q * scales.astype(mx.float32)[..., None], -2, -1)


def _decode_q4_0(parts: list[mx.array]) -> mx.array:
    codes, scales = parts
    c = mx.unflatten(codes, -1, (scales.shape[-1], BLOCK // 2))
    q = mx.concatenate([c & 0x0F, c >> 4], axis=-1).astype(mx.float32) - 8
    return mx.flatten(q * scales.astype(mx.float32)[..., None], -2, -1)


# each format of the table (cachelib.core.formats.FORMATS): (encode, decode to float32)
CODECS = {"fp8": (_encode_fp8, _decode_fp8), "q8_0": (_encode_q8_0, _decode_q8_0), "q4_0": (_encode_q4_0, _decode_q4_0)}


def encode(x: mx.array, kv_format: str) -> list[mx.array]:
    """``x`` (B, H, T, D) in ``kv_format``'s storage: ``[codes]`` for fp8, ``[codes, scales]``
    for the block formats."""
    return CODECS[kv_format][0](x)


def decode(parts: list[mx.array], kv_format: str, dtype) -> mx.array:
    """The values the runtime reads back from ``parts``, in ``dtype``."""
    return CODECS[kv_format][1](parts).astype(dtype)


def _error_array(x: mx.array, x_hat: mx.array) -> mx.array:
    x = x.astype(mx.float32)
    diff = x_hat.astype(mx.float32) - x
    return mx.stack([mx.sum(diff * diff), mx.sum(x * x), mx.max(mx.abs(diff))])


class FormatKVCache(HeldInOrder, QuantizingCache):
    """Every token's keys and values stored in a runtime's format (``fp8``, ``q8_0``, ``q4_0``),
    in slots grown 256 at a time; ``update_and_fetch`` returns them dequantized, in the dtype of
    the incoming keys."""

    step = STEP
    kv_format = "fp8"
    dtype = mx.float16  # of the incoming keys: what the cache hands back
    _STATE = ("keys", "values", "offset", "kv_format")

    def __init__(self, kv_format: str = "fp8"):
        self.kv_format = check_format(kv_format, "FormatKVCache")
        self.keys = None  # [codes] or [codes, scales], token axis 2
        self.values = None
        self.offset = 0

    @property
    def key_bits(self) -> int:
        return FORMATS[self.kv_format].code_bits

    @property
    def value_bits(self) -> int:
        return self.key_bits

    @property
    def group_size(self) -> int | None:
        return FORMATS[self.kv_format].group_size

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.keys is None:
            check_format_dim(keys.shape[-1], self.kv_format, "FormatKVCache")
            check_format_dim(values.shape[-1], self.kv_format, "FormatKVCache")
        self.dtype = keys.dtype
        prev = self.offset
        qk, qv = encode(keys, self.kv_format), encode(values, self.kv_format)
        self.keys = self._written(self.keys, prev, qk)
        self.values = self._written(self.values, prev, qv)
        self.offset = prev + keys.shape[2]
        self.written = Written(prev, self.offset, False)
        if self.track_error:
            k_hat, v_hat = decode(qk, self.kv_format, mx.float32), decode(qv, self.kv_format, mx.float32)
            self._record(Terms(array=_error_array(keys, k_hat)), Terms(array=_error_array(values, v_hat)))
        return self.keys_and_values()

    def _written(self, parts, start: int, new: list[mx.array]) -> list[mx.array]:
        if parts is None:
            return [write_linear(None, start, p, self.step) for p in new]
        return [write_linear(buf, start, p, self.step) for buf, p in zip(parts, new)]

    def keys_and_values(self):
        n = self.offset
        keys, values = ([p[..., :n, :] for p in x] for x in (self.keys, self.values))
        return decode(keys, self.kv_format, self.dtype), decode(values, self.kv_format, self.dtype)

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.kv_format

    @state.setter
    def state(self, v):
        keys, values, offset, kv_format = self._unpack_state(v, 4)
        where = "FormatKVCache"
        self.kv_format = check_format(kv_format, where)
        self.offset = check_int("offset", offset, 0, where)
        parts = FORMATS[kv_format].parts
        for name, x in (("keys", keys), ("values", values)):
            if x is not None and (not isinstance(x, (list, tuple)) or len(x) != parts):
                raise ValueError(f"{where} state: {kv_format} {name} must be a list of {parts} array(s)")
        if (keys is None) != (values is None):
            raise ValueError(f"{where} state: keys and values must both be present or both be None")
        if keys is not None and offset > token_length(keys):
            raise ValueError(f"{where} state: offset={offset} exceeds the {token_length(keys)} slots stored")
        self.keys = None if keys is None else list(keys)  # handed back in the next update's dtype
        self.values = None if values is None else list(values)

    def size(self) -> int:
        return self.offset

    def introspect(self) -> CacheView:
        cap = 0 if self.keys is None else token_length(self.keys)
        held = min(self.offset, cap)
        total = self.nbytes
        return CacheView(
            kind=type(self).__name__,
            layout="linear",
            offset=self.offset,
            tokens_held=held,
            capacity=cap,
            max_capacity=None,
            bytes_used=per_token_bytes(total, cap) * held,
            bytes_allocated=total,
            write_index=self.offset,
            batch_size=1 if self.keys is None else self.keys[0].shape[0],
            key_bits=self.key_bits,
            value_bits=self.value_bits,
            group_size=self.group_size,
            quantized_tokens=held,
            dtype=self.kv_format,
            quant_error=self._last_error(),
        )


# --- the builder named by the strategy table (cachelib.spec.STRATEGIES): (spec) -> layer cache


def build_format(spec) -> FormatKVCache:
    """The ``fp8`` / ``q8_0`` / ``q4_0`` strategies: the strategy's name is the format's."""
    return FormatKVCache(spec.name)
