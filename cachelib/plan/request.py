"""One planning request and its answers: :class:`PlanRequest` (strategies, a workload, a
deployment, a memory budget per device and quality thresholds), :func:`plan` (each strategy's
:class:`~cachelib.plan.solver.Fit`, every term of the device's memory counted) and
:func:`plan_request` (the fits, every measured strategy as a candidate too, and the
recommendation), as the CLI and the app's Planner page make them.

Bytes inside, units only at the edges: :func:`~cachelib.core.units.parse_memory` reads a memory
flag or a page field (a bare number is GiB; ``24GiB`` and ``24GB`` say their unit),
:meth:`PlanRequest.to_argv` writes the request back as the ``python -m cachelib plan`` command
that prints the same plan. Nothing here reads profiles (the caller passes the quality table) or
prints.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, MISSING, dataclass, field, fields, replace
from typing import NamedTuple, Sequence

from ..core.units import check_bytes, human_gib, memory_text, parse_memory
from ..spec import TORCH_QUANT_BITS, Spec, make_spec, parse_spec, spec_from_mlx_flags, strategy
from .accounting import account, replay, schedule
from .answer import runtime_flags
from .arch import Arch
from .device import (
    Activations,
    DeviceMemory,
    WeightsFormat,
    activation_peak,
    phase_activations,
    resolve_weights,
    run_activation_peak,
    runtime_overhead,
    weights_format,
    weights_per_device,
)
from .quality import Evidence, Judgement, Recommendation, choose, judge_fits, scaled_candidates
from .runtimes import LLAMA_CPP_FLAGS, RUNTIMES, Deployment, llama_cpp_settings, prompt_last_alone, resolve_runtime
from .solver import Fit, cache_budget, max_batch, max_context, max_sessions, session_count
from .vllm import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    VLLM_FLAGS,
    VllmPool,
    check_utilization,
    default_non_torch,
    kv_pool,
)

COMMAND = ("python", "-m", "cachelib", "plan")


def memory_bytes(name: str, value: str | float | None) -> int | None:
    """A memory size as bytes (a bare number is GiB; ``"24GB"`` is 24 x 10^9 bytes); None stays
    None; bad input is a ``ValueError`` naming ``name``."""
    return None if value is None else parse_memory(value, name)


def _check_number(
    name: str, value, *, integer: bool, lo: float, hi: float | None = None, optional: bool = False
) -> None:
    """ValueError naming ``name`` unless ``value`` is a finite number (an integer when
    ``integer``) within [lo, hi]; None passes when ``optional``."""
    if value is None and optional:
        return
    kinds = (int,) if integer else (int, float)
    what = "an integer" if integer else "a finite number"
    allowed = f">= {lo:g}" + ("" if hi is None else f" and <= {hi:g}")
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        raise ValueError(f"{name} must be {what} {allowed}, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


# vLLM's flags -> PlanRequest fields (the Deployment takes all but the last two: memory terms)
_VLLM_FIELDS = (
    ("--gpu-memory-utilization", "gpu_memory_utilization"),
    ("--max-model-len", "max_model_len"),
    ("--max-num-seqs", "max_num_seqs"),
    ("--max-num-batched-tokens", "max_num_batched_tokens"),
    ("--block-size", "block_size"),
    ("--non-torch-memory", "non_torch_bytes"),
    ("--cuda-graph-memory", "cuda_graph_bytes"),
)
DEVICES = ("gpu", "cpu")  # where the forward runs: on the CPU, MLX materialises attention scores
SOLVE = ("max_kv_size", "bits")  # what --solve searches for


@dataclass(frozen=True)
class PlanRequest:
    """What to plan: strategies against one workload (batch x context, the prompt and how it is
    fed), one deployment (a runtime, its parallelism and KV format) and, optionally, a memory
    budget per device and the quality thresholds of a recommendation. The model is not part of
    it: the planner is handed an :class:`~cachelib.plan.Arch`.

    Strategies are parsed here (text or :class:`~cachelib.spec.Spec`); the first is the reference
    the page counts savings against. ValueError names whatever is wrong."""

    strategies: tuple[Spec, ...]
    _: KW_ONLY
    context: int
    batch: int = 1
    backend: str = "mlx"
    dtype: str = "float16"
    prefill: int | None = None  # prompt tokens (default: the whole context); the rest is decoded
    prefill_chunk: int | None = (
        None  # feed the prompt in chunks of this many tokens (default: the runtime's, else one update)
    )
    budget_bytes: int | None = None  # one device's memory: weights + overhead + reserve + activations + cache
    weights_bytes: int | None = None  # one device's weights, as measured; None: counted at weights_dtype
    weights_dtype: str | None = None  # a format name or bits per parameter; None: the model's published dtype
    reserve_bytes: int = 0  # kept free on each device
    runtime: str | None = None  # mlx-lm | transformers | vllm | llama.cpp | cachelib; None: the backend's default
    tp: int = 1
    pp: int = 1
    kv_format: str | None = None  # fp8 (vllm), q8_0 / q4_0 (llama.cpp); None: the dtype
    device: str = "gpu"  # where the forward runs (what the attention kernel materialises)
    sessions: int | None = None  # concurrent sessions --solve must fit
    solve: str | None = None  # "max_kv_size" | "bits": search the strategy knob that fits the sessions
    max_kl: float | None = None  # recommend the cheapest strategy with mean KL at most this (nats)
    min_agreement: float | None = None  # ... and/or top-1 agreement at least this (0..1)
    # vLLM's flags by their names (runtime "vllm" only; None: vLLM's default, cachelib.plan.vllm)
    gpu_memory_utilization: float | None = None  # --gpu-memory-utilization, (0, 1], default 0.9
    max_model_len: int | None = None  # --max-model-len, default: the context
    max_num_seqs: int | None = None  # --max-num-seqs, default 256
    max_num_batched_tokens: int | None = None  # --max-num-batched-tokens, default 2048
    block_size: int | None = None  # --block-size, default 16
    non_torch_bytes: int | None = None  # --non-torch-memory: what vLLM's log prints; default calibrated
    cuda_graph_bytes: int | None = None  # --cuda-graph-memory: vLLM >= 0.21's estimate; default 0
    # llama.cpp's own flags (runtime llama.cpp only; None: llama-server's defaults)
    slots: int | None = None  # --parallel / -np
    kv_unified: bool | None = None  # --kv-unified
    swa_full: bool | None = None  # --swa-full
    flash_attn: str | None = None  # -fa on|off|auto
    ubatch: int | None = None  # -ub / --ubatch-size
    tensor_split: tuple[float, ...] | None = None  # --tensor-split, one share per --pp device
    suggest: bool = False  # also plan the strategies the evidence speaks for, at sizes a person types
    most_sessions: bool = False  # recommend the most sessions, lossy or not (else lossless first)
    hardware: str | None = None  # a device of cachelib.plan.hardware (or "cpu", probed): plan the speed on it
    min_tokens_per_s: float | None = None  # the most sessions that each decode at least this fast

    def __post_init__(self) -> None:
        specs = tuple(parse_spec(s) for s in self.strategies)
        if not specs:
            raise ValueError("give at least one strategy spec")
        object.__setattr__(self, "strategies", specs)  # frozen: set once, canonical
        for flag, value in (("context", self.context), ("batch", self.batch), ("tp", self.tp), ("pp", self.pp)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"--{flag} must be a positive integer, got {value!r}")
        # Every number the request holds is finite and in range (the page and the API, not only the CLI).
        _check_number("--prefill", self.prefill, integer=True, lo=0, optional=True)
        _check_number("--prefill-chunk", self.prefill_chunk, integer=True, lo=1, optional=True)
        for name, value in (("budget_bytes", self.budget_bytes), ("weights_bytes", self.weights_bytes)):
            check_bytes(name, value, optional=True)  # bytes: one edge for every size (core.units)
        check_bytes("reserve_bytes", self.reserve_bytes)
        _check_number("--max-kl", self.max_kl, integer=False, lo=0, optional=True)
        _check_number("--min-agreement", self.min_agreement, integer=False, lo=0, hi=1, optional=True)
        _check_number("--sessions", self.sessions, integer=True, lo=1, optional=True)
        if self.weights_dtype is not None:
            try:
                weights_format(self.weights_dtype)  # names the allowed formats
            except ValueError as e:
                raise ValueError(f"--weights-dtype: {e}") from None
            if not isinstance(self.weights_dtype, str):  # bits as a number: the text the CLI reads back
                object.__setattr__(self, "weights_dtype", _number(float(self.weights_dtype)))
        if self.device not in DEVICES:
            raise ValueError(f"unknown device {self.device!r}; allowed: {', '.join(DEVICES)}")
        runtime, backend = resolve_runtime(self.runtime, self.backend)  # none named: the backend's deployed one
        object.__setattr__(self, "runtime", runtime)
        object.__setattr__(self, "backend", backend)
        self._check_vllm_flags()
        self.deployment  # validates tp, pp and the KV format against the runtime
        if self.runtime == "llama.cpp":
            llama_cpp_settings(self.deployment, self.batch)  # the batch fits the --parallel slots
        if self.solve is not None:
            if self.solve not in SOLVE:
                raise ValueError(f"unknown --solve {self.solve!r}; allowed: {', '.join(SOLVE)}")
            if self.sessions is None or self.budget_bytes is None:
                raise ValueError(f"--solve {self.solve} needs --sessions N and --budget (what must fit, and where)")
        self._check_speed()

    def _check_speed(self) -> None:
        """The speed fields: a known hardware name; a speed threshold >= 0 that has hardware."""
        from .hardware import hardware_names

        if self.hardware is not None and self.hardware not in hardware_names():
            raise ValueError(f"unknown hardware {self.hardware!r}; allowed: {', '.join(hardware_names())}")
        _check_number("--min-tokens-per-s", self.min_tokens_per_s, integer=False, lo=0, optional=True)
        if self.min_tokens_per_s is not None and self.hardware is None:
            raise ValueError(f"--min-tokens-per-s needs --hardware NAME; allowed: {', '.join(hardware_names())}")

    def _check_vllm_flags(self) -> None:
        given = [flag for flag, name in _VLLM_FIELDS if getattr(self, name) is not None]
        if given and self.runtime != "vllm":
            raise ValueError(
                f"{given[0]} is a flag of runtime vllm; runtime {self.runtime} does not have it "
                f"(vllm's flags: {', '.join(VLLM_FLAGS)})"
            )
        if self.gpu_memory_utilization is not None:
            check_utilization(self.gpu_memory_utilization)
        for flag, name in _VLLM_FIELDS[1:5]:
            _check_number(flag, getattr(self, name), integer=True, lo=1, optional=True)
        check_bytes("--non-torch-memory", self.non_torch_bytes, optional=True)
        check_bytes("--cuda-graph-memory", self.cuda_graph_bytes, optional=True)

    def non_torch(self) -> tuple[int, str]:
        """vLLM's non-torch memory on one device (bytes, source): as given, else the calibrated default."""
        if self.non_torch_bytes is not None:
            return self.non_torch_bytes, "non-torch (CUDA context, NCCL): given (--non-torch-memory)"
        return default_non_torch(self.tp, self.pp)

    def vllm_max_model_len(self, arch: Arch) -> int:
        """vLLM's ``max_model_len``: as given, else vLLM's default, the model's length
        (``max_position_embeddings``), else the run's context."""
        return self.max_model_len or arch.max_position_embeddings or self.context

    def vllm_pool(self, arch: Arch) -> VllmPool | None:
        """vLLM's KV pool on one device as vLLM sizes it at startup (its three log lines); None
        unless the runtime is vllm and a budget (the device's memory) is given."""
        if self.runtime != "vllm" or self.budget_bytes is None:
            return None
        weights = self.weights(arch)
        if weights is None:
            raise ValueError(f"{arch.name} has no parameter count; give --weights-memory to plan vLLM's KV pool")
        d = self.deployment
        return kv_pool(
            arch,
            total_bytes=self.budget_bytes,
            weights_bytes=weights,
            max_model_len=self.vllm_max_model_len(arch),
            gpu_memory_utilization=d.gpu_memory_utilization,
            max_num_seqs=self.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
            max_num_batched_tokens=self.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
            block_size=d.paged_block,
            kv_format=self.kv_format,
            dtype=self.dtype,
            tp=self.tp,
            pp=self.pp,
            non_torch_bytes=self.non_torch_bytes,
            weights_note="given" if self.weights_bytes is not None else "counted",
            cuda_graph_bytes=self.cuda_graph_bytes or 0,
        )

    @property
    def recommending(self) -> bool:
        return self.max_kl is not None or self.min_agreement is not None

    @property
    def deployment(self) -> Deployment:
        """The runtime (the backend's default when none was named), its parallelism, flags and defaults."""
        llama = {name: getattr(self, name) for name in LLAMA_CPP_FLAGS if getattr(self, name) is not None}
        vllm = {name: getattr(self, name) for _, name in _VLLM_FIELDS[:-2]}  # None outside vllm (checked)
        return Deployment.make(
            self.runtime, self.backend, tp=self.tp, pp=self.pp, kv_format=self.kv_format, **vllm, **llama
        )

    @property
    def loop(self) -> str:
        """The generation loop planned for, in words (the runtime's)."""
        return RUNTIMES[self.runtime].loop

    @property
    def chunk(self) -> int | None:
        """Tokens per prompt update: as given, else the runtime's default, else the whole prompt."""
        d = self.deployment
        return self.prefill_chunk or self.max_num_batched_tokens or (d.prefill_chunk if d is not None else None)

    def weights_format(self, arch: Arch) -> WeightsFormat:
        return resolve_weights(arch, self.weights_dtype)

    def weights(self, arch: Arch) -> int | None:
        """One device's weight bytes: as given, else ``arch``'s parameters at the weights' format,
        split over the deployment; None when neither is known."""
        if self.weights_bytes is not None:
            return self.weights_bytes
        if arch.num_params is None:
            return None
        return weights_per_device(arch, self.weights_format(arch), tp=self.tp, pp=self.pp)

    def overhead(self) -> tuple[int, str]:
        """What the runtime holds outside arrays on one device, and where the number comes from."""
        d = self.deployment
        non_torch = self.non_torch() if self.runtime == "vllm" else None
        if non_torch is not None and self.cuda_graph_bytes:  # inside vLLM's share from v0.21 on
            non_torch = (
                non_torch[0] + self.cuda_graph_bytes,
                f"{non_torch[1]}; + CUDA graphs {human_gib(self.cuda_graph_bytes)} (--cuda-graph-memory)",
            )
        return runtime_overhead(
            self.runtime, self.backend, self.budget_bytes, d.gpu_memory_utilization if d else None, non_torch
        )

    def account(self, arch: Arch, spec: Spec, **changes):
        """The cache accounting of ``spec`` for this request's run (its context, prompt, chunk,
        batch, dtype and deployment), any of them replaced by ``changes``."""
        run = dict(
            context=self.context,
            prefill=self.prefill,
            prefill_chunk=self.prefill_chunk,
            batch=self.batch,
            dtype=self.dtype,
            deployment=self.deployment,
        )
        return account(arch, spec, self.backend, **{**run, **changes})

    def activations(
        self, arch: Arch, spec: Spec, *, context: int | None = None, batch: int | None = None
    ) -> Activations:
        """The activation peak of the run's worst forward on one device."""
        return run_activation_peak(
            arch,
            spec,
            context=context or self.context,
            prefill=self.prefill,
            prefill_chunk=self.chunk,
            batch=batch or self.batch,
            dtype=self.dtype,
            backend=self.backend,
            runtime=self.runtime,
            device=self.device,
            tp=self.tp,
        )

    def forward_bytes(
        self,
        arch: Arch,
        spec: Spec,
        *,
        context: int | None = None,
        batch: int | None = None,
        run_peak: int | None = None,
        prompt_peak: int | None = None,
    ) -> tuple[int, Activations]:
        """The bytes one device holds beyond the cache's peak at the run's worst moment, and
        the forward that makes it: the worst prefill chunk over the cache as the prompt leaves
        it, or the last decode step over the cache at its peak, whichever is larger.
        ``run_peak``: the cache's peak over the run, when the caller has it (else it is accounted
        here); ``prompt_peak`` is not needed any more (each prompt update is replayed with its own
        cache) and is ignored."""
        context, batch = context or self.context, batch or self.batch
        prefill = self.prefill
        pre, dec = phase_activations(
            arch,
            spec,
            context=context,
            prefill=prefill,
            prefill_chunk=self.chunk,
            batch=batch,
            dtype=self.dtype,
            backend=self.backend,
            runtime=self.runtime,
            device=self.device,
            tp=self.tp,
        )

        prompt = context if prefill is None else min(prefill, context)
        moments, prompt_peak = self._prompt_moments(arch, spec, prompt, batch) if pre is not None else ([], 0)
        if run_peak is None:
            run_peak = (
                prompt_peak
                if dec is None
                else account(
                    arch,
                    spec,
                    self.backend,
                    context=context,
                    prefill=prompt,
                    prefill_chunk=self.prefill_chunk,
                    batch=batch,
                    dtype=self.dtype,
                    deployment=self.deployment,
                ).peak_bytes
            )
        if dec is not None:
            moments.append((run_peak + dec.total, dec))
        worst, forward = max(moments, key=lambda m: m[0])
        return worst - run_peak, forward

    def _prompt_moments(
        self, arch: Arch, spec: Spec, prompt: int, batch: int
    ) -> tuple[list[tuple[int, Activations]], int]:
        """Each run of equal prompt updates (the runtime's schedule): the cache's peak during its
        last update plus that update's forward. A chunk's activations meet the cache as it is then
        (the first 2,048-token chunk of a 3,000-token prompt a 2,048-token cache), and the last
        update of a run is its worst (the most keys, the largest cache). Also the cache's peak over
        the whole prompt."""
        plan = schedule(prompt, prompt, self.chunk, last_alone=prompt_last_alone(self.runtime))
        run = replay(
            arch, spec, self.backend, batch=batch, dtype=self.dtype, deployment=self.deployment, context=prompt
        )
        out, peak = [], 0
        for u in plan:
            if u.repeat > 1:
                peak = max(peak, run.feed(u.tokens, u.repeat - 1, u.phase)[0])
            step = run.update(u.tokens, u.phase, False)
            peak = max(peak, step.peak_bytes)
            act = activation_peak(
                arch,
                spec,
                tokens=u.tokens,
                seen=step.offset,
                batch=batch,
                dtype=self.dtype,
                backend=self.backend,
                runtime=self.runtime,
                device=self.device,
                tp=self.tp,
            )
            out.append((step.peak_bytes + act.total, act))
        return out, peak

    def cache_budget(self, arch: Arch) -> int | None:
        """Bytes one device's budget leaves for the cache and the activations (budget - weights -
        overhead - reserve); None without a budget."""
        if self.budget_bytes is None:
            return None
        weights = self.weights(arch)
        if weights is None:
            raise ValueError(f"{arch.name} has no parameter count; give --weights-memory to plan against --budget")
        return cache_budget(self.budget_bytes, weights, self.reserve_bytes, self.overhead()[0])

    def to_argv(self, model: str, evidence: Sequence[str] = (), *, default_evidence: bool = True) -> list[str]:
        """The ``python -m cachelib plan`` command line that prints the same plan for ``model`` (a
        preset name or a config.json path), with an ``--evidence`` for each path beyond the
        committed evidence (left out with ``default_evidence=False``). Memory is written so that
        it reads back as exactly these bytes (GiB where it can)."""
        args = [*COMMAND, "--model", model, "--context", str(self.context)]
        if self.batch != 1:
            args += ["--batch", str(self.batch)]
        for spec in self.strategies:
            args += ["--strategy", str(spec)]
        args += ["--runtime", self.runtime]
        if RUNTIMES[self.runtime].also_on:  # a runtime on several backends (cachelib's loop) names its own
            args += ["--backend", self.backend]
        args += ["--dtype", self.dtype]
        for flag, value in (("--tp", self.tp), ("--pp", self.pp)):
            if value != 1:
                args += [flag, str(value)]
        if self.kv_format is not None:
            args += ["--kv-format", self.kv_format]
        if self.device != "gpu":
            args += ["--device", self.device]
        for flag, value in (("--prefill", self.prefill), ("--prefill-chunk", self.prefill_chunk)):
            if value is not None:
                args += [flag, str(value)]
        if self.budget_bytes is not None:
            args += ["--budget", memory_text(self.budget_bytes)]
        if self.weights_bytes is not None:
            args += ["--weights-memory", memory_text(self.weights_bytes)]
        elif self.weights_dtype is not None:
            args += ["--weights-dtype", str(self.weights_dtype)]
        if self.reserve_bytes:
            args += ["--reserve", memory_text(self.reserve_bytes)]
        if self.sessions is not None:
            args += ["--sessions", str(self.sessions)]
        if self.solve is not None:
            args += ["--solve", self.solve]
        args += llama_cpp_argv(self)
        if not default_evidence:
            args += ["--no-default-evidence"]
        for path in evidence:
            args += ["--evidence", str(path)]
        for flag, name in _VLLM_FIELDS:
            value = getattr(self, name)
            if value is not None:
                text = {
                    "non_torch_bytes": memory_text,
                    "cuda_graph_bytes": memory_text,
                    "gpu_memory_utilization": _number,
                }.get(name, str)(value)
                args += [flag, text]
        if self.max_kl is not None:
            args += ["--max-kl", _number(self.max_kl)]
        if self.min_agreement is not None:
            args += ["--min-agreement", _number(self.min_agreement)]
        if self.suggest:
            args += ["--suggest"]
        if self.most_sessions:
            args += ["--most-sessions"]
        if self.hardware is not None:
            args += ["--hardware", self.hardware]
        if self.min_tokens_per_s is not None:
            args += ["--min-tokens-per-s", _number(self.min_tokens_per_s)]
        return args


