"""The runtimes' KV storage formats, backend-free: vLLM's fp8 e4m3 and llama.cpp's q8_0 / q4_0.

One table, :data:`FORMATS`: what a stored element costs, which rows a format can tile, which
runtime and flag store it, and what that runtime requires of it. Code elsewhere asks the table
(never compares a format's name); the encoders live with each backend (:mod:`cachelib.mlx.formats`,
:mod:`cachelib.torch.formats`, one per format, keyed by the same names).
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK = 32  # ggml's QK8_0 / QK4_0 (ggml-common.h)
FP8_MAX = 448.0  # the largest finite float8 e4m3fn: vLLM's conversion saturates to it


@dataclass(frozen=True)
class KVFormat:
    """One runtime's KV storage format."""

    name: str
    runtime: str  # the runtime that stores it
    flag: str  # how that runtime is asked for it
    block: int  # elements per block (1: one scale per tensor, kept outside the cache)
    block_bytes: int  # bytes one block takes in the cache (codes and the block's scale)
    code_bits: int  # bits of one element's code (scales aside)
    value_needs_flash_attention: bool  # the runtime refuses it as the V cache without flash attention
    source: str

    @property
    def scaled(self) -> bool:
        """Whether each block stores its own scale beside the codes."""
        return self.block > 1

    @property
    def group_size(self) -> int | None:
        """Elements sharing one stored scale (``None``: one scale per tensor, outside the cache)."""
        return self.block if self.scaled else None

    @property
    def parts(self) -> int:
        """Arrays a cache keeps per K or V: the codes, and the scales of a block format."""
        return 2 if self.scaled else 1


FORMATS: dict[str, KVFormat] = {
    f.name: f
    for f in (
        # vLLM kv_cache_dtype="fp8": one e4m3 byte per element, per-tensor scales kept outside the
        # cache (vllm/v1/kv_cache_interface.py AttentionSpec; csrc/quantization/fp8/nvidia/quant_utils.cuh).
        KVFormat("fp8", "vllm", "--kv-cache-dtype fp8", 1, 1, 8, False, "vLLM AttentionSpec, quant_utils.cuh"),
        # llama.cpp -ctk/-ctv (ggml-common.h): block_q8_0 = an fp16 scale + 32 int8 codes = 34 bytes per
        # 32 elements; block_q4_0 = an fp16 scale + 16 bytes of 4-bit codes = 18 bytes per 32. A quantized
        # V cache needs flash attention (llama_init_from_model refuses -fa off).
        KVFormat("q8_0", "llama.cpp", "-ctk/-ctv q8_0", BLOCK, 34, 8, True, "ggml-common.h block_q8_0"),
        KVFormat("q4_0", "llama.cpp", "-ctk/-ctv q4_0", BLOCK, 18, 4, True, "ggml-common.h block_q4_0"),
    )
}


def kv_format(name: str, where: str = "kv_format") -> KVFormat:
    """The table's entry for ``name``, else a ``ValueError`` naming the allowed formats."""
    if name not in FORMATS:
        raise ValueError(f"{where}: kv_format={name!r} is not supported; allowed: {', '.join(FORMATS)}")
    return FORMATS[name]


def check_format(name: str, where: str) -> str:
    """``name`` when it is a known format, else a ``ValueError`` naming the allowed ones."""
    return kv_format(name, where).name


def check_format_dim(head_dim: int, name: str, where: str) -> None:
    """A ``ValueError`` when a block format does not tile ``head_dim`` (ggml blocks of 32)."""
    fmt = kv_format(name, where)
    if head_dim % fmt.block:
        allowed = ", ".join(f.name for f in FORMATS.values() if head_dim % f.block == 0)
        raise ValueError(
            f"{where}: {name} stores blocks of {fmt.block} elements along head_dim; head_dim={head_dim} is not "
            f"a multiple of {fmt.block} (allowed formats for it: {allowed})"
        )
