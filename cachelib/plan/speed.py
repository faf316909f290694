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
timed bare at run time at each layer's length (a batch's over its rows at once; a torch quantized
cache's with its whole-cache decode), times one constant (``attention_scale``) fitted at the
calibration contexts; the bytes then count the weights (and a cache decoded whole before attention
that the probe does not time) only. Published fits never probe.

The model is in three modules: the step (:mod:`cachelib.plan.speed_step`: :func:`step_cost`,
:func:`step_time`, :class:`Efficiency`), its calibration (:mod:`cachelib.plan.speed_fit`: published
and this machine's fits, :func:`efficiency`) and the plan's speed here (:class:`SpeedModel`,
:func:`speed_report`); every name of the first two is importable from here too.

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

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple

from ..core.formats import FORMATS
from ..core.units import check_dtype
from ..spec import Spec, parse_spec
from . import cpu_probe
from .arch import Arch
from .device import scores_materialised
from .hardware import (  # the published data as this module gave it before the split
    CALIBRATION,
    LLAMA_2_7B,
    PROBE_CACHE,
    QWEN2_5_72B,
    QWEN3_4B,
    AttentionProbe,
    Hardware,
    Measurement,
    hardware,
)
from .runtimes import formats_of, own_loop
from .speed_fit import (
    BORROW,
    _deployment,
    efficiency,
    fit,
    fit_pairs,
    measurement_arch,
    measurement_cost,
    measurement_tokens_per_s,
    measurement_weights,
    published_efficiency,
    saved_cpu_efficiency,
)
from .speed_step import (
    BORROWED_SPREAD,
    MIN_SPREAD,
    PUBLISHED_SPREAD,
    Efficiency,
    StepCost,
    _active_params,
    _held,
    _prompt_held,
    runtime_key,
    step_cost,
    step_time,
)

# The step (speed_step) and the calibration (speed_fit) are importable from here, as before the split.
__all__ = [
    "CALIBRATION",
    "LLAMA_2_7B",
    "PROBE_CACHE",
    "QWEN2_5_72B",
    "QWEN3_4B",
    "Measurement",
    "BORROW",
    "BORROWED_SPREAD",
    "MIN_SPREAD",
    "PUBLISHED_SPREAD",
    "Efficiency",
    "FrontierPoint",
    "Interval",
    "Speed",
    "SpeedModel",
    "SpeedReport",
    "StepCost",
    "_active_params",
    "_deployment",
    "_held",
    "_prompt_held",
    "check_hardware",
    "compute_dtype",
    "efficiency",
    "fit",
    "fit_pairs",
    "kv_format_comparison",
    "measurement_arch",
    "measurement_cost",
    "measurement_tokens_per_s",
    "measurement_weights",
    "plan_speeds",
    "published_efficiency",
    "runtime_key",
    "saved_cpu_efficiency",
    "speed_frontier",
    "speed_report",
    "speedup_text",
    "step_cost",
    "step_time",
]


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
        if probe is not None:  # the batch's attention, probed as the batch (AttentionProbe.seconds)
            bits, group = self._probe_bits(spec)
            seconds = sum(probe.seconds(n, bits, group, rows=sessions) for n in held[1] if n)
            cost = cost._replace(probed_attention_s=seconds, probed_decode=bits is not None and cost.decoded_bytes > 0)
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
                self.r.backend, a.num_heads, a.kv_heads, dim, layers, self.r.dtype, cpu_probe.PROBE_CACHE
            )
        return self.attention

    def _probe_bits(self, spec: Spec) -> tuple[int | None, int]:
        """(bits, group size) of the K/V the probed attention starts from as codes: MLX runs mlx-lm's
        quantized attention where keys and values share their bits; torch's quantized caches
        (:meth:`_decoded_itemsize`) decode theirs whole each step and the probe times that decode
        with the SDPA; otherwise attention reads dense K/V (None)."""
        group = int(spec.values.get("group_size") or 64)
        if spec.key_bits is not None and spec.key_bits == spec.value_bits:
            if self.r.backend == "mlx" or self._decoded_itemsize(spec):
                return spec.key_bits, group
        return None, group

    def prefill(self, spec: Spec | str, prompt: int | None = None, rows: int = 1) -> float | None:
        """Seconds to feed a prompt of ``prompt`` tokens (default the request's) in the request's
        chunks: the time to first token; None where the hardware publishes no FLOPs.

        Where the attention probe charges the decode steps (the CPU) and the runtime materialises a
        chunk's scores (MLX on the CPU: matmul, mask, softmax, matmul, not a kernel at the FLOP
        rate), a chunk's attention is the probe's causal attention of the chunk's queries over each
        layer's keys, as the kernel takes it bare (the decode's ``attention_scale`` is fitted on
        single-query steps, where it also carries what a step does around the kernel); the rest of
        the chunk is its weights' FLOPs at the compute fraction. Measured (MLX, SmolLM2 float32,
        512-token chunks, load 5): that attention is 30-47% of the prefill, its FLOPs 6-20%."""
        if not self.hw.compute(self.dtype):
            return None
        spec = parse_spec(spec)
        prompt = prompt or (self.r.prefill if self.r.prefill else self.r.context)
        chunk = self.r.chunk or prompt
        quantized, mat = self._flags(spec)
        probe = self._probe() if mat else None
        eff = replace(self.eff, attention_scale=1.0) if probe is not None else self.eff
        bits, group = self._probe_bits(spec)
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
            if probe is not None:
                per_row = sum(probe.seconds(h, bits, group, queries=n) for h in held[1] if h)
                cost = cost._replace(probed_attention_s=per_row * rows)
            total += step_time(cost, self.hw, eff, self.dtype, self.r.tp)
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
