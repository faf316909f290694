"""The quality price of each strategy, measured on real runs, and a recommendation.

:func:`measured_quality` reads the complete profiles under a folder (``profiles/`` and sweep
folders inside it) and, per strategy spec, averages what they measured against their baseline:
mean KL over decode steps and top-1 agreement. Every figure says the model and backend it was
measured on and which files it comes from; it may well differ from the model being planned,
and the text says so.

:func:`recommend` picks, among the planned strategies that have such evidence and meet the
user's thresholds, the cheapest one (smallest cache peak at the planned context; among equals,
the most concurrent sessions), and explains the choice in one paragraph.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import pandas as pd

from ..spec import parse_spec
from .solver import Fit, Quality, attach_quality, human_bytes


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

    def quality(self) -> Quality:
        where = f"{self.runs} run(s), {self.steps} steps, {self.backend}: " + ", ".join(self.files)
        return Quality(self.mean_kl, self.top1_agreement, self.model, where)


def _profile_paths(source: str | os.PathLike) -> list[Path]:
    root = Path(source)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise ValueError(f"no profiles at {str(root)!r} (give a folder of profile CSVs or one profile file)")
    return sorted(p for p in root.rglob("*.csv") if p.name != "index.csv" and not p.name.startswith("."))


def collect_evidence(source: str | os.PathLike = "profiles", model: str | None = None) -> list[Evidence]:
    """Per (model, backend, spec): quality measured by the complete profiles under ``source``
    (strategies other than each profile's baseline). Files that are not profiles are skipped."""
    from ..profile import load_profile

    groups: dict[tuple[str, str, str], list[tuple[str, pd.DataFrame]]] = {}
    for path in _profile_paths(source):
        try:
            profile = load_profile(path)
        except ValueError:
            continue
        if not profile.complete or (model is not None and profile.meta.get("model") != model):
            continue
        steps = profile.frame("steps")
        decode = steps[steps["phase"] == "decode"]
        for label in profile.strategies[1:]:
            rows = decode[decode["strategy"] == label]
            if rows["kl"].notna().sum() == 0:
                continue
            spec = str(parse_spec(label.split("#")[0]))
            key = (str(profile.meta.get("model")), str(profile.meta.get("backend")), spec)
            groups.setdefault(key, []).append((path.name, rows))
    out = []
    for (model_name, backend, spec), parts in sorted(groups.items()):
        frames = pd.concat([rows for _, rows in parts], ignore_index=True)
        out.append(
            Evidence(
                spec=spec,
                model=model_name,
                backend=backend,
                runs=len(parts),
                steps=len(frames),
                mean_kl=float(frames["kl"].mean()),
                top1_agreement=float(frames["top1_agree"].astype("Float64").mean()),
                files=tuple(sorted({name for name, _ in parts})),
            )
        )
    return out


def measured_quality(source: str | os.PathLike = "profiles", model: str | None = None) -> dict[str, Quality]:
    """Spec -> :class:`Quality` from the profiles under ``source``. Where several models (or
    backends) measured the same spec, the one with the most steps is kept."""
    best: dict[str, Evidence] = {}
    for ev in collect_evidence(source, model):
        if ev.spec not in best or ev.steps > best[ev.spec].steps:
            best[ev.spec] = ev
    return {spec: ev.quality() for spec, ev in best.items()}


@dataclass(frozen=True)
class Recommendation:
    fit: Fit | None  # the pick, or None when nothing with evidence meets the thresholds
    text: str
    qualified: tuple[str, ...]  # specs that meet the thresholds (with evidence)
    unmeasured: tuple[str, ...]  # planned specs with no measured quality


def recommend(
    fits: Iterable[Fit],
    *,
    max_kl: float | None = None,
    min_agreement: float | None = None,
    planned_model: str | None = None,
) -> Recommendation:
    """The cheapest fit whose measured quality meets ``max_kl`` / ``min_agreement``."""
    if max_kl is None and min_agreement is None:
        raise ValueError("give a quality threshold: max_kl (mean KL, nats) and/or min_agreement (0..1)")
    if max_kl is not None and max_kl < 0:
        raise ValueError(f"max_kl must be >= 0, got {max_kl}")
    if min_agreement is not None and not 0 <= min_agreement <= 1:
        raise ValueError(f"min_agreement must be between 0 and 1, got {min_agreement}")
    fits = list(fits)
    unmeasured = tuple(f.spec for f in fits if f.quality is None)
    ok = [
        f
        for f in fits
        if f.quality is not None
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
    if not ok:
        text = f"No planned strategy with measured quality meets {wanted}"
        text += f" and fits the budget." if any(f.fits is False for f in fits) else "."
        if unmeasured:
            text += f" Not measured yet: {', '.join(unmeasured)} (profile them to get evidence)."
        return Recommendation(None, text, (), unmeasured)
    ok.sort(key=lambda f: (f.cache.peak_bytes, -(f.sessions or 0)))
    pick = ok[0]
    q = pick.quality
    text = (
        f"{pick.spec}: the smallest cache peak ({human_bytes(pick.cache.peak_bytes)} at {pick.cache.context:,} tokens) "
        f"among the {len(ok)} strategies that meet {wanted}. Evidence: mean KL {q.mean_kl:.4g} nats, top-1 "
        f"agreement {q.top1_agreement:.1%}, measured on {q.model} ({q.source})."
    )
    if planned_model and planned_model != q.model:
        text += f" Measured on {q.model}, not on {planned_model}: treat it as an estimate for {planned_model}."
    if pick.sessions is not None:
        text += f" {pick.sessions} concurrent session(s) fit the budget."
    return Recommendation(pick, text, tuple(f.spec for f in ok), unmeasured)


def with_quality(fits: Iterable[Fit], source: str | os.PathLike = "profiles", model: str | None = None) -> list[Fit]:
    """``fits`` with the measured quality of their specs attached (see :func:`measured_quality`)."""
    return attach_quality(fits, measured_quality(source, model))