def request_defaults() -> dict[str, object]:
    """Every request field's default: the one source of defaults of the CLI's flags and the
    Planner page's fields."""
    return {f.name: f.default for f in fields(PlanRequest) if f.default is not MISSING}


def _number(value: float) -> str:
    """The shortest text that reads back as exactly ``value``."""
    short = f"{value:g}"
    return short if float(short) == value else repr(float(value))


def _max_context(arch: Arch, spec: Spec, available: int, r: PlanRequest, common: dict) -> tuple[int | None, str]:
    """The longest context whose cache peak and activations fit ``available``. The activations
    grow with the keys attention sees, so the search runs with those of the asked context, and
    again with those of the answer when they are larger (the second answer always fits)."""
    first = r.activations(arch, spec, batch=r.batch).total
    if first >= available:
        return 0, "memory"
    n, why = max_context(arch, spec, available - first, batch=r.batch, **common)
    if n is None or n <= r.context or r.activations(arch, spec, context=n, batch=r.batch).total <= first:
        return n, why

    def fits(m: int) -> bool:  # the cache's peak and what the worst forward adds, for a run of m tokens
        p = None if r.prefill is None else min(r.prefill, m)
        peak = r.account(arch, spec, context=m, prefill=p).peak_bytes
        return peak + r.forward_bytes(arch, spec, context=m, batch=r.batch)[0] <= available

    lo, hi = r.context, n  # fits(lo) (the first search says so); the activations may refuse n
    if fits(hi):
        return n, why
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, "memory"


