"""Devices and runtimes as data, for the speed model (:mod:`cachelib.plan.speed`).

- :data:`HARDWARE`: published peak memory bandwidth and dense FLOPs per compute dtype of GPUs
  and Apple silicon, each figure with the vendor page it comes from. Dense means without 2:4
  sparsity (NVIDIA's headline tensor figures are sparse: the dense figure is half of them).
- :func:`probe_cpu` and :class:`AttentionProbe` (in :mod:`cachelib.plan.cpu_probe`, importable from
  here): this machine's CPU, measured at run time by a short copy (bandwidth) and a float32 matmul
  (compute, through the backend's own library), and what its attention costs at a length of
  context (the backend's own attention of one layer's shape timed bare), both cached in
  ``~/.cache/cachelib/cpu_probe.json``.
- :data:`CALIBRATION`: published decode measurements the runtimes' achievable fractions are
  fitted on, each runtime on its own (llama.cpp's llama-bench ``tg128``, vLLM's
  ``benchmark_latency.py``, mlx-lm's ``mlx_lm.benchmark``). The measurements the model is checked
  against are kept apart, in ``tests/plan/test_plan_speed.py``; nothing here reads them.

Nothing here computes a step's time: that is :mod:`cachelib.plan.speed`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from .hardware_base import CPU, GBS, Hardware, T  # noqa: F401  (CPU: this machine, probed)


def _gpu(name, bandwidth_gbs, fp16_tflops, memory_gb, *, fp8=None, fp32=None, link_gbs=None, sources=(), note=""):
    flops = {"float16": fp16_tflops * T}
    if fp8 is not None:
        flops["fp8"] = fp8 * T
    if fp32 is not None:
        flops["float32"] = fp32 * T
    return Hardware(
        name,
        "cuda",
        bandwidth_gbs * GBS,
        flops,
        int(memory_gb * 1e9),
        None if link_gbs is None else link_gbs * GBS,
        tuple(sources),
        note,
    )


H100 = "https://www.nvidia.com/en-us/data-center/h100/"  # H100 datasheet (SXM and PCIe/NVL columns)
H200 = "https://www.nvidia.com/en-us/data-center/h200/"
A100 = (
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
L40S = "https://www.nvidia.com/en-us/data-center/l40s/"
L4 = "https://www.nvidia.com/en-us/data-center/l4/"  # L4 datasheet: 300 GB/s, FP16 tensor 242 TFLOPS with sparsity
A10 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf"
ADA = "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"  # RTX 4090, table 2
GA102 = "https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf"  # RTX 3090
NEWS = "https://www.apple.com/newsroom/"
M1_PRO_MAX = NEWS + "2021/10/introducing-m1-pro-and-m1-max-the-most-powerful-chips-apple-has-ever-built/"
M1_ULTRA = NEWS + "2022/03/apple-unveils-m1-ultra-the-worlds-most-powerful-chip-for-a-personal-computer/"
M2_PRO_MAX = NEWS + "2023/01/apple-unveils-m2-pro-and-m2-max-next-generation-chips-for-next-level-workflows/"
M2_ULTRA = "https://www.apple.com/newsroom/2023/06/apple-introduces-m2-ultra/"
M3 = NEWS + "2023/10/apple-unveils-m3-m3-pro-and-m3-max-the-most-advanced-chips-for-a-personal-computer/"
M3_ULTRA = "https://www.apple.com/newsroom/2025/03/apple-reveals-m3-ultra-taking-apple-silicon-to-a-new-extreme/"
M4 = "https://www.apple.com/newsroom/2024/05/apple-introduces-m4-chip/"
M4_PRO_MAX = "https://www.apple.com/newsroom/2024/10/apple-introduces-m4-pro-and-m4-max/"


def _apple(name, bandwidth_gbs, memory_gb, source, fp32_tflops=None):
    # Apple publishes FP32 TFLOPS for the M1 family only; its GPUs issue FP16 at the FP32 rate.
    flops = {} if fp32_tflops is None else {"float32": fp32_tflops * T, "float16": fp32_tflops * T}
    note = (
        ""
        if fp32_tflops
        else ("Apple publishes no FLOPs for this chip: decode is planned bandwidth-bound, prefill is not predicted")
    )
    return Hardware(name, "apple", bandwidth_gbs * GBS, flops, int(memory_gb * 1e9), None, (source,), note)


HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        _gpu(
            "h100-sxm",
            3350,
            989.5,
            80,
            fp8=1979,
            fp32=67,
            link_gbs=450,
            sources=(H100,),
            note="NVLink 900 GB/s bidirectional",
        ),
        _gpu("h100-pcie", 2000, 756.5, 80, fp8=1513, fp32=51, link_gbs=64, sources=(H100,), note="PCIe Gen5 x16"),
        _gpu("h200", 4800, 989.5, 141, fp8=1979, fp32=67, link_gbs=450, sources=(H200,)),
        _gpu("a100-40gb", 1555, 312, 40, fp32=19.5, link_gbs=300, sources=(A100,), note="SXM; no FP8 tensor cores"),
        _gpu("a100-80gb", 2039, 312, 80, fp32=19.5, link_gbs=300, sources=(A100,), note="SXM; no FP8 tensor cores"),
        _gpu("l40s", 864, 362.05, 48, fp8=733, fp32=91.6, link_gbs=32, sources=(L40S,), note="PCIe Gen4 x16"),
        _gpu("l4", 300, 121, 24, fp8=242.5, fp32=30.3, link_gbs=32, sources=(L4,), note="PCIe Gen4 x16"),
        _gpu(
            "a10g",
            600,
            125,
            24,
            fp32=31.2,
            link_gbs=32,
            sources=(A10,),
            note="the A10 datasheet: AWS's A10G has no NVIDIA sheet of its own",
        ),
        _gpu(
            "rtx-4090",
            1008,
            165.2,
            24,
            fp8=330.3,
            fp32=82.6,
            link_gbs=32,
            sources=(ADA,),
            note="FP16 tensor with FP32 accumulate, dense",
        ),
        _gpu(
            "rtx-3090",
            936,
            71,
            24,
            fp32=35.6,
            link_gbs=32,
            sources=(GA102,),
            note="FP16 tensor with FP32 accumulate, dense",
        ),
        _apple("m1-pro", 200, 32, M1_PRO_MAX, 5.2),
        _apple("m1-max", 400, 64, M1_PRO_MAX, 10.4),
        _apple("m1-ultra", 800, 128, M1_ULTRA, 21),
        _apple("m2-pro", 200, 32, M2_PRO_MAX),
        _apple("m2-max", 400, 96, M2_PRO_MAX),
        _apple("m2-ultra", 800, 192, M2_ULTRA),
        _apple("m3-pro", 150, 36, M3),
        _apple("m3-max", 400, 128, M3),
        _apple("m3-ultra", 819, 512, M3_ULTRA),
        _apple("m4", 120, 32, M4),
        _apple("m4-pro", 273, 64, M4_PRO_MAX),
        _apple("m4-max", 546, 128, M4_PRO_MAX),
    )
}


def hardware_names() -> list[str]:
    return [*HARDWARE, CPU]


def hardware(name: str, backend: str | None = None) -> Hardware:
    """A device by name (``cpu`` probes this machine, its FLOP/s ``backend``'s own matmul's: None,
    numpy's); ValueError naming the allowed names."""
    if name == CPU:
        from .cpu_probe import probe_cpu

        return probe_cpu(backend=backend)
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; allowed: {', '.join(hardware_names())}")
    return HARDWARE[name]


# ---------------------------------------------------------------------------------------------
# published measurements the runtimes' fractions are fitted on (the check set lives in the tests)


@dataclass(frozen=True)
class Measurement:
    """One published decode speed: ``tokens_per_s`` per session of ``model`` (a preset or a config
    dict) with ``weights_gib`` of weights (as the runtime printed its size) or ``weight_bits`` per
    parameter, on ``hardware`` (``tp`` of them) under ``runtime``, ``batch`` sessions at ``depth``
    tokens of context (the prompt; ``test`` ``tgN`` generates N after it), K/V in ``kv_format``."""

    source: str
    model: str
    weights_gib: float
    hardware: str
    runtime: str
    tokens_per_s: float
    depth: int = 0
    batch: int = 1
    kv_format: str | None = None
    flash_attn: bool = False
    test: str = "tg128"  # llama-bench's test: 128 tokens generated after `depth` tokens
    params: Mapping = field(default_factory=dict, compare=False)
    # Bits per weight as the runtime holds them (None: ``weights_gib`` says the bytes): 16 for
    # bf16, b + 32 / group for MLX's affine b-bit quantization (a 16-bit scale and bias per group).
    weight_bits: float | None = None
    version: str = ""  # the runtime's version (or commit) where the source gives it
    tp: int = 1  # tensor-parallel devices the run spreads over (the figure is one session's, as above)


def mlx_bits(bits: int, group_size: int = 64) -> float:
    """Bits per weight of MLX's affine quantization: the codes plus a 16-bit scale and a 16-bit
    bias per ``group_size`` weights (mlx.core.quantize, mlx 0.32: scales and biases in the dtype)."""
    return bits + 32 / group_size


PR_4766 = "https://github.com/ggml-org/llama.cpp/pull/4766"  # ggerganov's llama-bench run, RTX 4090, 2024-01
DISC_4167 = "https://github.com/ggml-org/llama.cpp/discussions/4167"  # Apple silicon, build 8e672ef, Llama-2-7B

# vLLM on CUDA: benchmark_latency.py's defaults (--input-len 32 --output-len 128, one request) on
# Meta-Llama-3-8B in bf16 (--load-format dummy: the same shapes). Its "Avg latency" covers the 32-token
# prefill and 127 decode steps; the prefill forward costs about one decode step (PR #11081's forward
# times on H100: 7.51 ms for 32 tokens, 6.5 ms for 1), so 128 / latency is the decode rate within ~1%.
# H100 and L4 runs of vLLM's main branch in December 2024 (the page came with vLLM PR #11078).
VLLM_TORCH_COMPILE = "https://docs.vllm.ai/en/latest/design/torch_compile.html"
# mlx-lm on Apple silicon: its own benchmark table (mlx_lm.benchmark -p 2048 -g 128: generation after a
# 2,048-token prompt, batch 1), Qwen3-4B-Instruct-2507 on a 64 GB M4 Max, mlx 0.29.2.dev, mlx-lm 0.28.2.
MLX_LM_BENCHMARKS = "https://github.com/ml-explore/mlx-lm/blob/main/mlx_lm/BENCHMARKS.md"

CALIBRATION: tuple[Measurement, ...] = (
    # llama.cpp CUDA: Llama-2-7B (llama-bench "llama 7B") F16 12.55 GiB and Q8_0 6.67 GiB, tg128, RTX 4090.
    Measurement(PR_4766, "llama-2-7b", 12.55, "rtx-4090", "llama.cpp", 61.03),
    Measurement(PR_4766, "llama-2-7b", 6.67, "rtx-4090", "llama.cpp", 98.13),
    # llama.cpp Metal: Llama-2-7B Q4_0 (3.56 GiB) tg128 on an M1 Pro (16-core GPU) and an M2 Ultra (76-core GPU).
    Measurement(DISC_4167, "llama-2-7b", 3.56, "m1-pro", "llama.cpp", 36.4),
    Measurement(DISC_4167, "llama-2-7b", 3.56, "m2-ultra", "llama.cpp", 94.3),
    # Prompt processing (pp512, one 512-token forward) of the same runs: the fraction of peak compute.
    Measurement(PR_4766, "llama-2-7b", 12.55, "rtx-4090", "llama.cpp", 11048.22, test="pp512"),
    Measurement(DISC_4167, "llama-2-7b", 3.56, "m1-pro", "llama.cpp", 266, test="pp512"),
    # vLLM CUDA: Meta-Llama-3-8B bf16 (the llama-3.1-8b shapes), batch 1, 32 + 128 tokens, CUDA graphs:
    # H100 "Avg latency: 0.9704469823899369 seconds", L4 "Avg latency: 7.81603614680001 seconds".
    Measurement(
        VLLM_TORCH_COMPILE,
        "llama-3.1-8b",
        0,
        "h100-sxm",
        "vllm",
        128 / 0.97045,
        depth=32,
        weight_bits=16,
        version="main, 2024-12 (PR #11078)",
    ),
    Measurement(
        VLLM_TORCH_COMPILE,
        "llama-3.1-8b",
        0,
        "l4",
        "vllm",
        128 / 7.81604,
        depth=32,
        weight_bits=16,
        version="main, 2024-12 (PR #11078)",
    ),
    # mlx-lm Metal: Qwen3-4B-Instruct-2507 bf16 / 8-bit / 4-bit (group 64), Generation (128) tok/sec.
    Measurement(
        MLX_LM_BENCHMARKS, "qwen3-4b", 0, "m4-max", "mlx-lm", 52.47, depth=2048, weight_bits=16, version="0.28.2"
    ),
    Measurement(
        MLX_LM_BENCHMARKS,
        "qwen3-4b",
        0,
        "m4-max",
        "mlx-lm",
        86.907,
        depth=2048,
        weight_bits=mlx_bits(8),
        version="0.28.2",
    ),
    Measurement(
        MLX_LM_BENCHMARKS,
        "qwen3-4b",
        0,
        "m4-max",
        "mlx-lm",
        134.52,
        depth=2048,
        weight_bits=mlx_bits(4),
        version="0.28.2",
    ),
)

# Llama-2-7B's config (https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json), for the measurements.
LLAMA_2_7B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "intermediate_size": 11008,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "torch_dtype": "float16",
    "tie_word_embeddings": False,
}

# Qwen3-4B(-Instruct-2507)'s config (https://huggingface.co/Qwen/Qwen3-4B-Instruct-2507/blob/main/config.json).
QWEN3_4B = {
    "model_type": "qwen3",
    "hidden_size": 2560,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 9728,
    "vocab_size": 151936,
    "max_position_embeddings": 262144,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
}

# Qwen2.5-72B(-Instruct)'s config (https://huggingface.co/Qwen/Qwen2.5-72B-Instruct/blob/main/config.json).
QWEN2_5_72B = {
    "model_type": "qwen2",
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 29568,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


# This CPU's probes live in cpu_probe; importable from here as before.
from .cpu_probe import (  # noqa: E402, F401
    ATTENTION_PROBE_BYTES,
    ATTENTION_PROBE_LAYER_BYTES,
    COMPUTE_PROBES,
    PROBE_CACHE,
    AttentionProbe,
    cpu_hardware,
    cpu_identity,
    measure_cpu,
    probe_cpu,
    reprobe,
)
