"""Speed in the plan: a performance model per step, from the hardware's published peaks
(:mod:`cachelib.plan.hardware`) and the planner's exact byte accounting.

A decode step of ``rows`` sessions reads each device's share of the weights once and every
session's K/V as its cache holds them at that step, in the strategy's storage format (packed
codes plus scales and biases, vLLM's fp8, llama.cpp's q8_0 / q4_0 blocks: the bytes
:func:`~cachelib.plan.accounting.account` counts as used). Its FLOPs are the weights' (2 per
parameter per token), attention's (QK^T and PV: 4 x heads x head_dim per visible key per token
per layer) and dequantization's (2 per quantized element read). A prefill chunk is the same for
the chunk's tokens over the cache the chunk sees. Time per step::

    max(bytes / (f_bw x bandwidth), FLOPs / (f_c x compute)) + overhead + tp all-reduce time

The fractions ``f_bw`` / ``f_c`` and the per-step overhead are the runtime's on that kind of
device, fitted on published measurements (:data:`~cachelib.plan.hardware.CALIBRATION`), or on
this machine by ``bench/bench_speed.py`` (saved beside the CPU probe).

On this machine's CPU a decode step's attention is not a kernel streaming K/V at the bandwidth
(MLX's dense attention goes through BLAS GEMMs, threaded or not by the length; its quantized one
through its own one-thread kernels; torch's through SDPA), so a fit of the bench charges it by
:class:`~cachelib.plan.hardware.AttentionProbe`: the backend's own attention of one layer's shape,
timed bare at run time at each layer's length, times one constant (``attention_scale``) fitted at
the calibration contexts; the bytes then count the weights (and a cache decoded whole before
attention) only. Published fits never probe.

Strategies as the runtime runs them (each rule's source beside it):

- a ring (``rotating``) or window reads only the slots it holds: its used bytes stop growing at
  its capacity (:mod:`cachelib.core.rules`; mlx-lm ``RotatingKVCache`` returns the held slots);
- mlx-lm's quantized attention is not fused: ``quantized_scaled_dot_product_attention``
  (mlx_lm/models/base.py, 0.32.2) reads codes, scales and biases through ``quantized_matmul`` and
  materialises the scores (written and read back, float32), as MLX's attention does on the CPU
  (:func:`cachelib.plan.device.scores_materialised` says where);
- llama.cpp's quantized V cache needs flash attention: llama.cpp refuses to create the context
  otherwise (src/llama-context.cpp: "quantized V cache requires flash_attn"); without flash
  attention llama.cpp materialises the scores too (``ggml_soft_max`` over ``kq``);
- on torch a quantized cache (cachelib's, as transformers' ``QuantizedLayer.update``) decodes its
  whole K/V to the dtype every update: written, then read by attention;
- vLLM's fp8 KV stores one byte per element, half of fp16's bytes per step
  (https://docs.vllm.ai/en/latest/features/quantization/quantized_kvcache.html).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple

from ..core.formats import FORMATS
from ..core.units import check_dtype
from ..spec import Spec, parse_spec
from . import hardware as hardware_module
from .accounting import account
from .arch import Arch, arch_from_config
from .device import _embedding_params, scores_materialised
from .hardware import (
    CALIBRATION,
    LLAMA_2_7B,
    QWEN2_5_72B,
    QWEN3_4B,
    AttentionProbe,
    Hardware,
    Measurement,
    hardware,
)
from .presets import preset
from .runtimes import formats_of, own_loop

MIN_SPREAD = 0.10  # the narrowest interval quoted: +-10% of the step time
# A fit on published measurements quotes at least +-20%: its calibration residuals understate it (2-4
# runs per runtime, fitted almost exactly), and the held-out published measurements of
# tests/plan/test_plan_speed.py miss by up to 19% (llama.cpp), 15% (vLLM), 11% (mlx-lm).
PUBLISHED_SPREAD = 0.20
BORROWED_SPREAD = 0.30  # a runtime whose fractions come from another runtime's measurements


@dataclass(frozen=True)
class Efficiency:
    """What a runtime reaches on a kind of device: fractions of peak bandwidth and compute, a
    per-step overhead (seconds), the relative half-width of the interval, and where they come
    from."""

    bandwidth_fraction: float
    compute_fraction: float
    overhead_s: float
    spread: float
    source: str
    # Seconds per (head x visible key) of a decode step's attention computed as matvec + softmax
    # (the CPU backends): not a fused kernel streaming K/V at the bandwidth. 0 where it is fused.
    pair_s: float = 0.0
    # Seconds per session row of a decode step beyond its bytes: on the CPU backends each row's
    # token costs the work of its own vector through every layer (measured: a batch of 4 is not
    # 4 rows for the price of the weights' bytes). 0 where not fitted.
    row_s: float = 0.0
    # Multiplies the attention probe's seconds (:class:`~cachelib.plan.hardware.AttentionProbe`:
    # this CPU's attention kernel timed bare at each layer's length) where a decode step's attention
    # is charged by it instead of by its K/V bytes and a constant cost per pair. 0: not probed (every
    # published fit: GPU and Apple plans never probe).
    attention_scale: float = 0.0


class StepCost(NamedTuple):
    """What one step moves and computes on one device."""

    weight_bytes: int
    kv_bytes: int  # K/V read, in the storage format (codes + scales + biases where quantized)
    score_bytes: int  # attention scores materialised: written and read back
    flops: float
    comm_bytes: int  # tensor-parallel all-reduce payload per device
    decoded_bytes: int = 0  # K/V decoded to the dtype for attention: written and read back
    pairs: float = 0.0  # heads x queries x visible keys, summed over layers and rows
    rows: float = 0.0  # sessions decoding one token each (a decode step); 0 for a prefill chunk
    attention_flops: float = 0.0  # of ``flops``: QK^T and PV
    probed_attention_s: float = 0.0  # the attention probe's seconds for this step's layers and rows; 0: not probed

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.score_bytes + self.decoded_bytes

    @property
    def bytes_besides_attention(self) -> int:
        """What the step moves outside a probed attention: the weights, and a cache decoded whole
        before attention its codes read and its decode written (attention's read of it, of a cache
        it reads as held, and of the scores it materialises are the probe's)."""
        decode = self.kv_bytes + self.decoded_bytes // 2 if self.decoded_bytes else 0
        return self.weight_bytes + decode


def runtime_key(runtime: str | None, backend: str) -> str:
    """The name calibrations are kept under: the runtime, else cachelib's loop on its backend."""
    return f"cachelib-{backend}" if own_loop(runtime) else runtime


# ---------------------------------------------------------------------------------------------
# the step


@lru_cache(maxsize=4096)
def _held(
    arch: Arch, spec: Spec, backend: str, dtype: str, deployment, prefill_chunk: int | None, context: int
) -> tuple[int, tuple[int, ...]]:
    """(K/V bytes one session's cache holds, tokens held per attention layer) right after the
    decode step that brings it to ``context`` tokens (the prompt fed before it, then that step)."""
    prefill = context - 1 if context > 1 else None
    acc = account(
        arch,
        spec,
        backend,
        context=context,
        prefill=prefill,
        prefill_chunk=prefill_chunk,
        batch=1,
        dtype=dtype,
        deployment=deployment,
    )
    return acc.bytes_used, tuple(la.tokens_held for la in acc.layers if la.layer_type != "recurrent")


def _prompt_held(arch, spec, backend, dtype, deployment, chunk, context) -> tuple[int, tuple[int, ...]]:
    acc = account(
        arch,
        spec,
        backend,
        context=context,
        prefill=context,
        prefill_chunk=chunk,
        batch=1,
        dtype=dtype,
        deployment=deployment,
    )
    return acc.bytes_used, tuple(la.tokens_held for la in acc.layers if la.layer_type != "recurrent")


def _active_params(arch: Arch, tp: int) -> tuple[float, float]:
    """(parameters a token multiplies through on one device, of which the LM head's)."""
    embed, tied = _embedding_params(arch)
    params = (arch.num_params or 0) - (0 if tied else embed)  # the input embedding is a lookup
    return params / tp, embed / tp


def step_cost(
    arch: Arch,
    spec: Spec,
    *,
    rows: int,
    tokens: int,
    held: tuple[int, tuple[int, ...]],
    weights_bytes: int,
    quantized: bool,
    materialised: bool,
    all_logits: bool,
    tp: int = 1,
    decoded_itemsize: int = 0,
) -> StepCost:
    """One forward of ``rows`` sessions x ``tokens`` new tokens over caches that hold ``held``
    (bytes per session, tokens per attention layer) after it, on one device of ``tp``;
    ``decoded_itemsize``: the quantized K/V is decoded whole at this itemsize for attention."""
    kv_per_row, layer_tokens = held
    embed, tied = _embedding_params(arch)
    read_weights = weights_bytes if tied or not arch.num_params else weights_bytes * (1 - embed / arch.num_params)
    params, head = _active_params(arch, tp)
    if not all_logits and tokens > 1:  # the runtime computes the last position's logits only
        params_flops = 2 * rows * ((params - head) * tokens + head)
    else:
        params_flops = 2 * rows * tokens * params
    heads = arch.num_heads / tp
    dim = (arch.key_dim + arch.value_dim) / 2
    visible = 0.0  # query-key pairs summed over layers, per row
    for held_tokens in layer_tokens:
        before = max(0, held_tokens - tokens)
        visible += tokens * held_tokens if materialised or tokens == 1 else tokens * before + tokens * (tokens + 1) / 2
    attn_flops = 4 * heads * dim * visible * rows
    deq_flops = 2 * rows * sum(layer_tokens) * arch.kv_heads / tp * (arch.key_dim + arch.value_dim) if quantized else 0
    score_bytes = int(4 * 4 * heads * visible * rows) if materialised else 0  # float32 scores and probs, out and in
    # 2 all-reduces per layer of the 16-bit hidden states
    comm = 2 * arch.num_layers * rows * tokens * arch.hidden_size * 2 if tp > 1 else 0
    elements = rows * sum(layer_tokens) * arch.kv_heads / tp * (arch.key_dim + arch.value_dim)
    decoded = int(2 * elements * decoded_itemsize)
    # The per-pair cost is single-query attention's (a decode step); a chunk's is matmul FLOPs.
    pairs = heads * visible * rows if tokens == 1 else 0.0
    return StepCost(
        int(read_weights),
        kv_per_row * rows,
        score_bytes,
        params_flops + attn_flops + deq_flops,
        comm,
        decoded,
        pairs,
        float(rows) if tokens == 1 else 0.0,
        attn_flops,
    )


def step_time(cost: StepCost, hw: Hardware, eff: Efficiency, compute_dtype: str, tp: int = 1) -> float:
    """Seconds for one step: the slower of moving its bytes and doing its FLOPs at the
    runtime's fractions of the device's peaks, plus the per-step overhead and the all-reduces.
    Materialised attention scores are written by one kernel and read by the next (the softmax
    between two matmuls), so their traffic adds to the step rather than hiding under its FLOPs."""
    bw = eff.bandwidth_fraction * hw.bandwidth
    probed = cost.probed_attention_s and eff.attention_scale  # the attention as the probe timed it
    if probed:  # the probe's time stands for the attention's bytes and FLOPs
        streamed, flops = cost.bytes_besides_attention, cost.flops - cost.attention_flops
    else:
        streamed, flops = cost.bytes - cost.score_bytes, cost.flops
    t = streamed / bw
    peak = hw.compute(compute_dtype)
    if peak:
        t = max(t, flops / (eff.compute_fraction * peak))
    if probed:
        return t + eff.attention_scale * cost.probed_attention_s + cost.rows * eff.row_s + eff.overhead_s
    t += cost.score_bytes / bw
    if tp > 1 and cost.comm_bytes:
        if hw.link_bandwidth is None:
            raise ValueError(f"{hw.name} has no published link bandwidth for tensor parallelism")
        t += 2 * (tp - 1) / tp * cost.comm_bytes / hw.link_bandwidth  # ring all-reduce
    return t + cost.pairs * eff.pair_s + cost.rows * eff.row_s + eff.overhead_s


# ---------------------------------------------------------------------------------------------
# calibration


def measurement_arch(m: Measurement) -> Arch:
    if m.model == "llama-2-7b":
        return arch_from_config(LLAMA_2_7B, "Llama-2-7B", num_params=6_738_415_616, params_note="llama-bench: 6.74 B")
    if m.model in ("qwen3-4b", "qwen2.5-72b"):  # parameters counted from the config: 4.02 B and 72.7 B
        return arch_from_config(QWEN3_4B if m.model == "qwen3-4b" else QWEN2_5_72B, m.model)
    return preset(m.model)


def measurement_weights(m: Measurement, arch: Arch) -> int:
    """The bytes of weights the measured runtime holds: ``weight_bits`` per parameter where given
    (MLX's codes + scales + biases, bf16's 16), else the size the runtime printed (``weights_gib``)."""
    if m.weight_bits is not None:
        return int(arch.num_params * m.weight_bits / 8)
    return int(m.weights_gib * 2**30)


def measurement_cost(m: Measurement, *, prefill: bool = False) -> tuple[Arch, StepCost]:
    """The step a published measurement times: tg128 decodes 128 tokens after ``depth`` (the
    middle step stands for them); pp512 prefills 512 tokens after ``depth`` in one forward."""
    arch = measurement_arch(m)
    d = _deployment(m.runtime, m.kv_format, tp=m.tp)
    spec = parse_spec("standard")
    weights = measurement_weights(m, arch) // m.tp  # one device's share
    mat = scores_materialised(d.backend, m.runtime, spec)[0] if m.runtime != "llama.cpp" else not m.flash_attn
    if prefill:
        n = int(m.test.removeprefix("pp"))
        held = _prompt_held(arch, spec, d.backend, "float16", d, n, m.depth + n)
        return arch, step_cost(
            arch,
            spec,
            rows=m.batch,
            tokens=n,
            held=held,
            weights_bytes=weights,
            quantized=False,
            materialised=mat,
            all_logits=False,
            tp=m.tp,
        )
    n = int(m.test.removeprefix("tg"))
    held = _held(arch, spec, d.backend, "float16", d, None, m.depth + n // 2)
    return arch, step_cost(
        arch,
        spec,
        rows=m.batch,
        tokens=1,
        held=held,
        weights_bytes=weights,
        quantized=False,
        materialised=mat,
        all_logits=False,
        tp=m.tp,
    )


def measurement_tokens_per_s(m: Measurement, eff: Efficiency | None = None) -> float:
    """The decode tokens/s per session the model predicts for a published measurement, at the
    fractions its runtime reaches on its device (``eff`` overrides them)."""
    hw = hardware(m.hardware)
    eff = eff or efficiency(m.runtime, "torch", hw)
    return 1 / step_time(measurement_cost(m)[1], hw, eff, "float16", m.tp)


def _deployment(runtime: str | None, kv_format: str | None = None, backend: str = "mlx", tp: int = 1):
    from .runtimes import Deployment

    return Deployment.make(runtime, None if runtime else backend, kv_format=kv_format, tp=tp)


def fit_pairs(decode: list[tuple[float, float, float, float]], source: str, *, probed: bool = False) -> Efficiency:
    """Bandwidth fraction, seconds per attention pair, per session row and per step from measured
    decode steps given as (bytes / peak bandwidth, attention pairs, rows, measured seconds): least
    squares on ``seconds = x / f_bw + pairs x pair_s + rows x row_s + overhead``, terms that fit
    below 0 dropped. Needs steps at two contexts and two batch sizes (a row's cost from the step's).
    On one strategy a K/V byte goes with an attention pair, so the split between ``f_bw``, pairs and
    the overhead is not unique; the steps it predicts are.

    ``probed``: the second column is the attention probe's seconds for the step
    (:attr:`StepCost.probed_attention_s`, ``x`` then the bytes besides attention), and its
    coefficient is :attr:`Efficiency.attention_scale`: how much longer the step's attention takes
    than the bare kernel, one constant for every length."""
    import numpy as np

    x = np.array([[d[0], d[1], 1.0, d[2]] for d in decode])
    y = np.array([d[3] for d in decode])
    varied = len({d[2] for d in decode}) > 1  # one batch size cannot tell a row's cost from the step's
    # Probed, the bytes left are the weights': the same every step, so the per-step constant is theirs.
    first = ([0, 1, 3], [0, 1, 2, 3]) if probed else ([0, 1, 2, 3], [0, 1, 3])
    for cols in (*first, [0, 1, 2], [0, 1], [0, 2], [0]):
        if 3 in cols and not varied:
            continue
        coef = np.linalg.lstsq(x[:, cols], y, rcond=None)[0]
        if (coef >= 0).all() and coef[0] > 0:
            break
    got = dict(zip(cols, coef))
    attn = float(got.get(1, 0.0))
    eff = Efficiency(
        1 / got[0],
        1.0,
        float(got.get(2, 0.0)),
        MIN_SPREAD,
        source,
        0.0 if probed else attn,
        float(got.get(3, 0.0)),
        attn if probed else 0.0,
    )
    res = [
        abs((a / eff.bandwidth_fraction + p * attn + r * eff.row_s + eff.overhead_s) / t - 1) for a, p, r, t in decode
    ]
    return replace(eff, spread=max([MIN_SPREAD, *res]))


def fit(decode: list[tuple[float, float]], prefill: list[tuple[float, float, float]], source: str) -> Efficiency:
    """Fractions and overhead from measured steps: ``decode`` as (bytes / peak bandwidth,
    measured seconds), fitted by least squares to ``seconds = x / f_bw + overhead`` (overhead
    >= 0); ``prefill`` as (FLOPs / peak compute, measured seconds, overhead-free bytes time),
    giving ``f_c``. The spread is the largest relative residual, at least :data:`MIN_SPREAD`."""
    xs, ys = [d[0] for d in decode], [d[1] for d in decode]
    if len(decode) >= 2 and max(xs) > min(xs) * 1.05:
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        over = my - slope * mx
        if over < 0 or slope <= 0:
            slope, over = sum(ys) / sum(xs), 0.0
    else:
        slope, over = sum(ys) / sum(xs), 0.0
    f_bw = 1 / slope
    f_c = 1.0
    if prefill:
        f_c = min(1.0, sum(p[0] for p in prefill) / sum(max(p[1] - over, 1e-9) for p in prefill))
    res = [abs((x / f_bw + over) / y - 1) for x, y in decode]
    return Efficiency(f_bw, f_c, over, max([MIN_SPREAD, *res]), source)


@lru_cache(maxsize=None)
def published_efficiency(runtime: str, kind: str) -> Efficiency | None:
    """The fit on :data:`~cachelib.plan.hardware.CALIBRATION` for ``runtime`` on ``kind``."""
    dec, pre = [], []
    for m in CALIBRATION:
        if m.runtime != runtime or hardware(m.hardware).kind != kind:
            continue
        hw = hardware(m.hardware)
        if m.test.startswith("tg"):
            dec.append((measurement_cost(m)[1].bytes / hw.bandwidth, 1 / m.tokens_per_s))
    for m in CALIBRATION:
        hw = hardware(m.hardware)
        if m.runtime == runtime and hw.kind == kind and m.test.startswith("pp") and hw.compute("float16"):
            cost = measurement_cost(m, prefill=True)[1]
            pre.append((cost.flops / hw.compute("float16"), int(m.test[2:]) / m.tokens_per_s, 0.0))
    if not dec:
        return None
    srcs = sorted({m.source for m in CALIBRATION if m.runtime == runtime and hardware(m.hardware).kind == kind})
    eff = fit(dec, pre, f"fitted on {len(dec) + len(pre)} published measurements ({', '.join(srcs)})")
    return replace(eff, spread=max(eff.spread, PUBLISHED_SPREAD))


# Runtimes without published measurements fitted here borrow another's fit, said so, with a wider
# interval: on CUDA from vLLM (PyTorch modules, cuBLAS GEMMs and a Python step loop, as transformers'
# and cachelib's torch loops have; MLX's CUDA backend is closer to that than to ggml's kernels), on
# Apple silicon from mlx-lm (cachelib's MLX loop runs the same MLX kernels: quantized_matmul, SDPA).
BORROW = {
    ("transformers", "cuda"): ("vllm", "cuda"),
    ("cachelib-torch", "cuda"): ("vllm", "cuda"),
    ("cachelib-mlx", "cuda"): ("vllm", "cuda"),
    ("cachelib-mlx", "apple"): ("mlx-lm", "apple"),
}


def saved_cpu_efficiency(key: str, compute_probe: str | None = None) -> Efficiency | None:
    """This machine's fit for ``key`` as ``bench/bench_speed.py --save`` left it, if any: only a fit
    whose compute fraction is of the same matmul probe (``compute_probe``: the backend's own; an
    older fit, of numpy's, is not used), and none from an unreadable file."""
    try:
        got = dict(json.loads(hardware_module.PROBE_CACHE.read_text())["calibration"][key])
        if got.pop("compute_probe", None) != compute_probe:
            return None
        return Efficiency(**got)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def efficiency(runtime: str | None, backend: str, hw: Hardware) -> Efficiency:
    """The fractions ``runtime`` (None: cachelib's own loop on ``backend``) reaches on ``hw``."""
    key = runtime_key(runtime, backend)
    if hw.kind == "cpu":
        saved = saved_cpu_efficiency(key, backend)
        if saved is not None:
            return saved
        return Efficiency(
            1.0,
            1.0,
            0.0,
            0.5,
            "not calibrated on this CPU: peaks taken whole, +-50% (python bench/bench_speed.py --save calibrates it)",
        )
    own = published_efficiency(key, hw.kind)
    if own is not None:
        return own
    other = BORROW.get((key, hw.kind))
    if other is not None:
        base = published_efficiency(*other)
        return replace(
            base,
            spread=max(base.spread, BORROWED_SPREAD),
            source=f"borrowed from {other[0]} on {other[1]} ({base.source}); no {key} measurement fitted",
        )
    raise ValueError(
        f"no calibration of {key} on {hw.kind} devices; calibrated: "
        + ", ".join(f"{r} on {k}" for r, k in sorted({*BORROW, *BORROW.values()}))
    )


# ---------------------------------------------------------------------------------------------
# the plan's speed


def compute_dtype(request) -> str:
    """The dtype the matmuls run at: fp8 weights run fp8 (vLLM's W8A8), float32 runs float32,
    everything else (16-bit, and quantized weights dequantized on the fly) float16."""
    if request.weights_dtype is not None and str(request.weights_dtype).lower() in ("fp8", "float8", "e4m3"):
        return "fp8"
    return "float32" if request.dtype == "float32" else "float16"


def check_hardware(hw: Hardware, dtype: str) -> None:
    """ValueError when ``hw`` publishes FLOPs but none for ``dtype`` (naming those it has)."""
    if hw.flops and hw.compute(dtype) is None:
        raise ValueError(f"{hw.name} has no published {dtype} FLOPs; allowed dtypes there: {', '.join(hw.flops)}")


class Interval(NamedTuple):
    value: float
    low: float
    high: float

    def text(self, fmt: str = "{:.1f}") -> str:
        return f"{fmt.format(self.value)} ({fmt.format(self.low)}-{fmt.format(self.high)})"


@dataclass(frozen=True)
class Speed:
    """One strategy's speed on one device of the deployment at ``sessions`` concurrent sessions of
    ``context`` tokens: decode tokens/s per session and over the sessions (one device's, and all
    devices'), the time to first token of one prompt, and what a decode step reads."""

    spec: str
    hardware: str
    sessions: int
    context: int
    step_s: Interval
    tokens_per_s: Interval  # per session
    aggregate_tokens_per_s: Interval  # all sessions together, the deployment's
    per_device_tokens_per_s: float  # aggregate / devices
    ttft_s: Interval | None  # None: the hardware publishes no FLOPs to predict a prefill with
    cost: StepCost
    bound: str  # "bandwidth" | "compute"
    efficiency: Efficiency

    def explain(self) -> str:
        c = self.cost
        gb = 1e9
        return (
            f"{self.spec}: a decode step of {self.sessions} session(s) at {self.context:,} tokens reads "
            f"{c.bytes / gb:.2f} GB per device (weights {c.weight_bytes / gb:.2f}, K/V {c.kv_bytes / gb:.2f}"
            + (f", scores {c.score_bytes / gb:.2f}" if c.score_bytes else "")
            + f") and does {c.flops / 1e12:.2f} TFLOP: {self.bound}-bound"
        )


def _interval(t: float, spread: float) -> Interval:
    return Interval(t, t * (1 - spread), t * (1 + spread))


def _inverse(t: Interval, k: float = 1.0) -> Interval:
    return Interval(k / t.value, k / t.high, k / max(t.low, 1e-12))


@lru_cache(maxsize=16)
def _attention_probe(backend: str, heads: int, kv_heads: int, head_dim: int, layers: int, dtype: str, cache):
    """One probe per model shape for the process, its points kept in ``cache`` (the CPU probe's file):
    each length is measured once per machine and libraries."""
    return AttentionProbe(backend, heads, kv_heads, head_dim, layers, dtype, cache=cache)


class SpeedModel:
    """The speed side of one :class:`~cachelib.plan.request.PlanRequest` for one architecture on
    one device (a :class:`~cachelib.plan.hardware.Hardware` or its name; ``cpu`` probes this
    machine); ``flash_attn`` is llama.cpp's ``-fa`` (on where its default ``auto`` finds
    support); ``eff`` overrides the runtime's calibrated fractions. On the CPU, with a fit that
    charges attention by its probe (``attention_scale``), ``attention`` gives the probe (default:
    one measured now for this model's shape, each length when first needed)."""

    def __init__(
        self,
        arch: Arch,
        request,
        hardware_name: str | Hardware,
        *,
        flash_attn: bool = True,
        eff: Efficiency | None = None,
        attention: AttentionProbe | None = None,
    ):
        self.arch, self.r = arch, request
        self.attention = attention
        self.hw = hardware_name if isinstance(hardware_name, Hardware) else hardware(hardware_name, request.backend)
        self.dtype = compute_dtype(request)
        check_hardware(self.hw, self.dtype)
        check_dtype(request.dtype)
        d = request.deployment
        self.deployment = d
        self.runtime = request.runtime
        self.flash_attn = flash_attn
        kv_format = d.kv_format if d is not None else None
        if kv_format is not None and FORMATS[kv_format].value_needs_flash_attention and not flash_attn:
            raise ValueError(
                f"{FORMATS[kv_format].runtime}'s {kv_format} V cache needs flash attention (-fa on); "
                "allowed without it: f16"
            )
        self.eff = eff or efficiency(self.runtime, request.backend, self.hw)
        if arch.num_params is None:
            raise ValueError(f"{arch.name} has no parameter count: its FLOPs are unknown, so is its speed")
        weights = request.weights(arch)
        if weights is None:
            raise ValueError(f"{arch.name} has no parameter count; give --weights-memory to plan its speed")
        self.weights = weights

    def _decoded_itemsize(self, spec: Spec) -> int:
        """On torch a quantized cache hands attention its whole K/V decoded to the dtype every
        update (cachelib's torch quantized caches, as transformers' ``QuantizedLayer.update``):
        written, then read back. MLX's attention reads the codes (``quantized_matmul``)."""
        if (
            self.r.backend == "torch"
            and (own_loop(self.runtime) or self.runtime == "transformers")
            and spec.key_bits is not None
        ):
            return check_dtype(self.r.dtype)
        return 0

    def _flags(self, spec: Spec) -> tuple[bool, bool]:
        """(quantized K/V, scores materialised) as this runtime runs ``spec``."""
        kv_format = self.deployment.kv_format if self.deployment is not None else None
        quantized = spec.key_bits is not None or kv_format is not None  # every runtime format is a code
        if self.runtime == "llama.cpp":
            return quantized, not self.flash_attn
        device = "cpu" if self.hw.kind == "cpu" else "gpu"
        return quantized, scores_materialised(self.r.backend, self.runtime, spec, device)[0]

    def decode(self, spec: Spec | str, sessions: int, context: int | None = None) -> tuple[float, StepCost, str]:
        """(seconds, cost, bound) of one decode step of ``sessions`` sessions at ``context`` tokens."""
        spec = parse_spec(spec)
        context = context or self.r.context
        held = _held(self.arch, spec, self.r.backend, self.r.dtype, self.deployment, self.r.prefill_chunk, context)
        quantized, mat = self._flags(spec)
        cost = step_cost(
            self.arch,
            spec,
            rows=sessions,
            tokens=1,
            held=held,
            weights_bytes=self.weights,
            quantized=quantized,
            materialised=mat,
            all_logits=True,
            tp=self.r.tp,
            decoded_itemsize=self._decoded_itemsize(spec),
        )
        probe = self._probe()
        if probe is not None:
            bits, group = self._probe_bits(spec)
            per_row = sum(probe.seconds(n, bits, group) for n in held[1] if n)
            cost = cost._replace(probed_attention_s=per_row * sessions)
        t = step_time(cost, self.hw, self.eff, self.dtype, self.r.tp)
        peak = self.hw.compute(self.dtype)
        bound = (
            "compute"
            if peak
            and cost.flops / (self.eff.compute_fraction * peak)
            > cost.bytes / (self.eff.bandwidth_fraction * self.hw.bandwidth)
            else "bandwidth"
        )
        return t, cost, bound

    def _probe(self) -> AttentionProbe | None:
        """The attention probe where this step's attention is charged by it (the CPU only)."""
        if self.hw.kind != "cpu" or not (self.eff.attention_scale or self.attention is not None):
            return None
        if self.attention is None:
            a = self.arch
            layers = sum(1 for k in a.layer_kinds if k != "recurrent")
            dim = (a.key_dim + a.value_dim) // 2
            self.attention = _attention_probe(
                self.r.backend, a.num_heads, a.kv_heads, dim, layers, self.r.dtype, hardware_module.PROBE_CACHE
            )
        return self.attention

    def _probe_bits(self, spec: Spec) -> tuple[int | None, int]:
        """(bits, group size) of the K/V attention reads as codes: MLX runs mlx-lm's quantized
        attention where keys and values share their bits; otherwise it, and torch, attend over
        the K/V decoded to the dtype (None)."""
        group = int(spec.values.get("group_size") or 64)
        if self.r.backend == "mlx" and spec.key_bits is not None and spec.key_bits == spec.value_bits:
            return spec.key_bits, group
        return None, group

    def prefill(self, spec: Spec | str, prompt: int | None = None, rows: int = 1) -> float | None:
        """Seconds to feed a prompt of ``prompt`` tokens (default the request's) in the request's
        chunks: the time to first token; None where the hardware publishes no FLOPs."""
        if not self.hw.compute(self.dtype):
            return None
        spec = parse_spec(spec)
        prompt = prompt or (self.r.prefill if self.r.prefill else self.r.context)
        chunk = self.r.chunk or prompt
        quantized, mat = self._flags(spec)
        total, done = 0.0, 0
        while done < prompt:
            n = min(chunk, prompt - done)
            held = _prompt_held(self.arch, spec, self.r.backend, self.r.dtype, self.deployment, chunk, done + n)
            cost = step_cost(
                self.arch,
                spec,
                rows=rows,
                tokens=n,
                held=held,
                weights_bytes=self.weights,
                quantized=quantized,
                materialised=mat,
                all_logits=own_loop(self.runtime),
                tp=self.r.tp,
                decoded_itemsize=self._decoded_itemsize(spec),
            )
            total += step_time(cost, self.hw, self.eff, self.dtype, self.r.tp)
            done += n
        return total

    def speed(self, spec: Spec | str, sessions: int) -> Speed:
        """:class:`Speed` of ``spec`` at ``sessions`` concurrent sessions."""
        t, cost, bound = self.decode(spec, sessions)
        step = _interval(t, self.eff.spread)
        ttft = self.prefill(spec)
        devices = self.deployment.devices if self.deployment is not None else 1
        # Pipeline stages each hold a share of the layers: a step crosses them in turn, so the
        # step on the busiest stage repeats pp times (no micro-batching modelled).
        pp = self.r.pp
        step = Interval(*(x * pp for x in step))
        agg = _inverse(step, sessions)
        return Speed(
            str(parse_spec(spec)),
            self.hw.name,
            sessions,
            self.r.context,
            step,
            _inverse(step),
            agg,
            agg.value / devices,
            None if ttft is None else _interval(ttft * pp, self.eff.spread),
            cost,
            bound,
            self.eff,
        )

    def most_sessions(self, spec: Spec | str, min_tokens_per_s: float, limit: int) -> int:
        """The most sessions (at most ``limit``, what memory fits) each decoding at
        ``min_tokens_per_s`` or faster at the slow end of the quoted interval (a threshold is met
        by the interval's bound, not its middle, as the quality thresholds are); 0 when not even
        one does."""
        lo, hi = 0, limit
        while lo < hi:  # per-session speed falls as sessions grow
            mid = (lo + hi + 1) // 2
            if self.speed(spec, mid).tokens_per_s.low >= min_tokens_per_s:
                lo = mid
            else:
                hi = mid - 1
        return lo


class FrontierPoint(NamedTuple):
    strategy: str
    sessions: int
    tokens_per_s: float  # per session
    low: float
    high: float
    aggregate_tokens_per_s: float
    fits: bool  # within the sessions memory allows (always True without a budget)


def speed_frontier(model: SpeedModel, fits, *, most: int = 64, points: int = 24) -> list[FrontierPoint]:
    """Sessions against decode tokens/s per session for each planned strategy at the target
    context: the figure data of the Planner page's speed chart. Each curve runs to the sessions
    memory fits (past it, dimmed, to twice that), or to ``most`` without a budget."""
    out = []
    for f in fits:
        cap = f.sessions if f.sessions else most
        end = max(1, 2 * cap if f.sessions else cap)
        grid = sorted({max(1, round(end * i / (points - 1))) for i in range(points)} | {1, max(1, cap)})
        for n in grid:
            s = model.speed(f.spec, n)
            out.append(
                FrontierPoint(
                    f.spec,
                    n,
                    s.tokens_per_s.value,
                    s.tokens_per_s.low,
                    s.tokens_per_s.high,
                    s.aggregate_tokens_per_s.value,
                    not f.sessions or n <= f.sessions,
                )
            )
    return out


def plan_speeds(arch: Arch, request, fits, hardware_name: str, *, flash_attn: bool = True) -> list[Speed]:
    """Each fit's :class:`Speed` at the sessions it fits (its batch without a budget)."""
    model = SpeedModel(arch, request, hardware_name, flash_attn=flash_attn)
    return [model.speed(f.spec, f.sessions or request.batch) for f in fits if (f.sessions or request.batch) > 0]


def speedup_text(speeds: list[Speed]) -> list[str]:
    """The aggregate speed-up of each strategy over the first at their own maximum sessions, with
    the bytes a step reads per session that explain it."""
    if len(speeds) < 2:
        return []
    base, lines = speeds[0], []
    for s in speeds[1:]:
        ratio = s.aggregate_tokens_per_s.value / base.aggregate_tokens_per_s.value
        per = [(x.cost.kv_bytes / x.sessions / 1e9) for x in (base, s)]
        lines.append(
            f"{s.spec} vs {base.spec}: aggregate x{ratio:.2f} ({s.aggregate_tokens_per_s.value:,.0f} vs "
            f"{base.aggregate_tokens_per_s.value:,.0f} tokens/s at {s.sessions} vs {base.sessions} sessions), per "
            f"session x{s.tokens_per_s.value / base.tokens_per_s.value:.2f}: each session's K/V is "
            f"{per[1]:.2f} GB per step against {per[0]:.2f} GB, so a step reads {s.cost.bytes / 1e9:.1f} GB for "
            f"{s.sessions} sessions against {base.cost.bytes / 1e9:.1f} GB for {base.sessions}"
        )
    return lines


@dataclass(frozen=True)
class SpeedReport:
    """The speed side of a plan, as the CLI prints it and the Planner page shows it."""

    hardware: Hardware
    efficiency: Efficiency
    speeds: list[Speed]
    most_sessions: dict[str, tuple[int, int | None]]  # spec -> (sessions at >= min tokens/s, sessions memory fits)
    speedups: list[str]

    def rows(self) -> list[dict]:
        """One row per strategy: the columns of the CLI's speed table and the page's."""
        out = []
        for s in self.speeds:
            row = {
                "strategy": s.spec,
                "sessions": s.sessions,
                "tokens/s per session": round(s.tokens_per_s.value, 2),
                "interval": f"{s.tokens_per_s.low:.1f}-{s.tokens_per_s.high:.1f}",
                "tokens/s aggregate": round(s.aggregate_tokens_per_s.value, 1),
                "tokens/s per device": round(s.per_device_tokens_per_s, 1),
                "time to first token s": None if s.ttft_s is None else round(s.ttft_s.value, 3),
                "step GB read": round(s.cost.bytes / 1e9, 3),
                "bound": s.bound,
            }
            if s.spec in self.most_sessions:
                row["sessions at min tokens/s"] = self.most_sessions[s.spec][0]
            out.append(row)
        return out


def speed_report(
    arch: Arch, request, fits, *, flash_attn: bool = True, hardware_name: str | None = None
) -> SpeedReport:
    """Each fit's speed on ``request.hardware`` at the sessions it fits (its batch without a
    budget), the aggregate speed-ups over the first strategy, and, with
    ``request.min_tokens_per_s``, the most sessions at that speed each."""
    name = hardware_name or request.hardware
    if name is None:
        raise ValueError("give --hardware NAME to plan the speed")
    model = SpeedModel(arch, request, name, flash_attn=flash_attn)
    speeds = [model.speed(f.spec, f.sessions or request.batch) for f in fits if (f.sessions or request.batch) > 0]
    most = {}
    if request.min_tokens_per_s is not None:
        for f in fits:
            limit = f.sessions if f.sessions is not None else 4096
            most[f.spec] = (model.most_sessions(f.spec, request.min_tokens_per_s, limit), f.sessions)
    lines = speedup_text(speeds)
    other = _other_kv_format(request)
    if speeds and other is not None:
        lines += kv_format_comparison(arch, request, other, speeds[0], flash_attn=flash_attn, hardware_name=name)
    return SpeedReport(model.hw, model.eff, speeds, most, lines)


def _other_kv_format(request):
    """The runtime's other KV format to compare against (vLLM: fp8 against the dtype), if any."""
    if request.runtime != "vllm":
        return None
    (fmt,) = formats_of("vllm")
    return "auto" if request.kv_format == fmt else fmt


def kv_format_comparison(arch: Arch, request, other: str, this: Speed, **kw) -> list[str]:
    """The first strategy planned again with the runtime's other KV format (``auto``: the dtype)
    at its own maximum sessions, and the speed-up of fp8 over the dtype it buys, explained by
    the bytes a step reads."""
    from .request import plan

    alt_request = replace(request, kv_format=None if other == "auto" else other, min_tokens_per_s=None)
    fit = next(f for f in plan(arch, replace(alt_request, strategies=(parse_spec(this.spec),))))
    alt = SpeedModel(arch, alt_request, kw["hardware_name"], flash_attn=kw["flash_attn"]).speed(
        fit.spec, fit.sessions or request.batch
    )
    fp8, dtype = (alt, this) if other != "auto" else (this, alt)
    name = f"KV {request.dtype}"
    agg = fp8.aggregate_tokens_per_s.value / dtype.aggregate_tokens_per_s.value
    each = fp8.tokens_per_s.value / dtype.tokens_per_s.value
    per = [x.cost.kv_bytes / x.sessions / 1e9 for x in (dtype, fp8)]
    return [
        f"with --kv-format fp8: {fp8.sessions} sessions at {fp8.tokens_per_s.value:.1f} tokens/s each, "
        f"{fp8.aggregate_tokens_per_s.value:,.0f} in all; {name}: {dtype.sessions} at {dtype.tokens_per_s.value:.1f}, "
        f"{dtype.aggregate_tokens_per_s.value:,.0f} in all",
        f"fp8 KV speed-up: x{agg:.2f} aggregate at each format's maximum sessions (x{each:.2f} per session): "
        f"a session's "
        f"K/V is {per[1]:.2f} GB per step in fp8 against {per[0]:.2f} GB in {request.dtype} (1 byte per element "
        f"against 2), so a step of {fp8.sessions} fp8 sessions reads {fp8.cost.bytes / 1e9:.1f} GB "
        f"(weights {fp8.cost.weight_bytes / 1e9:.1f}) and one of {dtype.sessions} {request.dtype} sessions "
        f"{dtype.cost.bytes / 1e9:.1f} GB: {fp8.step_s.value * 1e3:.1f} ms against {dtype.step_s.value * 1e3:.1f} ms "
        f"per step, for {fp8.sessions / dtype.sessions:.2f}x the sessions",
    ]
