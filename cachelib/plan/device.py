"""The whole device's memory, not the cache alone: the weights at their real precision and split
over the devices of a deployment, the activation peak of one forward (prefill chunk or decode
step), the runtime's own overhead and the reserve the caller keeps. "Fits" counts all of them
(:class:`DeviceMemory`) and every output lists what it counted.

What this module models, and where each term comes from:

- **Weights**: parameters x bits per parameter / 8. A preset carries the precision its
  checkpoint's ``config.json`` publishes (``torch_dtype``, or ``quantization_config`` for an FP8
  checkpoint such as DeepSeek-V3: one byte per weight plus a float32 scale per 128 x 128 block);
  a float32 checkpoint is served at 16 bits (vLLM's ``dtype="auto"`` and mlx-lm's converter
  both cast it). Overrides: a dtype, an FP8 or GGUF type by name (block sizes from ggml's
  ``ggml-common.h``), MLX's affine 4/8-bit, or a number of bits per parameter.
  Tensor parallelism shards every matrix (embeddings and LM head vocab-parallel, as vLLM does);
  pipeline parallelism gives each stage its layers (vLLM's ``get_pp_indices``), the first stage
  the embeddings and the last the LM head (one tied matrix sits on both).
- **Activations**: what one forward holds beyond the weights and the cache, summed over the
  big tensors of the worst layer (an upper bound: a lazy runtime may free some before the next
  is made): the residual stream (input, normed copy, sublayer output), the q/k/v projections
  and attention output, the attention scores (batch x heads x chunk x visible keys) where the
  runtime materialises them, the MLP's gate, up and product (the routed experts' share for a
  mixture of experts), a recurrent layer's prefill tensors (mlx-lm's Jamba mixer builds the
  ``(B, T, channels, d_state)`` state of every position and its decay, ``ssm_step`` in
  ``mlx_lm/models/jamba.py``; its Mamba steps token by token over ``(B, channels, d_state)``,
  ``mlx_lm/models/mamba.py``), and the logits of every position the runtime
  computes them for: cachelib's profiler loop (runtime ``cachelib``) every position of every
  forward, in the model's dtype; mlx-lm 0.32.2's ``generate_step`` none in a prefill chunk (it
  evaluates only the caches' state, ``mx.eval([c.state for c in prompt_cache])``, so the LM head
  never runs there) and one position in the model's dtype plus its log-probabilities for the
  prompt's last token and each new one (``logits[:, -1, :]``, ``logits - logsumexp``);
  transformers' generate, vLLM and llama.cpp the last position's, in float32.
- **Attention scores** are materialised by MLX on the CPU (``mx.fast.scaled_dot_product_attention``
  falls back to matmul + softmax there), by mlx-lm's quantized attention everywhere
  (``quantized_scaled_dot_product_attention``: ``quantized_matmul`` then softmax), and not by the
  fused kernels of MLX's Metal backend, PyTorch's SDPA on CUDA, vLLM or llama.cpp's flash path.
- **Overhead**: what the runtime allocates outside arrays. MLX's allocator counts arrays only
  (``mx.get_peak_memory``), so it is 0 there; a CUDA context and vLLM's CUDA graphs are not
  measured here, so they are not guessed: give them as the reserve. vLLM takes
  ``gpu_memory_utilization`` of the device and leaves the rest alone; that share is the overhead
  it plans with.

``bench/bench_peak.py`` checks these terms against MLX's measured peak memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from ..core.units import DTYPE_BYTES
from ..spec import Spec, parse_spec
from .arch import Arch
from .runtimes import own_loop

# name -> (bits per parameter, where the size comes from)
WEIGHT_FORMATS: dict[str, tuple[float, str]] = {
    "float32": (32.0, "4 bytes"),
    "float16": (16.0, "2 bytes"),
    "bfloat16": (16.0, "2 bytes"),
    # FP8 e4m3 with a float32 scale per 128 x 128 block (DeepSeek-V3's quantization_config)
    "fp8": (8.0 + 32 / (128 * 128), "1 byte + a float32 scale per 128x128 block"),
    # MLX affine quantization, group 64, a float16 scale and bias per group (mlx_lm.convert -q)
    "mlx-4bit": (4.0 + 32 / 64, "4 bits + fp16 scale and bias per 64"),
    "mlx-8bit": (8.0 + 32 / 64, "8 bits + fp16 scale and bias per 64"),
    # ggml block types: bytes per block / elements per block (ggml-common.h)
    "q8_0": (34 * 8 / 32, "34 bytes per 32 (block_q8_0)"),
    "q5_1": (24 * 8 / 32, "24 bytes per 32 (block_q5_1)"),
    "q5_0": (22 * 8 / 32, "22 bytes per 32 (block_q5_0)"),
    "q4_1": (20 * 8 / 32, "20 bytes per 32 (block_q4_1)"),
    "q4_0": (18 * 8 / 32, "18 bytes per 32 (block_q4_0)"),
    "q6_k": (210 * 8 / 256, "210 bytes per 256 (block_q6_K)"),
    "q5_k": (176 * 8 / 256, "176 bytes per 256 (block_q5_K)"),
    "q4_k": (144 * 8 / 256, "144 bytes per 256 (block_q4_K)"),
    "q3_k": (110 * 8 / 256, "110 bytes per 256 (block_q3_K)"),
    "q2_k": (84 * 8 / 256, "84 bytes per 256 (block_q2_K)"),
}
_ALIASES = {
    "fp32": "float32",
    "f32": "float32",
    "fp16": "float16",
    "f16": "float16",
    "bf16": "bfloat16",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
    "e4m3": "fp8",
}


@dataclass(frozen=True)
class WeightsFormat:
    """How weights are stored: a name (``bfloat16``, ``fp8``, ``q4_k``, ``4.5 bits``), bits per
    parameter, and where the choice comes from."""

    name: str
    bits: float
    source: str = ""  # "published (config.json torch_dtype)", "given", "assumed"

    def describe(self) -> str:
        return f"{self.name} ({self.bits:g} bits/param, {self.source})" if self.source else self.name


def weights_format(value: str | float, source: str = "given") -> WeightsFormat:
    """A :class:`WeightsFormat` from a format name (see :data:`WEIGHT_FORMATS`, case-insensitive)
    or a number of bits per parameter; ``ValueError`` naming the allowed values otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"weights dtype must be a name or bits per parameter, got {value!r}")
    if isinstance(value, (int, float)):
        bits = float(value)
    else:
        text = str(value).strip().lower()
        text = _ALIASES.get(text, text)
        if text in WEIGHT_FORMATS:
            return WeightsFormat(text, WEIGHT_FORMATS[text][0], source)
        try:
            bits = float(text.removesuffix("bits").removesuffix("bit").strip())
        except ValueError:
            raise ValueError(
                f"unknown weights dtype {value!r}; allowed: {', '.join(WEIGHT_FORMATS)}, or bits per parameter "
                "(e.g. 4.5)"
            ) from None
    if not math.isfinite(bits) or not 0 < bits <= 64:
        raise ValueError(f"weights bits per parameter must be > 0 and <= 64, got {value!r}")
    return WeightsFormat(f"{bits:g} bits", bits, source)


