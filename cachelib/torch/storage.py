"""Token-slot storage for the mlx-lm strategies: full precision or quantized, one interface.

A stored K (or V) is either a (B, H, T, D) tensor or a quantized (codes, scales, biases)
triple; a codec turns incoming (B, H, n, D) states into that form and back. The slot
operations (grow, write, take a prefix, index) work on both, always on the token axis (-2), so
each strategy is written once and is quantized by handing it quantizing codecs.

This module knows nothing of strategies, offsets or masks.
"""

from __future__ import annotations

import torch

from .base import Arrays, each
from .quantizer import Quantizer


class DenseCodec:
    """Stores states as they come."""

    bits = None
    group_size = None

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def decode(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return stored

    def dense(self, stored: torch.Tensor) -> torch.Tensor:
        return stored


class QuantizedCodec:
    """Stores states group-wise quantized (see :mod:`.quantizer`)."""

    def __init__(self, bits: int, group_size: int):
        self.quantizer = Quantizer(bits, group_size)
        self.bits = bits
        self.group_size = group_size

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.quantizer.quantize(x)

    def decode(self, stored: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.quantizer.dequantize(stored).to(dtype)

    def dense(self, stored: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.quantizer.dequantize(stored)


DENSE = DenseCodec()


def encode_pair(key_codec, value_codec, keys: torch.Tensor, values: torch.Tensor):
    """Encode keys and values; in one quantizer pass when both use the same quantizer (the
    per-call overhead of the small tensor ops dominates a decode step's quantization)."""
    if (
        isinstance(key_codec, QuantizedCodec)
        and isinstance(value_codec, QuantizedCodec)
        and key_codec.quantizer == value_codec.quantizer
        and keys.shape == values.shape
        and keys.dtype == values.dtype
    ):
        both = key_codec.encode(torch.stack((keys, values)))
        return tuple(t[0] for t in both), tuple(t[1] for t in both)
    return key_codec.encode(keys), value_codec.encode(values)


def zeros(like: Arrays, length: int) -> Arrays:
    """Zeroed storage shaped like ``like`` but with ``length`` token slots."""
    return each(like, lambda t: t.new_zeros((*t.shape[:-2], length, t.shape[-1])))


def grow(x: Arrays, keep: int, extra: int) -> Arrays:
    """New storage: the first ``keep`` slots of ``x`` followed by ``extra`` zeroed slots."""

    def one(t: torch.Tensor) -> torch.Tensor:
        out = t.new_zeros((*t.shape[:-2], keep + extra, t.shape[-1]))
        out[..., :keep, :] = t[..., :keep, :]
        return out

    return each(x, one)


def write(x: Arrays, start: int, new: Arrays) -> None:
    """Write ``new`` into slots ``[start, start + n)`` of ``x``, in place."""
    if isinstance(x, tuple):
        for t, n in zip(x, new):
            t[..., start : start + n.shape[-2], :] = n
    else:
        x[..., start : start + new.shape[-2], :] = new


def head(x: Arrays, n: int) -> Arrays:
    """The first ``n`` slots (a view)."""
    return each(x, lambda t: t[..., :n, :])


def span(x: Arrays, start: int, stop: int | None = None) -> Arrays:
    """Slots ``[start, stop)`` (a view)."""
    return each(x, lambda t: t[..., start:stop, :])


def clone(x: Arrays) -> Arrays:
    return each(x, lambda t: t.clone())
