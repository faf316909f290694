"""The quality price of each strategy, measured on real runs, and a recommendation.

:class:`Evidence` is what profiles measured for one strategy on one model: mean KL over decode
steps and top-1 agreement against the baseline, the longest context reached, and the files it
comes from. :mod:`cachelib.profile.evidence` reads it from profiles on disk; this module reads
nothing and works on the evidence handed to it. Every figure says the model and backend it was
measured on; it may well differ from the model being planned, and the text says so.

:func:`recommend` picks, among the planned strategies that have such evidence and meet the
user's thresholds, the cheapest one (smallest cache peak at the planned context; among equals,
the most concurrent sessions), and explains the choice in one paragraph.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

from ..spec import Spec, parse_spec
from .arch import Arch
from ..core.units import human_bytes
from .solver import Fit, Quality


@dataclass(frozen=True)
class Evidence:
    """Everything measured for one strategy on one model."""

    spec: str
    model: str
    backend: str
    runs: int
    steps: int
    mean_kl: float
    top1_agreement: float
    files: tuple[str, ...]
    context: int = 0  # the longest context (prompt + decoded tokens) any of the runs reached

    def quality(self) -> Quality:
        where = f"{self.runs} run(s), {self.steps} steps, {self.backend}: " + ", ".join(self.files)
        return Quality(self.mean_kl, self.top1_agreement, self.model, where, self.context)


def bound_of(spec: str | Spec) -> int | None:
    """The token bound of an evicting strategy (ring size, window, chunk), else None: quality
    measured before the bound was reached says nothing about eviction."""
    return parse_spec(spec).window


def quality_table(evidence: Iterable[Evidence]) -> dict[str, Quality]:
    """Spec -> :class:`Quality` from collected evidence; where several models (or backends)
    measured the same spec, the one with the most steps is kept."""
    best: dict[tuple, Evidence] = {}
    for ev in evidence:
        key = parse_spec(ev.spec).key
        if key not in best or ev.steps > best[key].steps:
            best[key] = ev
    return {ev.spec: ev.quality() for ev in best.values()}


@dataclass(frozen=True)
class Recommendation:
    fit: Fit | None  # the pick, or None when nothing with evidence meets the thresholds
    text: str
    qualified: tuple[str, ...]  # specs that meet the thresholds (with evidence)
    unmeasured: tuple[str, ...]  # planned specs with no measured quality
    unfilled: tuple[str, ...] = ()  # evicting specs whose runs never filled their bound: not evidence


# strategies that keep every token at full precision: their predictions are the full cache's
EXACT = Quality(0.0, 1.0, "any model", "exact: keeps every token at full precision")  # by construction


def _exact(fit: Fit) -> Fit:
    """A lossless strategy's fit, with its quality known by construction when none was measured."""
    if fit.quality is not None or not parse_spec(fit.spec).lossless:
        return fit
    return replace(fit, quality=EXACT)


def _never_filled(fit: Fit) -> bool:
    """The evidence of an evicting strategy comes from runs that never passed its bound."""
    bound = bound_of(fit.spec)
    return bound is not None and fit.quality is not None and (fit.quality.context or 0) <= bound


def recommend(
    fits: Iterable[Fit],
    *,
    max_kl: float | None = None,
    min_agreement: float | None = None,
    planned_model: str | Arch | None = None,
) -> Recommendation:
    """The cheapest fit whose measured quality meets ``max_kl`` / ``min_agreement``.

    A ring, window or chunk whose runs never went past its bound never evicted anything: its
    measured quality says nothing about eviction, so it is not recommended on that evidence."""
    if max_kl is None and min_agreement is None:
        raise ValueError("give a quality threshold: max_kl (mean KL, nats) and/or min_agreement (0..1)")
    if max_kl is not None and max_kl < 0:
        raise ValueError(f"max_kl must be >= 0, got {max_kl}")
    if min_agreement is not None and not 0 <= min_agreement <= 1:
        raise ValueError(f"min_agreement must be between 0 and 1, got {min_agreement}")
    fits = [_exact(f) for f in fits]
    unmeasured = tuple(f.spec for f in fits if f.quality is None)
    unfilled = tuple(f.spec for f in fits if _never_filled(f))
    ok = [
        f
        for f in fits
        if f.quality is not None
        and not _never_filled(f)
        and (max_kl is None or f.quality.mean_kl <= max_kl)
        and (min_agreement is None or f.quality.top1_agreement >= min_agreement)
        and f.fits is not False
    ]
    wanted = " and ".join(
        t
        for t in (
            f"mean KL <= {max_kl:g} nats" if max_kl is not None else "",
            f"top-1 agreement >= {min_agreement:.0%}" if min_agreement is not None else "",
        )
        if t
    )
    caveats = ""
    if unmeasured:
        caveats += f" Not measured yet: {', '.join(unmeasured)} (profile them to get evidence)."
    if unfilled:
        caveats += (
            f" Measured only on runs shorter than their window, so never evicting: {', '.join(unfilled)} "
            "(profile them past their bound)."
        )
    if not ok:
        text = f"No planned strategy with measured quality meets {wanted}"
        text += " and fits the budget." if any(f.fits is False for f in fits) else "."
        return Recommendation(None, text + caveats, (), unmeasured, unfilled)
    ok.sort(key=lambda f: (f.cache.peak_bytes, -(f.sessions or 0)))
    pick = ok[0]
    q = pick.quality
    context = f" at up to {q.context:,} tokens" if q.context else ""
    evidence = (
        f"mean KL {q.mean_kl:.4g} nats, top-1 agreement {q.top1_agreement:.1%}, measured on {q.model}{context} "
        f"({q.source})"
        if q is not EXACT
        else q.source
    )
    text = (
        f"{pick.spec}: the smallest cache peak ({human_bytes(pick.cache.peak_bytes)} at {pick.cache.context:,} tokens) "
        f"among the {len(ok)} strategies that meet {wanted}. Evidence: {evidence}."
    )
    names = planned_model.names if isinstance(planned_model, Arch) else {planned_model} if planned_model else set()
    if names and q is not EXACT and q.model not in names:
        shown = planned_model.name if isinstance(planned_model, Arch) else planned_model
        text += f" Measured on {q.model}, not on {shown}: treat it as an estimate for {shown}."
    if q.context and pick.cache.context > q.context and bound_of(pick.spec) is not None:
        text += (
            f" It evicts more at {pick.cache.context:,} tokens than in the runs measured ({q.context:,} tokens): "
            "the quality there may be worse; profile it at that length to be sure."
        )
    if pick.sessions is not None:
        text += f" {pick.sessions} concurrent session(s) fit the budget."
    return Recommendation(pick, text + caveats, tuple(f.spec for f in ok), unmeasured, unfilled)