def published_weights(arch: Arch) -> WeightsFormat | None:
    """The precision the model's ``config.json`` publishes, as it is served: an FP8
    ``quantization_config``, else ``torch_dtype`` (``dtype`` in transformers 5), a float32
    checkpoint being served at 16 bits; None when the config says nothing."""
    config: Mapping = arch.config or {}
    quant = config.get("quantization_config")
    if isinstance(quant, Mapping) and str(quant.get("quant_method", "")).lower() == "fp8":
        return WeightsFormat("fp8", WEIGHT_FORMATS["fp8"][0], "published (config.json quantization_config)")
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else {}
    dtype = config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or text.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        return None
    if dtype == "float32":  # vLLM dtype="auto" and mlx_lm.convert serve a float32 checkpoint at 16 bits
        return WeightsFormat("bfloat16", 16.0, "published float32 checkpoint, served at 16 bits")
    return WeightsFormat(dtype, WEIGHT_FORMATS[dtype][0], "published (config.json torch_dtype)")


def resolve_weights(arch: Arch, value: str | float | None) -> WeightsFormat:
    """The weights' format: ``value`` when given, else the published one, else 16 bits (said so)."""
    if value is not None:
        return weights_format(value)
    return published_weights(arch) or WeightsFormat("16 bits", 16.0, "assumed: the config publishes no dtype")