def plan(arch: Arch, request: PlanRequest) -> list[Fit]:
    """Each of the request's strategies: its cache for ``batch`` x ``context`` on one device of
    the deployment, the activations and overhead around it and, with a budget, what fits (see
    :mod:`cachelib.plan.solver`)."""
    r = request
    weights = r.weights(arch)
    available = r.cache_budget(arch)
    overhead, overhead_note = r.overhead()
    d = r.deployment
    fmt = r.weights_format(arch)
    if r.weights_bytes is not None:
        weights_note = "given"
    elif weights is not None:
        named = "" if fmt.name.endswith(" bits") else f"{fmt.name}, "
        weights_note = f"{arch.num_params:,} params x {fmt.bits:g} bits ({named}{fmt.source})"
        if r.tp * r.pp > 1:
            weights_note += f", split over tp={r.tp} x pp={r.pp}"
    else:
        weights_note = "unknown"
    common = dict(backend=r.backend, dtype=r.dtype, prefill=r.prefill, prefill_chunk=r.prefill_chunk, deployment=d)
    out = []
    for spec in r.strategies:
        acc = r.account(arch, spec)
        extra, act = r.forward_bytes(arch, spec)
        limit, why, most, sessions = None, "", None, None
        if available is not None:
            row = r.forward_bytes(arch, spec, batch=1)[0]
            limit, why = _max_context(arch, spec, available, r, common)
            most = max_batch(arch, spec, available, context=r.context, row_bytes=row, **common)
            sessions = max_sessions(arch, spec, available, context=r.context, forward_bytes=row, **common)
        note = act.describe()
        if extra != act.total:
            note += f"; counted beyond the cache's run peak: {extra:,} (the cache holds less at that forward)"
        memory = DeviceMemory(
            weights or 0,
            acc.peak_bytes,
            extra,
            overhead,
            r.reserve_bytes,
            r.budget_bytes,
            weights_note,
            note,
            overhead_note,
        )
        out.append(
            Fit(
                str(spec),
                acc,
                weights,
                r.reserve_bytes,
                r.budget_bytes,
                limit,
                why,
                most,
                sessions,
                activation_bytes=extra,
                overhead_bytes=overhead,
                device=memory,
            )
        )
    return out


