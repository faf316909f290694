"""One planning request, as the CLI and the app's Planner page make it: a model, strategies, a
workload and a budget in GB, and optionally measured quality and thresholds; the fits, and a
recommendation.

It knows the steps between what a user types and :func:`~cachelib.plan.solver.plan`: GB to bytes,
the weights counted from the parameters when not given, the checks that name the bad input, and,
when recommending, every strategy the evidence measured planned as a candidate too (one at a
time, so that one this model or backend refuses is listed, not fatal). It does not read profiles
(the caller passes the quality table) and prints nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..spec import Spec, parse_spec
from .arch import Arch
from .quality import Recommendation, recommend
from .solver import GB, Fit, Quality, attach_quality, cache_budget, plan, weight_bytes


def gb_to_bytes(name: str, value: float | None) -> int | None:
    """``value`` GB (10^9 bytes) as bytes; None stays None; a negative value is refused by ``name``."""
    if value is None:
        return None
    if value < 0:
        raise ValueError(f"--{name} must be >= 0, got {value}")
    return round(value * GB)


@dataclass(frozen=True)
class PlanResult:
    arch: Arch
    fits: list[Fit]  # the strategies asked for, then the measured ones added as candidates
    weights_bytes: int | None
    budget_bytes: int | None
    reserve_bytes: int
    workload: dict  # context, batch, backend, dtype, prefill, prefill_chunk
    added: tuple[str, ...] = ()  # planned because the evidence measured them
    skipped: dict[str, str] = field(default_factory=dict)  # measured, not plannable here -> why
    recommendation: Recommendation | None = None  # with a threshold only

    @property
    def cache_budget(self) -> int | None:
        """Bytes the budget leaves for the cache (budget - weights - reserve); None without a budget."""
        if self.budget_bytes is None or self.weights_bytes is None:
            return None
        return cache_budget(self.budget_bytes, self.weights_bytes, self.reserve_bytes)

    @property
    def measured_on(self) -> list[str]:
        """The models the attached quality was measured on (lossless strategies need none)."""
        return sorted({f.quality.model for f in self.fits if f.quality is not None})


def plan_request(
    arch: Arch,
    strategies: Sequence[str | Spec],
    *,
    context: int,
    batch: int = 1,
    backend: str = "mlx",
    dtype: str = "float16",
    prefill: int | None = None,
    prefill_chunk: int | None = None,
    budget_gb: float | None = None,
    weights_gb: float | None = None,
    weight_bits: float = 16,
    reserve_gb: float = 0.0,
    quality: Mapping[str, Quality] | None = None,
    max_kl: float | None = None,
    min_agreement: float | None = None,
) -> PlanResult:
    """Plan ``strategies`` for ``arch``; ValueError names whatever input is wrong."""
    specs = [parse_spec(s) for s in strategies] or [parse_spec("standard")]
    for flag, value in (("context", context), ("batch", batch)):
        if value <= 0:
            raise ValueError(f"--{flag} must be a positive integer, got {value}")
    weights = gb_to_bytes("weights-gb", weights_gb)
    if weights is None and arch.num_params is not None:
        weights = weight_bytes(arch, weight_bits)
    budget = gb_to_bytes("budget-gb", budget_gb)
    if budget is not None and weights is None:
        raise ValueError(f"{arch.name} has no parameter count; give --weights-gb to plan against --budget-gb")
    reserve = gb_to_bytes("reserve-gb", reserve_gb) or 0
    workload = dict(context=context, batch=batch, backend=backend, dtype=dtype, prefill=prefill,
                    prefill_chunk=prefill_chunk)  # fmt: skip
    limits = dict(budget_bytes=budget, weights_bytes=weights, reserve_bytes=reserve)
    fits = plan(arch, specs, **workload, **limits)

    quality = dict(quality or {})
    recommending = max_kl is not None or min_agreement is not None
    added, skipped = [], {}
    if recommending:  # every strategy with evidence is a candidate too
        asked = {s.key for s in specs}
        for text in quality:
            spec = parse_spec(text)
            if spec.key in asked:
                continue
            asked.add(spec.key)
            try:
                fits += plan(arch, [spec], **workload, **limits)
            except ValueError as e:  # e.g. measured on torch only, or a group size these heads refuse
                skipped[str(spec)] = str(e)
            else:
                added.append(str(spec))
    fits = attach_quality(fits, quality)
    rec = recommend(fits, max_kl=max_kl, min_agreement=min_agreement, planned_model=arch) if recommending else None
    return PlanResult(arch, fits, weights, budget, reserve, workload, tuple(added), skipped, rec)
