"""Group-wise asymmetric (affine) quantization of K/V tensors, packed into uint8.

Each run of ``group_size`` elements along the last axis (head_dim) gets one scale and one bias
(the zero point, in real units) in the dtype of the input, and every element becomes an integer
code ``q`` in ``[0, 2**bits - 1]`` with ``x ~= q * scale + bias``. The edge of the group with the
larger magnitude is stored exactly and zero lands on the integer grid, so exact zeros survive.
Codes are packed ``8 // bits`` to a byte, lowest bits first: the bytes are the same as MLX's
``mx.quantize`` packs into little-endian uint32 words, and the scales and biases are the same
values, so byte counts and dequantized values agree across the two backends.

Storage per token and kv head: ``head_dim * bits / 8`` bytes of codes plus
``2 * head_dim / group_size`` scale and bias elements.

This module knows tensors only: nothing of caches, layers or models.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..spec import GROUP_SIZES, TORCH_QUANT_BITS

# A quantized tensor: (codes, scales, biases); every part keeps the token axis at -2.
Packed = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

_EPS = 1e-7  # smallest scale, so constant groups do not divide by zero


def check_bits(bits: int, where: str, name: str = "bits") -> int:
    if isinstance(bits, bool) or bits not in TORCH_QUANT_BITS:
        allowed = ", ".join(map(str, TORCH_QUANT_BITS))
        raise ValueError(f"{where}: {name}={bits!r} is not supported; allowed: {allowed}")
    return bits


def check_group_size(group_size: int, where: str) -> int:
    if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        allowed = ", ".join(map(str, GROUP_SIZES))
        raise ValueError(f"{where}: group_size={group_size!r} is not supported; allowed: {allowed}")
    return group_size


def check_head_dim(head_dim: int, group_size: int, where: str) -> None:
    if head_dim % group_size:
        raise ValueError(
            f"{where}: group_size={group_size} must divide head_dim={head_dim}; "
            f"choose a group_size among {', '.join(str(g) for g in GROUP_SIZES if head_dim % g == 0) or 'none'}"
        )


@dataclass(frozen=True)
class Quantizer:
    """Quantizes the last axis of a tensor in groups of ``group_size`` to ``bits`` bits."""

    bits: int
    group_size: int

    def __post_init__(self):
        check_bits(self.bits, "Quantizer")
        check_group_size(self.group_size, "Quantizer")

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @property
    def per_byte(self) -> int:
        return 8 // self.bits

    def bytes_per_vector(self, dim: int, dtype: torch.dtype) -> int:
        """Bytes that one quantized vector of ``dim`` elements takes (codes + scales + biases)."""
        item = torch.empty((), dtype=dtype).element_size()
        return dim * self.bits // 8 + 2 * (dim // self.group_size) * item

    def quantize(self, x: torch.Tensor) -> Packed:
        """``x`` (..., D) -> codes (..., D*bits/8) uint8, scales and biases (..., D/group_size)."""
        dim = x.shape[-1]
        check_head_dim(dim, self.group_size, "Quantizer.quantize")
        # Computed in float32 whatever the input dtype (as MLX does); scales and biases are
        # stored in the input dtype.
        groups = x.float().reshape(*x.shape[:-1], dim // self.group_size, self.group_size)
        lo, hi = torch.aminmax(groups, dim=-1, keepdim=True)
        step = ((hi - lo) / self.levels).clamp_min_(_EPS)
        # Anchor the grid at the edge of larger magnitude (|lo| > |hi| <=> lo + hi < 0), then
        # shrink the step so that this edge is a whole number of steps from zero: zero becomes
        # exactly representable.
        low_edge = (lo + hi) < 0
        edge = torch.where(low_edge, lo, hi)
        step = torch.where(low_edge, step, -step)
        zero_code = torch.round(edge / step)
        nonzero = zero_code != 0
        scale = torch.where(nonzero, edge / zero_code, step)
        bias = torch.where(nonzero, edge, 0.0)
        codes = ((groups - bias) / scale).round_().clamp_(0, self.levels).to(torch.uint8)
        return self._pack(codes.reshape(x.shape)), scale.squeeze(-1).to(x.dtype), bias.squeeze(-1).to(x.dtype)

    def dequantize(self, packed: Packed) -> torch.Tensor:
        """The (..., D) tensor that ``packed`` stands for, in the dtype of its scales."""
        codes, scale, bias = packed
        q = self._unpack(codes, scale.dtype).view(*scale.shape, self.group_size)  # (..., G, group)
        # In place on the fresh buffer: much faster on CPU than a broadcasting addcmul.
        return (
            q.mul_(scale.unsqueeze(-1))
            .add_(bias.unsqueeze(-1))
            .view(*scale.shape[:-1], scale.shape[-1] * self.group_size)
        )

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            return codes
        per = self.per_byte
        codes = codes.view(*codes.shape[:-1], codes.shape[-1] // per, per)
        out = codes[..., 0] | (codes[..., 1] << self.bits)
        for j in range(2, per):
            out |= codes[..., j] << (j * self.bits)
        return out

    def _unpack(self, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Codes as a fresh (..., D) tensor of ``dtype``."""
        if self.bits == 8:
            return packed.to(dtype)
        if packed.numel() <= LOOKUP_BYTES:
            # a few tokens (a decode step's): one lookup of every byte's codes costs fewer ops
            # than the shifts (~9 against ~53 us a 4-bit token of 3 x 64 here); the same values
            return _code_table(self.bits, dtype, packed.device)[packed.long()].flatten(-2)
        per, bits = self.per_byte, self.bits
        out = torch.empty((*packed.shape, per), dtype=dtype, device=packed.device)
        out[..., 0] = packed & self.levels
        for j in range(1, per - 1):
            out[..., j] = (packed >> (j * bits)) & self.levels
        out[..., per - 1] = packed >> ((per - 1) * bits)
        return out.flatten(-2)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Largest possible ``|x - dequantize(quantize(x))|`` per element: one grid step of the
        group, ``(max - min) / (2**bits - 1)``. The grid is anchored at the larger-magnitude edge
        and its step rescaled by at most ``levels / (levels - 1)``, so rounding inside the range
        and clipping at the far edge both stay below one unscaled step."""
        groups = x.reshape(*x.shape[:-1], x.shape[-1] // self.group_size, self.group_size).float()
        step = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / self.levels
        return step.clamp_min(_EPS).expand_as(groups).reshape(x.shape)


LOOKUP_BYTES = 1 << 12  # packed codes up to which _unpack looks every byte up in a table


@functools.lru_cache(maxsize=32)
def _code_table(bits: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(256, 8 // bits): the codes each packed byte holds, lowest bits first, as ``dtype``."""
    byte = torch.arange(256, dtype=torch.int32)
    codes = [(byte >> (j * bits)) & ((1 << bits) - 1) for j in range(8 // bits)]
    return torch.stack(codes, -1).to(dtype=dtype, device=device)


def quant_error_of(x: torch.Tensor, x_hat: torch.Tensor) -> tuple[float, float]:
    """(relative RMS, max abs) of the reconstruction ``x_hat`` of ``x``, computed on x's device
    (the same formula as :func:`cachelib.introspect.quant_error`)."""
    x = x.double()
    diff = x_hat.double() - x
    norm = float(torch.linalg.vector_norm(x))
    rel = float(torch.linalg.vector_norm(diff)) / norm if norm > 0 else 0.0
    return rel, float(diff.abs().max()) if diff.numel() else 0.0