class Solved(NamedTuple):
    """The answer of ``--solve``: the spec found (None when nothing fits), the knob's value, the
    sessions it fits, and the sentence that says so with the evidence (the next value's count)."""

    spec: Spec | None
    value: int | None
    sessions: int
    text: str


def solve_sessions(arch: Arch, request: PlanRequest) -> Solved:
    """The largest ``max_kv_size`` (mlx-lm's ``--max-kv-size``: ``rotating:max_size=N,keep=4``)
    or the most KV bits (``quantized:bits=B``) with which ``request.sessions`` concurrent
    sessions of ``request.context`` tokens fit one device's budget, activations counted."""
    r = request
    if r.solve is None or r.sessions is None:
        raise ValueError("give --solve and --sessions")
    available = r.cache_budget(arch)
    want, budget = r.sessions, human_gib(r.budget_bytes)
    where = f"{want} sessions of {r.context:,} tokens in {budget} per device"

    def fits(spec: Spec) -> int:
        p = None if r.prefill is None else min(r.prefill, r.context)
        acc = r.account(arch, spec, prefill=p, batch=1)
        return session_count(
            acc.peak_bytes + r.forward_bytes(arch, spec, batch=1)[0], acc.max_resident_bytes, available
        )

    if r.solve == "bits":
        allowed = TORCH_QUANT_BITS if r.backend == "torch" else strategy("quantized").knob("bits").choices
        tried = []
        for bits in sorted(allowed, reverse=True):
            spec = make_spec("quantized", {"bits": bits})
            n = fits(spec)
            tried.append(f"{bits} bits: {n}")
            if n >= want:
                return Solved(
                    spec,
                    bits,
                    n,
                    f"--solve bits: {spec} is the most KV bits that fit {where} "
                    f"({n} fit; sessions per bits tried: {', '.join(tried)})",
                )
        return Solved(None, None, 0, f"--solve bits: no KV bits fit {where} (sessions per bits: {', '.join(tried)})")

    def ring(size: int) -> Spec:
        return spec_from_mlx_flags(max_kv_size=size)  # mlx-lm's ring: 4 sink tokens

    whole = fits(ring(r.context))
    if whole >= want:
        return Solved(
            ring(r.context),
            r.context,
            whole,
            f"--solve max_kv_size: every max_kv_size fits {where}, up to the whole context "
            f"({whole} sessions fit at max_kv_size {r.context:,}); no ring is needed",
        )
    lo, hi = 5, r.context  # keep=4 needs a ring of at least 5 slots
    if fits(ring(lo)) < want:
        return Solved(None, None, 0, f"--solve max_kv_size: not even a {lo}-token ring fits {where}")
    while hi - lo > 1:  # fits(ring(lo)) >= want > fits(ring(hi)); sessions fall as the ring grows
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(ring(mid)) >= want else (lo, mid)
    n, after = fits(ring(lo)), fits(ring(lo + 1))
    return Solved(
        ring(lo),
        lo,
        n,
        f"--solve max_kv_size: {lo:,} is the largest max_kv_size (mlx-lm --max-kv-size, "
        f"{ring(lo)}) that fits {where}: {n} fit at {lo:,}, {after} at {lo + 1:,}",
    )