def _embedding_params(arch: Arch) -> tuple[int, bool]:
    """Parameters of one embedding matrix (vocab x hidden) and whether the LM head shares it."""
    config = arch.config or {}
    cfg = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    tied = bool(cfg.get("tie_word_embeddings", False))
    return (arch.vocab_size or 0) * arch.hidden_size, tied


def weights_per_device(arch: Arch, fmt: WeightsFormat, *, tp: int = 1, pp: int = 1) -> int:
    """Weight bytes on the busiest device: the largest pipeline stage's layers (plus the
    embeddings on the first stage, the LM head on the last) divided over ``tp`` ranks."""
    if arch.num_params is None:
        raise ValueError(f"{arch.name} has no parameter count; give the weights' memory instead (--weights-memory)")
    if pp == 1:
        return math.ceil(arch.num_params * fmt.bits / 8 / tp)
    from .runtimes import stage_sizes

    embed, tied = _embedding_params(arch)
    ends = embed * (1 if tied else 2)
    per_layer = max(0, arch.num_params - ends) / arch.num_layers
    sizes = stage_sizes(arch.num_layers, pp)
    worst = 0.0
    for i, n in enumerate(sizes):
        params = n * per_layer + (embed if i == 0 else 0) + (embed if i == len(sizes) - 1 else 0)
        worst = max(worst, params)
    return math.ceil(worst * fmt.bits / 8 / tp)


# ---------------------------------------------------------------------------------------------
# activations


@dataclass(frozen=True)
class Activations:
    """The transient bytes of the worst forward of a run, term by term (one device)."""

    tokens: int  # tokens in that forward (a prefill chunk, or 1 when decoding)
    visible: int  # keys its attention sees
    hidden: int  # residual stream: input, normed copy, sublayer output
    attention: int  # q/k/v projections and the attention output
    scores: int  # batch x heads x tokens x visible (+ the causal mask), where materialised
    mlp: int  # gate, up and their product
    recurrent: int  # a Mamba layer's prefill state tensors
    logits: int  # positions whose logits the runtime computes x vocab
    scores_note: str = ""

    @property
    def total(self) -> int:
        return self.hidden + self.attention + self.scores + self.mlp + self.recurrent + self.logits

    def describe(self) -> str:
        parts = [
            f"{name} {n:,}"
            for name, n in (
                ("hidden", self.hidden),
                ("attention", self.attention),
                ("scores", self.scores),
                ("mlp", self.mlp),
                ("recurrent", self.recurrent),
                ("logits", self.logits),
            )
            if n
        ]
        return (
            f"{self.tokens:,}-token forward over {self.visible:,} keys: " + ", ".join(parts) + f" ({self.scores_note})"
        )


def scores_materialised(backend: str, runtime: str | None, spec: Spec, device: str = "gpu") -> tuple[bool, str]:
    """Whether attention scores exist as an array during the forward, and why (see the module
    docstring for the sources)."""
    quantized = spec.key_bits is not None
    if backend == "mlx":
        if quantized:
            return True, "mlx-lm's quantized attention materialises the scores"
        if device == "cpu":
            return True, "MLX on the CPU computes attention as matmul + softmax"
        return False, "MLX's fused attention kernel: no scores array"
    kernel = {
        "vllm": "vLLM's paged attention kernels",
        "llama.cpp": "llama.cpp's flash attention (-fa, on by default where supported; with -fa off it holds the "
        "scores)",
        "transformers": "transformers' sdpa attention on CUDA",
    }.get(runtime or "", f"PyTorch SDPA on {backend}")
    return False, f"{kernel}: no scores array"


