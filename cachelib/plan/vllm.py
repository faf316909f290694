"""vLLM's KV pool as vLLM sizes it at startup, from its flags by their names.

vLLM profiles one dummy forward, then gives the KV cache what its share of the device leaves
(``vllm/v1/worker/gpu_worker.py`` ``Worker.determine_available_memory``; V0's
``vllm/worker/worker.py`` ``determine_num_available_blocks`` did the same since v0.6.5)::

    requested = total x gpu_memory_utilization
    available = requested - (weights + peak activation + non-torch memory)

``vllm/utils/mem_utils.py`` ``memory_profiling``: the weights are what loading took ("Model
loading took X GiB"); the peak activation is the rise of torch's ``allocated_bytes.all.peak``
over a profile run of ``max_num_batched_tokens`` tokens; non-torch memory is what the process
holds on the device outside torch's allocator (CUDA context and cuBLAS workspaces, NCCL and
custom all-reduce buffers at tp > 1). CUDA graphs: builds before v0.21 capture them after the
pool is allocated (``compile_or_warm_up_model``), in the ``1 - gpu_memory_utilization`` left
over, so they do not shrink the pool; from v0.21 vLLM estimates them before sizing the pool and
subtracts them (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1`` by default, its log says so and
prints "Estimated CUDA graph memory: X GiB total"): that estimate is a term given here
(``--cuda-graph-memory``, default 0), not modelled.

The pool is cut into blocks (``vllm/v1/core/kv_cache_utils.py`` ``get_kv_cache_config``): one
page is ``block_size`` tokens of one layer; a model of one attention kind gets
``available // page // layers`` blocks, "GPU KV cache size" is ``blocks x block_size`` tokens.
A model with full and sliding layers is grouped in groups of ``g`` layers (the fewest layers of
one kind), each kind padded to whole groups; ``available // page // g`` blocks serve every
group, so the tokens are ``blocks // groups x block_size``. "Maximum concurrency for N tokens
per request" is the blocks over what one request of ``max_model_len`` needs from every group:
``cdiv(N, block_size)`` for a full group, ``cdiv(min(window - 1 + max_num_batched_tokens, N),
block_size) + 1`` for a sliding one (``get_max_concurrency_for_kv_cache_config``,
``SlidingWindowSpec.max_memory_usage_bytes``).

What is modelled here and what is measured: the weights are counted (parameters x bits, split
over tp/pp) unless given; the peak activation is modelled from the architecture (below); the
non-torch memory varies with the vLLM build, the GPU and tp (0.01 to 3.6 GiB in published
logs), so it is a calibrated default (:data:`NON_TORCH_DEFAULT`) unless given
(``--non-torch-memory``, the number vLLM's own memory log prints). Recurrent (Mamba) layers'
state pages are not modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.units import DTYPE_BYTES, GiB
from .arch import Arch

# vLLM's --kv-cache-dtype -> cachelib's kv_format (one byte per element; vllm/config/cache.py CacheDType)
KV_CACHE_DTYPES: dict[str, str | None] = {"auto": None, "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}
# vLLM V1's defaults for `vllm serve` (UsageContext.OPENAI_API_SERVER), vllm/engine/arg_utils.py: 2048 tokens and
# 256 sequences per step (_set_default_args_v1, 0.8-0.9; EngineArgs.get_batch_defaults later, on GPUs under 70 GiB
# and A100s; H100/H200/MI300x get 8192 tokens and 1024 sequences there: give them). The LLM class: 8192 tokens.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vllm/config/cache.py CacheConfig.gpu_memory_utilization
DEFAULT_BLOCK_SIZE = 16  # CacheConfig.block_size on CUDA

# Non-torch memory per device, calibrated on one build (vLLM main of 2024-12-13, PR #10511's own check:
# Meta-Llama-3-8B on an H100 80GB: 1.79 GiB at tp=1, 3.58 GiB at tp=2). Logs of other builds print 0.01 to
# 0.35 GiB at tp=1 on consumer GPUs: give yours (--non-torch-memory) where the pool is small.
NON_TORCH_DEFAULT = {1: round(1.79 * GiB), 2: round(3.58 * GiB)}
NON_TORCH_SOURCE = "https://github.com/vllm-project/vllm/pull/10511"

VLLM_FLAGS = (
    "--gpu-memory-utilization",
    "--max-model-len",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--kv-cache-dtype",
    "--block-size",
    "--non-torch-memory",
    "--cuda-graph-memory",
)


def kv_format_of(kv_cache_dtype: str | None) -> str | None:
    """cachelib's ``kv_format`` for vLLM's ``--kv-cache-dtype`` (``auto``: the model's dtype)."""
    if kv_cache_dtype is None:
        return None
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}; allowed: {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[kv_cache_dtype]


def check_utilization(value) -> float:
    """``value`` when it is a number in (0, 1], else a ``ValueError`` naming the range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 < value <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1] (vLLM's range), got {value!r}")
    return float(value)


def default_non_torch(tp: int, pp: int = 1) -> tuple[int, str]:
    """The calibrated non-torch memory of one device of a tp x pp deployment and where it comes
    from (the tp=2 figure for any deployment of several devices: NCCL is set up there)."""
    n = NON_TORCH_DEFAULT[1 if tp * pp == 1 else 2]
    return n, (
        f"non-torch (CUDA context, NCCL on several devices): {n / GiB:.2f} GiB calibrated on one build "
        f"({NON_TORCH_SOURCE}); give yours with --non-torch-memory"
    )


def profile_activation(
    arch: Arch, *, tokens: int, max_num_seqs: int, dtype: str = "bfloat16", tp: int = 1
) -> tuple[int, str]:
    """Peak activation bytes of vLLM's profile run on one tensor-parallel rank: a forward of
    ``tokens`` (``max_num_batched_tokens``) tokens, then the sampler over ``max_num_seqs`` rows.

    The worst moment of a layer holds the residual, its normed copy and the layer's output
    (3 x hidden per token) beside the MLP's gate/up projection and activation (3 x width / tp),
    or the attention's q/k/v and output; the sampler moment holds the final hidden states and
    float32 logits of ``min(max_num_seqs, tokens)`` rows over the whole vocabulary (gathered
    on one rank). The largest of the three."""
    from .device import _mlp_width  # the routed experts' share for a mixture of experts

    a = DTYPE_BYTES[dtype]
    h = arch.hidden_size
    mlp = tokens * (3 * h + 3 * (_mlp_width(arch) // tp)) * a
    heads, kv = max(1, arch.num_heads // tp), max(1, arch.num_kv_heads // tp)
    attention = tokens * (3 * h + (2 * heads + 2 * kv) * arch.head_dim) * a if arch.attention_layers else 0
    rows = min(max_num_seqs, tokens)
    sampler = tokens * h * a + rows * (arch.vocab_size or 0) * 4
    worst, which = max((mlp, "the MLP"), (attention, "attention"), (sampler, "the sampler"))
    return worst, f"profile run of {tokens:,} tokens, {rows} sampled rows: peak at {which} (modelled)"


@dataclass(frozen=True)
class VllmPool:
    """vLLM's KV pool on one device: each term of its startup arithmetic, and its three log lines."""

    total: int  # the device's memory
    gpu_memory_utilization: float
    weights: int
    activation: int
    non_torch: int
    available: int  # "Available KV cache memory"
    block_size: int
    page_bytes: int  # one block of one layer
    group_size: int  # layers sharing one block table slot (all of them for one attention kind)
    groups: int
    blocks: int
    tokens: int  # "GPU KV cache size"
    max_model_len: int
    concurrency: float  # "Maximum concurrency for max_model_len tokens per request"
    weights_note: str = ""
    activation_note: str = ""
    non_torch_note: str = ""
    cuda_graphs: int = 0  # subtracted from v0.21 on (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS)

    @property
    def requested(self) -> float:
        return self.total * self.gpu_memory_utilization

    def terms(self) -> list[tuple[str, int, str]]:
        """(name, bytes, where it comes from) of vLLM's arithmetic, in its order."""
        return [
            ("device memory", self.total, "as given (--budget)"),
            ("requested", int(self.requested), f"x gpu_memory_utilization {self.gpu_memory_utilization:g}"),
            ("weights", self.weights, self.weights_note),
            ("peak activation", self.activation, self.activation_note),
            ("non-torch", self.non_torch, self.non_torch_note),
            (
                "CUDA graphs",
                self.cuda_graphs,
                "given (--cuda-graph-memory): vLLM >= 0.21 subtracts its estimate"
                if self.cuda_graphs
                else "0: captured after the pool before vLLM 0.21 (give v0.21+'s estimate)",
            ),
            ("KV pool", self.available, "requested - weights - peak activation - non-torch - CUDA graphs"),
        ]

    @property
    def refused(self) -> str | None:
        """What vLLM says when one request of ``max_model_len`` tokens does not fit the pool
        (it refuses to start), else None."""
        if self.concurrency >= 1:
            return None
        return (
            f"vLLM would refuse to start: max_model_len {self.max_model_len:,} is more than the KV pool holds "
            f"({self.tokens:,} tokens); lower --max-model-len or raise --gpu-memory-utilization"
        )

    def log_lines(self) -> list[str]:
        """The three lines vLLM logs at startup, as this plan predicts them."""
        return [
            f"Available KV cache memory: {self.available / GiB:.2f} GiB",
            f"GPU KV cache size: {self.tokens:,} tokens",
            f"Maximum concurrency for {self.max_model_len:,} tokens per request: {self.concurrency:.2f}x",
        ]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_pool(
    arch: Arch,
    *,
    total_bytes: int,
    weights_bytes: int,
    max_model_len: int,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_format: str | None = None,
    dtype: str = "bfloat16",
    tp: int = 1,
    pp: int = 1,
    non_torch_bytes: int | None = None,
    activation_bytes: int | None = None,
    weights_note: str = "given",
    cuda_graph_bytes: int = 0,
) -> VllmPool:
    """vLLM's KV pool on one device of a tp x pp deployment with ``total_bytes`` of memory (see
    the module docstring); ``non_torch_bytes`` / ``activation_bytes``: as measured, else modelled;
    ``cuda_graph_bytes``: what vLLM >= 0.21 subtracts for CUDA graphs (its log's estimate)."""
    from .runtimes import Deployment, device_arch

    util = check_utilization(gpu_memory_utilization)
    for name, v in (
        ("max_model_len", max_model_len),
        ("max_num_seqs", max_num_seqs),
        ("max_num_batched_tokens", max_num_batched_tokens),
        ("block_size", block_size),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
    dev = device_arch(arch, Deployment.make("vllm", tp=tp, pp=pp, kv_format=kv_format))
    if non_torch_bytes is None:
        non_torch_bytes, nt_note = default_non_torch(tp, pp)
    else:
        nt_note = "given (--non-torch-memory; vLLM's memory log prints it)"
    if activation_bytes is None:
        activation_bytes, act_note = profile_activation(
            arch, tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, dtype=dtype, tp=tp
        )
    else:
        act_note = "given (vLLM's log: activation peak)"
    available = int(total_bytes * util - (weights_bytes + activation_bytes + non_torch_bytes + cuda_graph_bytes))
    b = kv_blocks(
        dev,
        available,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        kv_format=kv_format,
        dtype=dtype,
    )
    return VllmPool(
        total_bytes,
        util,
        weights_bytes,
        activation_bytes,
        non_torch_bytes,
        available,
        block_size,
        b.page_bytes,
        b.group_size,
        b.groups,
        b.blocks,
        b.tokens,
        max_model_len,
        b.concurrency,
        weights_note,
        act_note,
        nt_note,
        cuda_graph_bytes,
    )


@dataclass(frozen=True)
class Blocks:
    """How vLLM cuts a KV pool into blocks (one device)."""

    page_bytes: int
    group_size: int
    groups: int
    blocks: int
    tokens: int
    concurrency: float


def kv_blocks(
    dev: Arch,
    available: int,
    *,
    max_model_len: int,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_format: str | None = None,
    dtype: str = "bfloat16",
) -> Blocks:
    """The blocks, tokens and concurrency vLLM makes of ``available`` pool bytes on a device
    holding ``dev`` (:func:`cachelib.plan.runtimes.device_arch`; see the module docstring)."""
    from .slot_bytes import token_bytes

    if "recurrent" in dev.layer_kinds:
        raise ValueError(f"{dev.name}: vLLM's pages for recurrent (Mamba) layers are not modelled here")
    page = block_size * token_bytes(dev, dtype, kv_format=kv_format)
    counts = {k: dev.layer_kinds.count(k) for k in ("full", "sliding") if k in dev.layer_kinds}
    group = min(counts.values())
    per_kind = {k: _cdiv(n, group) for k, n in counts.items()}  # groups of each kind, the last padded
    groups = sum(per_kind.values())
    blocks = max(0, available) // page // group
    per_request = per_kind.get("full", 0) * _cdiv(max_model_len, block_size)
    if "sliding" in counts:
        held = min(dev.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        per_request += per_kind["sliding"] * (_cdiv(held, block_size) + 1)
    return Blocks(page, group, groups, blocks, blocks // groups * block_size, blocks / per_request)