@dataclass(frozen=True)
class PlanResult:
    arch: Arch
    request: PlanRequest
    fits: list[Fit]  # the strategies asked for, then a solve's answers, then (--suggest) the evidence's
    weights_bytes: int | None
    added: tuple[str, ...] = ()  # planned because the evidence measured them (or their kept fraction)
    skipped: dict[str, str] = field(default_factory=dict)  # measured, not plannable here -> why
    recommendation: Recommendation | None = None  # with a threshold only
    judgements: dict[str, Judgement] = field(default_factory=dict)  # spec -> what the evidence says of it
    choice: Recommendation | None = None  # the strategy to deploy, thresholds or not (the answer's pick)
    solved: tuple[Solved, ...] = ()  # --solve's answer, then the other knob's for the same sessions

    @property
    def cache_budget(self) -> int | None:
        """Bytes the budget leaves for the cache (budget - weights - reserve); None without a budget."""
        return self.request.cache_budget(self.arch)

    @property
    def measured_on(self) -> list[str]:
        """The models the attached quality was measured on (lossless strategies need none)."""
        return sorted({f.quality.model for f in self.fits if f.quality is not None and f.quality.samples})


GROWTH_STEP = 256  # mlx-lm's KVCache.step: the sizes a person types for a ring or a window


def typed_size(size: int) -> int:
    """``size`` rounded up to what a person would type: a power of two below the growth step,
    else a multiple of it (up, so the kept fraction stays at least the measured one)."""
    if size <= GROWTH_STEP:
        return 1 << max(0, math.ceil(math.log2(max(1, size))))
    return math.ceil(size / GROWTH_STEP) * GROWTH_STEP


