"""The planner's evidence, read from profiles on disk: per (model, backend, strategy), what the
complete profiles under a folder measured against their baseline (mean KL over decode steps,
top-1 agreement), the longest context their runs reached, and which files it comes from.

This is where the planner's quality figures come from files; :mod:`cachelib.plan.quality` works
on the :class:`~cachelib.plan.quality.Evidence` records handed to it and reads nothing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import pandas as pd

from ..plan.quality import Evidence, quality_table
from ..plan.solver import Fit, Quality, attach_quality
from ..spec import parse_spec
from .store import load_profile


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
    groups: dict[tuple[str, str, tuple], list[tuple[str, pd.DataFrame, int]]] = {}
    texts: dict[tuple, str] = {}  # spec key -> the first canonical text seen for it
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
            spec = parse_spec(label.split("#")[0])
            texts.setdefault(spec.key, str(spec))
            reached = int(steps.loc[steps["strategy"] == label, "position"].max()) + 1
            key = (str(profile.meta.get("model")), str(profile.meta.get("backend")), spec.key)
            groups.setdefault(key, []).append((path.name, rows, reached))
    out = []
    for (model_name, backend, spec_key), parts in sorted(groups.items(), key=lambda kv: (kv[0][:2], texts[kv[0][2]])):
        frames = pd.concat([rows for _, rows, _ in parts], ignore_index=True)
        out.append(
            Evidence(
                spec=texts[spec_key],
                model=model_name,
                backend=backend,
                runs=len(parts),
                steps=len(frames),
                mean_kl=float(frames["kl"].mean()),
                top1_agreement=float(frames["top1_agree"].astype("Float64").mean()),
                files=tuple(sorted({name for name, _, _ in parts})),
                context=max(reached for _, _, reached in parts),
            )
        )
    return out


def measured_quality(source: str | os.PathLike = "profiles", model: str | None = None) -> dict[str, Quality]:
    """Spec -> :class:`~cachelib.plan.Quality` from the profiles under ``source``. Where several
    models (or backends) measured the same spec, the one with the most steps is kept."""
    return quality_table(collect_evidence(source, model))


def with_quality(fits: Iterable[Fit], source: str | os.PathLike = "profiles", model: str | None = None) -> list[Fit]:
    """``fits`` with the measured quality of their specs attached (see :func:`measured_quality`)."""
    return attach_quality(fits, measured_quality(source, model))
