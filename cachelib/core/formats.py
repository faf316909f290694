"""The runtimes' KV block formats, backend-free: vLLM's fp8 e4m3 and llama.cpp's q8_0 / q4_0.
What a stored element costs and which rows a format can tile; the encoders live with each
backend (:mod:`cachelib.mlx.formats`, :mod:`cachelib.torch.formats`)."""

from __future__ import annotations

from .rules import KV_FORMATS

BLOCK = 32  # ggml's QK8_0 / QK4_0 (ggml-common.h)
FP8_MAX = 448.0  # the largest finite float8 e4m3fn: vLLM's conversion saturates to it
CODE_BITS = {"fp8": 8, "q8_0": 8, "q4_0": 4}  # bits of one element's code (scales aside)


def check_format(kv_format: str, where: str) -> str:
    """``kv_format`` when it is a known format, else a ``ValueError`` naming the allowed ones."""
    if kv_format not in KV_FORMATS:
        raise ValueError(f"{where}: kv_format={kv_format!r} is not supported; allowed: {', '.join(KV_FORMATS)}")
    return kv_format


def check_format_dim(head_dim: int, kv_format: str, where: str) -> None:
    """A ``ValueError`` when a block format does not tile ``head_dim`` (ggml blocks of 32)."""
    if kv_format != "fp8" and head_dim % BLOCK:
        raise ValueError(
            f"{where}: {kv_format} stores blocks of {BLOCK} elements along head_dim; head_dim={head_dim} is not "
            f"a multiple of {BLOCK} (allowed formats for it: fp8)"
        )