def suggestions(evidence: Sequence[Evidence], context: int) -> list[Spec]:
    """What ``--suggest`` adds: every measured strategy, and every measured bounded one scaled to
    ``context`` at its measured kept fraction, its bound rounded up by :func:`typed_size`."""
    out: dict[tuple, Spec] = {}
    for spec in [parse_spec(e.spec) for e in evidence]:
        out.setdefault(spec.key, spec)
    for spec in scaled_candidates(evidence, context):
        knob = spec.strategy.window
        try:
            typed = make_spec(spec.name, {k: typed_size(v) if k == knob else v for k, v in spec.params})
        except ValueError:
            continue
        if typed.window is not None and typed.window < context:
            out.setdefault(typed.key, typed)
    return list(out.values())


def plan_request(arch: Arch, request: PlanRequest, evidence: Sequence[Evidence] = ()) -> PlanResult:
    """Plan ``request`` for ``arch`` and judge each fit by ``evidence`` (see
    :func:`cachelib.plan.quality.judge`). A ``--solve`` plans its ring and the KV bits that fit
    the same sessions too; with ``suggest`` the strategies the evidence speaks for are planned
    as well (:func:`suggestions`), each on its own, so that one this model or backend refuses is
    listed in ``skipped``, not fatal. The strategy to deploy is :func:`~cachelib.plan.quality.choose`'s."""
    fits = plan(arch, request)
    added: list[str] = []
    skipped: dict[str, str] = {}
    asked = {s.key for s in request.strategies}
    solved: list[Solved] = []
    if request.solve is not None:
        for knob in (request.solve, *(k for k in SOLVE if k != request.solve)):
            try:
                found = solve_sessions(arch, replace(request, solve=knob))
            except ValueError:
                if knob == request.solve:
                    raise
                continue  # the other knob, where this runtime has none (vLLM's own cache has no ring)
            solved.append(found)
            whole = found.spec is not None and found.spec.window is not None and found.spec.window >= request.context
            if found.spec is not None and not whole and found.spec.key not in asked:
                asked.add(found.spec.key)
                fits += plan(arch, replace(request, strategies=(found.spec,)))
    if request.suggest:
        for spec in suggestions(evidence, request.context):
            if spec.key in asked:
                continue
            asked.add(spec.key)
            try:
                fits += plan(arch, replace(request, strategies=(spec,)))
            except ValueError as e:  # e.g. measured on torch only, or a group size these heads refuse
                skipped[str(spec)] = str(e)
            else:
                added.append(str(spec))
    fits, judgements = judge_fits(fits, evidence, backend=request.backend, planned=arch, kv_format=request.kv_format)
    runtime, model_type = request.runtime, arch.model_type or None
    choice = choose(
        fits,
        max_kl=request.max_kl,
        min_agreement=request.min_agreement,
        planned_model=arch,
        judgements=judgements,
        sessions=request.sessions,
        most_sessions=request.most_sessions,
        runtime=runtime,
        flags=None if runtime is None else lambda s: runtime_flags(s, runtime, model_type),
        kv_format=request.kv_format,
    )
    rec = choice if request.recommending else None
    return PlanResult(
        arch, request, fits, request.weights(arch), tuple(added), skipped, rec, judgements, choice, tuple(solved)
    )


def llama_cpp_argv(r: PlanRequest) -> list[str]:
    """The llama.cpp flags of ``r`` as ``python -m cachelib plan`` takes them (llama.cpp's names)."""
    args: list[str] = []
    if r.slots is not None:
        args += ["--parallel", str(r.slots)]
    for flag, on in (("--kv-unified", r.kv_unified), ("--swa-full", r.swa_full)):
        if on is not None:
            args.append(flag if on else "--no-" + flag[2:])
    if r.flash_attn is not None:
        args += ["--flash-attn", r.flash_attn]
    if r.ubatch is not None:
        args += ["--ubatch-size", str(r.ubatch)]
    if r.tensor_split is not None:
        args += ["--tensor-split", ",".join(f"{x:g}" for x in r.tensor_split)]
    return args