def _mlp_width(arch: Arch) -> int:
    config = arch.config or {}
    cfg = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    k = cfg.get("num_experts_per_tok")
    if k and cfg.get("moe_intermediate_size"):  # deepseek: routed experts' share + shared experts
        return int(cfg["moe_intermediate_size"]) * (int(k) + int(cfg.get("n_shared_experts") or 0))
    if k and arch.intermediate_size:  # jamba, mixtral: k experts of intermediate_size
        return int(k) * arch.intermediate_size
    return arch.intermediate_size or 4 * arch.hidden_size


def visible_keys(arch: Arch, spec: Spec, *, tokens: int, seen: int) -> int:
    """The most keys one attention layer sees in a forward of ``tokens`` tokens ending at
    ``seen`` tokens: all of them, a ring's or window's bound (its last ``window - 1`` keys plus
    the new tokens, as mlx-lm's RotatingKVCache returns them), or a static cache's whole buffer."""
    if spec.max_context is not None:  # a static cache attends over its whole preallocated buffer
        return max(seen, spec.max_context)
    most = seen
    if spec.window is not None:
        most = min(most, spec.window - 1 + tokens)
    if "full" not in arch.layer_kinds and "sliding" in arch.layer_kinds:
        most = min(most, arch.sliding_window - 1 + tokens)
    return max(most, tokens)


def logits_rule(runtime: str | None, tokens: int, itemsize: int) -> tuple[int, int]:
    """(positions whose logits a forward of ``tokens`` tokens computes, bytes per logit) in the
    runtime's generation loop (None: cachelib's own loop; see the module docstring)."""
    if own_loop(runtime):
        return tokens, itemsize  # the profiler keeps every position's logits
    if runtime == "mlx-lm":  # prefill chunks: none; a 1-token step: the logits and their log-probabilities
        return (0, itemsize) if tokens > 1 else (1, 2 * itemsize)
    return 1, 4  # transformers' generate, vLLM and llama.cpp: the last position's, in float32


