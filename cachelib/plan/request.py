"""One planning request and its answers: :class:`PlanRequest` (strategies, a workload, a memory
budget and quality thresholds), :func:`plan` (each strategy's :class:`~cachelib.plan.solver.Fit`)
and :func:`plan_request` (the fits, every measured strategy as a candidate too, and the
recommendation), as the CLI and the app's Planner page make them.

Bytes inside, GB only at the edges: :func:`gb_to_bytes` reads a ``--*-gb`` flag or a page field
into bytes, :meth:`PlanRequest.to_argv` writes the request back as the ``python -m cachelib plan``
command that prints the same plan. Nothing here reads profiles (the caller passes the quality
table) or prints.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Sequence

from ..core.units import GB
from ..spec import Spec, parse_spec
from .accounting import account
from .arch import Arch
from .quality import Evidence, Judgement, Recommendation, judge_fits, recommend, scaled_candidates
from .solver import Fit, cache_budget, max_batch, max_context, max_sessions, weight_bytes

COMMAND = ("python", "-m", "cachelib", "plan")


def gb_to_bytes(name: str, value: float | None) -> int | None:
    """``value`` GB (10^9 bytes) as bytes; None stays None; a negative value is refused by ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"--{name} must be a finite number of GB, got {value!r}")
    if value < 0:
        raise ValueError(f"--{name} must be >= 0, got {value}")
    return round(value * GB)


def _check_number(name: str, value, *, integer: bool, lo: float, hi: float | None = None, optional: bool = False) -> None:
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


