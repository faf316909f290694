"""The runtimes' own KV storage formats on PyTorch: vLLM's fp8 and llama.cpp's q8_0 / q4_0, stored
in those formats' bytes and read back as the runtimes read them, bit for bit (the same formats,
layout and rounding as :mod:`cachelib.mlx.formats`, whose docstring gives the facts and their
sources).

:class:`FormatKVCacheLayer` is mlx-lm's step-allocated ``KVCache`` layout (slots grow 256 at a
time) whose slots hold ``codes`` uint8 ``(B, H, T, D)`` (q4_0: ``D / 2``) and, for the block
formats, ``scales`` float16 ``(B, H, T, D / 32)``; ``update`` returns the dequantized keys and
values in the dtype of the incoming ones, for transformers' attention.
"""

from __future__ import annotations

import torch

from ..core.formats import BLOCK, FORMATS, FP8_MAX, check_format, check_format_dim
from ..core.units import STEP
from .base import QuantErrorProbe, tokens
from .mlx_style import KVCacheLayer, StrategyCache


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C's roundf (halves away from zero), exact for every float32 (no ``floor(a + 0.5)``)."""
    a = v.abs()
    whole = a.floor()
    return v.sign() * (whole + (2 * (a - whole)).floor())


def _encode_fp8(x: torch.Tensor) -> torch.Tensor:
    # per-tensor scale 1.0; saturated as vLLM's __NV_SATFINITE conversion
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def _encode_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b = x.unflatten(-1, (x.shape[-1] // BLOCK, BLOCK))  # (..., D / 32, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    codes = _roundf(b * inv).to(torch.int8).view(torch.uint8)
    return codes.flatten(-2), d[..., 0].to(torch.float16)


def _encode_q4_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b = x.unflatten(-1, (x.shape[-1] // BLOCK, BLOCK))
    d = b.gather(-1, b.abs().argmax(-1, keepdim=True)) / -8  # the first largest magnitude, its sign kept
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = (b * inv + 8.5).trunc().clamp(max=15).to(torch.uint8)
    codes = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)
    return codes.flatten(-2), d[..., 0].to(torch.float16)


def _decode_fp8(stored) -> torch.Tensor:
    return stored.view(torch.float8_e4m3fn).float()


def _decode_q8_0(stored) -> torch.Tensor:
    codes, scales = stored
    q = codes.view(torch.int8).unflatten(-1, (scales.shape[-1], BLOCK)).float()
    return (q * scales.float()[..., None]).flatten(-2)


def _decode_q4_0(stored) -> torch.Tensor:
    codes, scales = stored
    c = codes.unflatten(-1, (scales.shape[-1], BLOCK // 2))
    q = torch.cat((c & 0x0F, c >> 4), -1).float() - 8
    return (q * scales.float()[..., None]).flatten(-2)


# each format of the table (cachelib.core.formats.FORMATS): (encode from float32, decode to float32)
CODECS = {"fp8": (_encode_fp8, _decode_fp8), "q8_0": (_encode_q8_0, _decode_q8_0), "q4_0": (_encode_q4_0, _decode_q4_0)}


def encode(x: torch.Tensor, kv_format: str) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x`` (B, H, T, D) in ``kv_format``'s storage: codes for fp8, ``(codes, scales)`` for the
    block formats."""
    return CODECS[kv_format][0](x.float())


def decode(stored, kv_format: str, dtype: torch.dtype) -> torch.Tensor:
    """The values the runtime reads back from ``stored``, in ``dtype``."""
    return CODECS[kv_format][1](stored).to(dtype)


class FormatCodec:
    """A storage codec (see :mod:`.storage`) for one runtime format."""

    def __init__(self, kv_format: str):
        self.kv_format = kv_format
        self.bits = FORMATS[kv_format].code_bits
        self.group_size = FORMATS[kv_format].group_size

    def encode(self, x: torch.Tensor):
        return encode(x, self.kv_format)

    def decode(self, stored, dtype: torch.dtype) -> torch.Tensor:
        return decode(stored, self.kv_format, dtype)

    def dense(self, stored) -> torch.Tensor:
        return decode(stored, self.kv_format, torch.float32)


class FormatKVCacheLayer(QuantErrorProbe, KVCacheLayer):
    """Every token's keys and values stored in a runtime's format (``fp8``, ``q8_0``, ``q4_0``),
    in ``KVCache`` slots grown ``step`` at a time."""

    kind = "FormatKVCache"

    def __init__(self, kv_format: str = "fp8", step: int = STEP):
        super().__init__(step)
        self.kv_format = check_format(kv_format, "FormatKVCacheLayer")
        self.codec = FormatCodec(kv_format)

    def lazy_initialization(self, key_states, value_states) -> None:
        check_format_dim(key_states.shape[-1], self.kv_format, "FormatKVCacheLayer")
        check_format_dim(value_states.shape[-1], self.kv_format, "FormatKVCacheLayer")
        super().lazy_initialization(key_states, value_states)

    def _codecs(self):
        return self.codec, self.codec

    def _encode(self, key_states, value_states):
        new_keys, new_values = self.codec.encode(key_states), self.codec.encode(value_states)
        if self.track_error:
            self._record_error([(key_states, self.codec.dense(new_keys), value_states, self.codec.dense(new_values))])
        return new_keys, new_values

    def introspect(self):
        capacity = tokens(self.keys)
        allocated = self.nbytes
        return self._view(
            layout="linear",
            offset=self.offset,
            tokens_held=self.offset,
            capacity=capacity,
            max_capacity=None,
            bytes_used=allocated * self.offset // capacity if capacity else 0,
            write_index=self.offset,
            key_bits=self.codec.bits,
            value_bits=self.codec.bits,
            group_size=self.codec.group_size,
            quantized_tokens=self.offset,
            dtype=self.kv_format,
            quant_error=self.quant_error,
        )


class FormatKVCache(StrategyCache):
    """:class:`FormatKVCacheLayer` on every full-attention layer (the ``fp8`` / ``q8_0`` / ``q4_0``
    strategies)."""

    def __init__(self, kv_format: str = "fp8", config=None, step: int = STEP):
        super().__init__(lambda: FormatKVCacheLayer(kv_format, step), config)


__all__ = ["FormatKVCache", "FormatKVCacheLayer", "FormatCodec", "encode", "decode"]


# --- the builder named by the strategy table (cachelib.spec.STRATEGIES): (spec, config) -> Cache


def build_format(spec, config) -> FormatKVCache:
    """The ``fp8`` / ``q8_0`` / ``q4_0`` strategies: the strategy's name is the format's."""
    return FormatKVCache(spec.name, config=config)