def activation_peak(
    arch: Arch,
    spec: str | Spec = "standard",
    *,
    tokens: int,
    seen: int,
    batch: int = 1,
    dtype: str = "float16",
    backend: str = "mlx",
    runtime: str | None = None,
    device: str = "gpu",
    tp: int = 1,
    logits_tokens: int | None = None,
) -> Activations:
    """The activation bytes of one forward of ``tokens`` tokens (whole batch) that ends with
    ``seen`` tokens in the cache, on one device of a ``tp``-way split. ``logits_tokens``: the
    positions whose logits are computed (default: the runtime's rule, :func:`logits_rule`)."""
    spec = parse_spec(spec)
    a = DTYPE_BYTES[dtype]
    b, c, h = batch, tokens, arch.hidden_size
    heads = max(1, arch.num_heads // tp)
    kv_heads = 0 if arch.latent else max(1, arch.num_kv_heads // tp)
    s = visible_keys(arch, spec, tokens=tokens, seen=seen) if arch.attention_layers else 0
    attention = b * c * (2 * heads * arch.head_dim + 2 * kv_heads * arch.head_dim) * a if arch.attention_layers else 0
    materialised, note = scores_materialised(backend, runtime, spec, device)
    scores = b * heads * c * s * a + c * s if materialised and arch.attention_layers else 0
    dense = arch.model_type not in ("mamba", "falcon_mamba")
    mlp = 3 * b * c * (_mlp_width(arch) // tp) * a if dense else 0
    recurrent = 0
    if arch.recurrent is not None:
        ch, n = arch.recurrent.channels // tp, arch.recurrent.state_size
        # xz (2C), the conv output and y for every position; mlx-lm's jamba ssm_step builds the (B, T, C, N)
        # state of every position and its decay dtA, its mamba one steps token by token over (B, C, N) states
        per_token = 4 * b * c * ch * a
        if backend == "mlx" and arch.model_type == "jamba":
            recurrent = 2 * b * c * ch * n * a + per_token
        else:
            recurrent = 2 * b * ch * n * a + per_token
    positions, logit_bytes = logits_rule(runtime, tokens, a)
    if logits_tokens is not None:
        positions = logits_tokens
    logits = b * min(positions, tokens) * ((arch.vocab_size or 0) // tp) * logit_bytes
    return Activations(c, s, 3 * b * c * h * a, attention, scores, mlp, recurrent, logits, note)


def phase_activations(
    arch: Arch,
    spec: str | Spec,
    *,
    context: int,
    prefill: int | None = None,
    prefill_chunk: int | None = None,
    **options,
) -> tuple[Activations | None, Activations | None]:
    """The worst prefill forward and the last decode step of a run (None for a phase the run
    does not have); ``options`` as :func:`activation_peak` takes them."""
    from .accounting import schedule
    from .runtimes import prompt_last_alone

    prompt = context if prefill is None else min(prefill, context)
    worst, seen = None, 0
    alone = prompt_last_alone(options.get("runtime"))
    # each run of equal prompt updates (the runtime's schedule): its last one sees the most keys
    for u in schedule(prompt, prompt, prefill_chunk, last_alone=alone) if prompt else ():
        seen += u.tokens * u.repeat
        found = activation_peak(arch, spec, tokens=u.tokens, seen=seen, **options)
        worst = found if worst is None or found.total >= worst.total else worst  # a tie: the later, more keys
    decode = activation_peak(arch, spec, tokens=1, seen=context, **options) if context > prompt or not prompt else None
    return worst, decode


def run_activation_peak(
    arch: Arch,
    spec: str | Spec,
    *,
    context: int,
    prefill: int | None = None,
    prefill_chunk: int | None = None,
    batch: int = 1,
    dtype: str = "float16",
    backend: str = "mlx",
    runtime: str | None = None,
    device: str = "gpu",
    tp: int = 1,
) -> Activations:
    """The worst forward of a run (a prompt of ``prefill`` tokens, default all ``context``, fed
    in ``prefill_chunk`` chunks, then 1-token decode steps): the last prefill chunk, which sees
    the most keys at the widest chunk, or the last decode step, whichever holds more."""
    common = dict(batch=batch, dtype=dtype, backend=backend, runtime=runtime, device=device, tp=tp)
    found = phase_activations(arch, spec, context=context, prefill=prefill, prefill_chunk=prefill_chunk, **common)
    return max((a for a in found if a is not None), key=lambda x: x.total)


# ---------------------------------------------------------------------------------------------
# the whole device


@dataclass(frozen=True)
class DeviceMemory:
    """What "fits" counts on one device: each term in bytes, and the budget it is held to."""

    weights: int
    cache: int  # the cache's peak (transient copies included)
    activations: int
    overhead: int
    reserve: int
    budget: int | None = None  # the device's memory, as given
    weights_note: str = ""
    activations_note: str = ""
    overhead_note: str = ""

    @property
    def total(self) -> int:
        return self.weights + self.cache + self.activations + self.overhead + self.reserve

    @property
    def headroom(self) -> int | None:
        return None if self.budget is None else self.budget - self.total

    def terms(self) -> list[tuple[str, int, str]]:
        """(name, bytes, where it comes from) for each term counted."""
        return [
            ("weights", self.weights, self.weights_note),
            ("cache peak", self.cache, "exact, transient copies included"),
            ("activations peak", self.activations, self.activations_note),
            ("runtime overhead", self.overhead, self.overhead_note),
            ("reserve", self.reserve, "kept free, as given"),
        ]


def runtime_overhead(
    runtime: str | None,
    backend: str,
    budget: int | None,
    gpu_memory_utilization: float | None,
    non_torch: tuple[int, str] | None = None,
) -> tuple[int, str]:
    """What the runtime holds outside arrays, as far as it is known (see the module docstring);
    for vLLM the share it leaves alone plus ``non_torch`` (bytes, source: CUDA context, NCCL),
    :func:`cachelib.plan.vllm.default_non_torch` when given."""
    if runtime == "vllm" and budget is not None:
        share = gpu_memory_utilization if gpu_memory_utilization is not None else 0.9
        left = budget - math.floor(budget * share)
        note = f"vLLM uses gpu_memory_utilization={share:g} of the device and leaves the rest"
        if non_torch is not None:
            return left + non_torch[0], f"{note}; + {non_torch[1]}"
        return left, note
    if backend == "mlx":
        return 0, "MLX's allocator holds arrays only"
    return 0, "not measured here (CUDA context, graphs): give it as the reserve"