@dataclass(frozen=True)
class PlanRequest:
    """What to plan: strategies against one workload (batch x context, the prompt and how it is
    fed) and, optionally, a memory budget and the quality thresholds of a recommendation. The
    model is not part of it: the planner is handed an :class:`~cachelib.plan.Arch`.

    Strategies are parsed here (text or :class:`~cachelib.spec.Spec`); the first is the reference
    the page counts savings against. ValueError names whatever is wrong."""

    strategies: tuple[Spec, ...]
    _: KW_ONLY
    context: int
    batch: int = 1
    backend: str = "mlx"
    dtype: str = "float16"
    prefill: int | None = None  # prompt tokens (default: the whole context); the rest is decoded
    prefill_chunk: int | None = None  # feed the prompt in chunks of this many tokens (default: one update)
    budget_bytes: int | None = None  # weights + reserve + cache
    weights_bytes: int | None = None  # as measured; None: counted from the parameters at weight_bits
    weight_bits: float = 16
    reserve_bytes: int = 0  # kept free for activations and the runtime
    max_kl: float | None = None  # recommend the cheapest strategy with mean KL at most this (nats)
    min_agreement: float | None = None  # ... and/or top-1 agreement at least this (0..1)

    def __post_init__(self) -> None:
        specs = tuple(parse_spec(s) for s in self.strategies)
        if not specs:
            raise ValueError("give at least one strategy spec")
        object.__setattr__(self, "strategies", specs)  # frozen: set once, canonical
        for flag, value in (("context", self.context), ("batch", self.batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"--{flag} must be a positive integer, got {value!r}")
        # Every number the request holds is finite and in range (the page and the API, not only the CLI).
        _check_number("--prefill", self.prefill, integer=True, lo=0, optional=True)
        _check_number("--prefill-chunk", self.prefill_chunk, integer=True, lo=1, optional=True)
        for name, value in (("budget_bytes", self.budget_bytes), ("weights_bytes", self.weights_bytes)):
            _check_number(name, value, integer=True, lo=0, optional=True)
        _check_number("reserve_bytes", self.reserve_bytes, integer=True, lo=0)
        _check_number("--weight-bits", self.weight_bits, integer=False, lo=1e-9, hi=64)
        _check_number("--max-kl", self.max_kl, integer=False, lo=0, optional=True)
        _check_number("--min-agreement", self.min_agreement, integer=False, lo=0, hi=1, optional=True)

    @property
    def recommending(self) -> bool:
        return self.max_kl is not None or self.min_agreement is not None

    def weights(self, arch: Arch) -> int | None:
        """Weight bytes: as given, else ``arch``'s parameters x ``weight_bits``; None when neither is known."""
        if self.weights_bytes is not None:
            return self.weights_bytes
        return None if arch.num_params is None else weight_bytes(arch, self.weight_bits)

    def cache_budget(self, arch: Arch) -> int | None:
        """Bytes the budget leaves for ``arch``'s cache (budget - weights - reserve); None without a budget."""
        if self.budget_bytes is None:
            return None
        weights = self.weights(arch)
        if weights is None:
            raise ValueError(f"{arch.name} has no parameter count; give --weights-gb to plan against --budget-gb")
        return cache_budget(self.budget_bytes, weights, self.reserve_bytes)

    def to_argv(self, model: str, evidence: Sequence[str] = (), *, default_evidence: bool = True) -> list[str]:
        """The ``python -m cachelib plan`` command line that prints the same plan for ``model`` (a
        preset name or a config.json path), with an ``--evidence`` for each path beyond the
        committed evidence (left out with ``default_evidence=False``). GB are written so that
        they read back as exactly these bytes."""
        args = [*COMMAND, "--model", model, "--context", str(self.context)]
        if self.batch != 1:
            args += ["--batch", str(self.batch)]
        for spec in self.strategies:
            args += ["--strategy", str(spec)]
        args += ["--backend", self.backend, "--dtype", self.dtype]
        for flag, value in (("--prefill", self.prefill), ("--prefill-chunk", self.prefill_chunk)):
            if value is not None:
                args += [flag, str(value)]
        if self.budget_bytes is not None:
            args += ["--budget-gb", _number(self.budget_bytes / GB)]
        if self.weights_bytes is not None:
            args += ["--weights-gb", _number(self.weights_bytes / GB)]
        elif self.weight_bits != 16:
            args += ["--weight-bits", _number(self.weight_bits)]
        if self.reserve_bytes:
            args += ["--reserve-gb", _number(self.reserve_bytes / GB)]
        if not default_evidence:
            args += ["--no-default-evidence"]
        for path in evidence:
            args += ["--evidence", str(path)]
        if self.max_kl is not None:
            args += ["--max-kl", _number(self.max_kl)]
        if self.min_agreement is not None:
            args += ["--min-agreement", _number(self.min_agreement)]
        return args


def _number(value: float) -> str:
    """The shortest text that reads back as exactly ``value``."""
    short = f"{value:g}"
    return short if float(short) == value else repr(float(value))


def plan(arch: Arch, request: PlanRequest) -> list[Fit]:
    """Each of the request's strategies: its cache for ``batch`` x ``context`` and, with a
    budget, what fits (see :mod:`cachelib.plan.solver`)."""
    weights = request.weights(arch)
    available = request.cache_budget(arch)
    r = request
    common = dict(backend=r.backend, dtype=r.dtype, prefill=r.prefill, prefill_chunk=r.prefill_chunk)
    out = []
    for spec in r.strategies:
        acc = account(arch, spec, r.backend, context=r.context, prefill=r.prefill, prefill_chunk=r.prefill_chunk,
                      batch=r.batch, dtype=r.dtype)  # fmt: skip
        limit, why, most, sessions = None, "", None, None
        if available is not None:
            limit, why = max_context(arch, spec, available, batch=r.batch, **common)
            most = max_batch(arch, spec, available, context=r.context, **common)
            sessions = max_sessions(arch, spec, available, context=r.context, **common)
        out.append(Fit(str(spec), acc, weights, r.reserve_bytes, r.budget_bytes, limit, why, most, sessions))
    return out


@dataclass(frozen=True)
class PlanResult:
    arch: Arch
    request: PlanRequest
    fits: list[Fit]  # the strategies asked for, then the candidates the evidence speaks for
    weights_bytes: int | None
    added: tuple[str, ...] = ()  # planned because the evidence measured them (or their kept fraction)
    skipped: dict[str, str] = field(default_factory=dict)  # measured, not plannable here -> why
    recommendation: Recommendation | None = None  # with a threshold only
    judgements: dict[str, Judgement] = field(default_factory=dict)  # spec -> what the evidence says of it

    @property
    def cache_budget(self) -> int | None:
        """Bytes the budget leaves for the cache (budget - weights - reserve); None without a budget."""
        return self.request.cache_budget(self.arch)

    @property
    def measured_on(self) -> list[str]:
        """The models the attached quality was measured on (lossless strategies need none)."""
        return sorted({f.quality.model for f in self.fits if f.quality is not None and f.quality.samples})


def plan_request(arch: Arch, request: PlanRequest, evidence: Sequence[Evidence] = ()) -> PlanResult:
    """Plan ``request`` for ``arch`` and judge each fit by ``evidence`` (see
    :func:`cachelib.plan.quality.judge`). When the request has a threshold, the strategies the
    evidence measured are candidates too, and so is each measured bounded strategy scaled to the
    target context at its measured kept fraction; each is planned on its own, so that one this
    model or backend refuses is listed in ``skipped``, not fatal. The cheapest covered fit that
    meets the thresholds is recommended."""
    fits = plan(arch, request)
    added: list[str] = []
    skipped: dict[str, str] = {}
    if request.recommending:
        asked = {s.key for s in request.strategies}
        measured = [parse_spec(e.spec) for e in evidence]
        for spec in measured + scaled_candidates(evidence, request.context):
            if spec.key in asked:
                continue
            asked.add(spec.key)
            try:
                fits += plan(arch, replace(request, strategies=(spec,)))
            except ValueError as e:  # e.g. measured on torch only, or a group size these heads refuse
                skipped[str(spec)] = str(e)
            else:
                added.append(str(spec))
    fits, judgements = judge_fits(fits, evidence, backend=request.backend, planned=arch)
    rec = None
    if request.recommending:
        rec = recommend(fits, max_kl=request.max_kl, min_agreement=request.min_agreement, planned_model=arch,
                        judgements=judgements)  # fmt: skip
    return PlanResult(arch, request, fits, request.weights(arch), tuple(added), skipped, rec, judgements)
