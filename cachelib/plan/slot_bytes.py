"""The bytes of one token slot of one layer, and of a recurrent layer's state.

Byte sizes of one token slot (one layer, whole batch):
full precision ``B * H_kv * (D_k + D_v) * itemsize``; quantized ``B * H_kv * (D_k * bits_k / 8
+ D_v * bits_v / 8 + 2 * (D_k + D_v) / group_size * itemsize)`` (packed data + a scale and a
bias per group in the input dtype, as mlx-lm and our torch quantizer store them).
"""

from __future__ import annotations

from ..core import rules as R
from ..core.units import check_dtype
from .arch import Arch
from .runtimes import (
    Deployment,
    kv_format_check,
    largest_stage,
    stage_arches,
)


def _check_group(arch: Arch, group_size: int) -> None:
    dims = {arch.key_dim, arch.value_dim}
    if any(d % group_size for d in dims):
        ok = [g for g in (32, 64, 128) if all(d % g == 0 for d in dims)]
        raise ValueError(
            f"group_size={group_size} does not divide the cached head dims of {arch.name} "
            f"(keys {arch.key_dim}, values {arch.value_dim}); allowed: {', '.join(map(str, ok)) or 'none'}"
        )


def token_bytes(
    arch: Arch,
    dtype: str = "float16",
    *,
    batch: int = 1,
    key_bits: int | None = None,
    value_bits: int | None = None,
    group_size: int = 64,
    kv_format: str | None = None,
) -> int:
    """Bytes one token slot takes in one attention layer's cache (keys + values, whole batch).

    With ``key_bits``/``value_bits`` that side is stored quantized: ``D * bits / 8`` packed
    bytes plus ``2 * D / group_size`` scale and bias elements in ``dtype``. With ``kv_format``
    (``fp8``, ``q8_0``, ``q4_0``: :data:`cachelib.core.rules.KV_FORMATS`) each K and V row of
    ``kv_heads x head_dim`` elements is stored in that format instead of ``dtype``.
    """
    item = check_dtype(dtype)
    if (key_bits is None) != (value_bits is None):
        raise ValueError("give both key_bits and value_bits, or neither")
    if kv_format is not None:
        if key_bits is not None:
            raise ValueError(f"kv_format {kv_format!r} is a storage format of its own; it takes no bits")
        kv_format_check(arch, kv_format)
        rows = R.format_bytes(arch.kv_heads * arch.key_dim, kv_format)
        rows += R.format_bytes(arch.kv_heads * arch.value_dim, kv_format)
        return batch * rows
    if key_bits is None:
        return batch * arch.kv_heads * (arch.key_dim + arch.value_dim) * item
    _check_group(arch, group_size)

    def side(dim: int, bits: int) -> int:
        return dim * bits // 8 + 2 * (dim // group_size) * item

    return batch * arch.kv_heads * (side(arch.key_dim, key_bits) + side(arch.value_dim, value_bits))


def kv_bytes_per_token(
    arch: Arch,
    dtype: str = "float16",
    *,
    bits: int | None = None,
    key_bits: int | None = None,
    value_bits: int | None = None,
    group_size: int = 64,
    kv_format: str | None = None,
    deployment: Deployment | None = None,
) -> int:
    """Bytes one more token costs a full cache, summed over every attention layer (batch 1):
    the figure model cards quote (Llama-3.1-8B fp16: 131,072; fp8 KV: 65,536). With a
    ``deployment``: on one device of it (its stage's layers, its rank's KV heads, its
    ``kv_format``; Llama-3.1-70B at tp=8: 40,960)."""
    kb = key_bits if key_bits is not None else bits
    vb = value_bits if value_bits is not None else bits
    if deployment is not None:
        arch = device_arch_of(arch, deployment)
        kv_format = kv_format or deployment.kv_format
    per_layer = token_bytes(arch, dtype, key_bits=kb, value_bits=vb, group_size=group_size, kv_format=kv_format)
    return per_layer * arch.attention_layers


def device_arch_of(arch: Arch, deployment: Deployment) -> Arch:
    """The architecture one device of ``deployment`` holds (:func:`cachelib.plan.runtimes.device_arch`)."""
    stage_list = stage_arches(arch, deployment)
    return stage_list[largest_stage(stage_list)]


def quantized_storage_ratio(bits: int, group_size: int = 64, dtype: str = "float16") -> float:
    """Quantized bytes per element over ``dtype`` bytes per element (4-bit, group 64, fp16
    scales: 0.28125)."""
    item = check_dtype(dtype)
    if bits <= 0 or group_size <= 0:
        raise ValueError(f"bits and group_size must be positive, got bits={bits}, group_size={group_size}")
    return (bits / 8 + 2 * item / group_size) / item


def recurrent_state_bytes(arch: Arch, backend: str = "mlx", dtype: str = "float16", *, batch: int = 1) -> int:
    """Bytes of one recurrent layer's state (conv window + SSM state)."""
    item = check_dtype(dtype)
    rec = arch.recurrent
    if rec is None:
        return 0
    if backend == "mlx":  # conv (B, K-1, C), ssm (B, C, N), both in the input dtype
        return batch * rec.channels * ((rec.conv_kernel - 1) + rec.state_size) * item
    if backend == "ggml":  # llama.cpp llama_memory_recurrent: r (K-1)*C and s N*C, float32
        return batch * rec.channels * ((rec.conv_kernel - 1) + rec.state_size) * 4
    # transformers: conv (B, C, K) in the input dtype, ssm (B, C, N) in float32
    return batch * rec.channels * (rec.conv_kernel * item + rec.state_size * 4)
