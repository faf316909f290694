"""The data behind every figure of a profile, derived once for the app and the HTML report.

The app's charts (``app/charts.py``) and the report (:mod:`cachelib.profile.report`) both draw
cache memory, quality against the baseline and decode speed; both read the series here, so a
strategy has the same points, name and colour on the page and in the report. No plotly: each
caller draws with its own layout.

The tables in are a profile's steps table (``profiles/README.md``), or several profiles' tables
relabelled "profile / strategy" (:func:`strategy_labels`, :func:`relabel`) so they share the
figures. Byte values stay in bytes here (the drawing divides by ``MIB`` for the axis).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import pandas as pd

from .palette import PALETTE, strategy_colors
from .store import Profile
from .summary import full_cache_bytes_per_token

PROCESS_COUNTERS = {"device_active_bytes": "device active memory", "rss_bytes": "process RSS"}
PROCESS_COLORS = {"device_active_bytes": "#444444", "rss_bytes": "#aaaaaa"}
BATCH_COLOR = "#555555"  # one line standing for the strategies of one strategy batch


def floats(s: pd.Series) -> np.ndarray:
    """A nullable column as float64 with NaN for missing values (what plotly draws as gaps)."""
    try:
        return s.to_numpy(dtype="float64", na_value=np.nan)
    except (TypeError, ValueError):  # text or objects: coerce what parses
        return pd.to_numeric(s, errors="coerce").to_numpy(dtype="float64", na_value=np.nan)


def sampling_period(steps: Sequence[float] | np.ndarray) -> int | None:
    """How often a sampled probe recorded, read from the steps it recorded: the most common gap
    between consecutive steps (a probe every k steps also records the last step, one shorter
    gap). None for fewer than two steps."""
    s = np.unique(np.asarray(steps, dtype="float64")[np.isfinite(np.asarray(steps, dtype="float64"))])
    if len(s) < 2:
        return None
    gaps = np.diff(s).astype(np.int64)
    values, counts = np.unique(gaps, return_counts=True)
    best = counts.max()
    return int(values[counts == best].max())


def sampled_note(every: int | None, probe: str) -> str:
    """A title's note, e.g. " · memory recorded every 4 steps" (empty when the probe recorded every step)."""
    return f" · {probe} recorded every {every} steps" if every and every > 1 else ""


def _ordered(frame: pd.DataFrame, strategies: Sequence[str]) -> list[tuple[str, pd.DataFrame]]:
    """(strategy, its rows sorted by step) in run order, skipping strategies with no rows yet."""
    groups = dict(tuple(frame.groupby("strategy", sort=False, observed=True)))
    return [(s, groups[s].sort_values("step")) for s in strategies if s in groups and len(groups[s])]


class Series(NamedTuple):
    """One strategy's line(s) in a figure: its name, colour, the steps drawn and values by kind."""

    strategy: str
    color: str
    step: np.ndarray
    values: dict[str, np.ndarray]


# --- memory --------------------------------------------------------------------------------------


class MemoryInfo(NamedTuple):
    series: list[Series]  # values: "used", "allocated" in bytes, at the steps the memory probe recorded
    references: dict[str, tuple[np.ndarray, np.ndarray]]  # label -> (step, bytes) of a full cache
    every: int | None  # the memory probe's sampling period, read from the recorded steps


def memory_info(
    steps: pd.DataFrame,
    strategies: Sequence[str],
    reference: pd.DataFrame | None = None,
    colors: dict[str, str] | None = None,
) -> MemoryInfo:
    """Cache bytes used and allocated per strategy at the steps the memory probe recorded, and
    the full-cache reference (columns ``step``, ``bytes``, optionally ``label``: one line a label).
    ``colors`` (default: by the order of ``strategies``) keeps a subset in the run's colours."""
    colors = colors or strategy_colors(strategies)
    series = []
    for s, part in _ordered(steps, strategies):
        # A sampled memory probe leaves the other steps empty: keep the recorded ones, so the
        # line joins the samples instead of breaking at every gap.
        used, allocated = floats(part["cache_bytes_used"]), floats(part["cache_bytes_allocated"])
        keep = np.isfinite(used) | np.isfinite(allocated)
        if keep.any():
            step = floats(part["step"])[keep]
            series.append(
                Series(s, colors.get(s, PALETTE[0]), step, {"used": used[keep], "allocated": allocated[keep]})
            )
    refs = {}
    if reference is not None and len(reference):
        labels = reference["label"] if "label" in reference else pd.Series("full cache", index=reference.index)
        for label, part in reference.groupby(labels, sort=False):
            part = part.sort_values("step")
            refs[str(label)] = (floats(part["step"]), floats(part["bytes"]))
    periods = [p for p in (sampling_period(s.step) for s in series) if p is not None]
    return MemoryInfo(series, refs, max(periods) if periods else None)


def full_cache_reference(meta: dict, steps: pd.DataFrame, baseline: str) -> pd.DataFrame | None:
    """Bytes a full cache in the run's dtype holding exactly every token so far would take, per
    step (columns ``step``, ``bytes``, ``label``): the bytes per token of the recorded geometry
    (:func:`~cachelib.profile.summary.full_cache_bytes_per_token`) x tokens. None when the profile
    lacks the geometry (e.g. a recurrent model)."""
    per_token = full_cache_bytes_per_token(meta)
    if per_token is None or not len(steps):
        return None
    rows = steps[steps["strategy"] == baseline]
    if not len(rows):
        rows = steps.drop_duplicates("step")
    rows = rows.sort_values("step")
    tokens = pd.to_numeric(rows["position"], errors="coerce") + 1
    dtype = str(meta.get("dtype", "") or "")
    return pd.DataFrame(
        {
            "step": rows["step"].astype("int64").to_numpy(),
            "bytes": (tokens * per_token).to_numpy(dtype="float64"),
            "label": f"full cache, {dtype}" if dtype else "full cache",
        }
    )


def merge_references(refs: dict[str, pd.DataFrame]) -> pd.DataFrame | None:
    """Several profiles' references (profile name -> :func:`full_cache_reference`) as one line
    per distinct curve, labelled with the profiles it stands for: runs of one model and prompt
    agree on the steps they share, so the longest of them stands for all."""
    groups: list[list] = []  # [profile names, curve (bytes by step), label]
    for name, ref in refs.items():
        curve = ref.set_index("step")["bytes"]
        for group in groups:
            common = curve.index.intersection(group[1].index)
            if len(common) and curve[common].equals(group[1][common]):
                group[0].append(name)
                if len(curve) > len(group[1]):
                    group[1] = curve
                break
        else:
            groups.append([[name], curve, str(ref["label"].iloc[0]) if len(ref) else "full cache"])
    if not groups:
        return None
    return pd.concat(
        [c.rename("bytes").reset_index().assign(label=f"{label} ({', '.join(n)})") for n, c, label in groups],
        ignore_index=True,
    )


# --- quality -------------------------------------------------------------------------------------


class QualityInfo(NamedTuple):
    series: list[Series]  # values: "kl" (nats), "agreement" (running share of agreeing steps, 0..1)


def quality_info(
    steps: pd.DataFrame, strategies: Sequence[str], baselines: Sequence[str], colors: dict[str, str] | None = None
) -> QualityInfo:
    """KL per step and the running share of steps whose top token is the baseline's, for every
    strategy but the baseline(s), at the steps the quality probe recorded."""
    colors = colors or strategy_colors(strategies)
    series = []
    for s, part in _ordered(steps, strategies):
        if s in baselines:
            continue
        part = part[part["kl"].notna() | part["top1_agree"].notna()]
        # the mean of the recorded steps so far (NaN until the first): a sampled probe's gaps skipped
        running = pd.Series(floats(part["top1_agree"].astype("Float64"))).expanding().mean().to_numpy()
        values = {"kl": floats(part["kl"]), "agreement": running}
        series.append(Series(s, colors.get(s, PALETTE[0]), floats(part["step"]), values))
    return QualityInfo(series)


# --- speed ---------------------------------------------------------------------------------------


class ProcessLine(NamedTuple):
    """One process counter of one profile's run, per step."""

    name: str  # "process RSS", or "PROFILE: process RSS" when several profiles are drawn
    counter: str  # a key of PROCESS_COUNTERS
    color: str
    dash: str
    step: np.ndarray
    bytes: np.ndarray


PROCESS_DASHES = ("dot", "dash", "dashdot", "longdash", "longdashdot", "solid")


class SpeedInfo(NamedTuple):
    series: list[Series]  # values: "tokens_per_second" (decode steps only)
    process: list[ProcessLine]  # each run's own process counters: runs' processes are never mixed


def speed_info(steps: pd.DataFrame, strategies: Sequence[str], colors: dict[str, str] | None = None) -> SpeedInfo:
    """Decode tokens/s per strategy at the steps the system probe timed, and the process's
    device-active and RSS bytes per step (one process holds every strategy's caches of a run): one
    line per counter and profile when ``steps`` holds several (a :data:`PROFILE_COLUMN`)."""
    colors = colors or strategy_colors(strategies)
    rate = "tokens_per_second"
    decode = steps[(steps["phase"] == "decode") & steps[rate].notna()]
    series = [
        Series(s, colors.get(s, PALETTE[0]), floats(part["step"]), {rate: floats(part[rate])})
        for s, part in _ordered(decode, strategies)
    ]
    if PROFILE_COLUMN in steps:
        runs = list(steps.groupby(PROFILE_COLUMN, sort=False))
    else:
        runs = [(None, steps)]
    process = []
    for i, (profile, part) in enumerate(runs):
        for col, label in PROCESS_COUNTERS.items():
            if col not in part:
                continue
            per_step = part.groupby("step")[col].max().dropna()
            if len(per_step):
                name = label if profile is None else f"{profile}: {label}"
                dash = PROCESS_DASHES[i % len(PROCESS_DASHES)]
                x = per_step.index.to_numpy(dtype="float64")
                process.append(ProcessLine(name, col, PROCESS_COLORS[col], dash, x, floats(per_step)))
    return SpeedInfo(_batch_lines(series), process)


def _batch_lines(series: list[Series]) -> list[Series]:
    """Strategies that ran as one strategy batch share each step's forward, so their tokens/s are
    the same numbers: one line for them, named for how many, instead of lines drawn on each other."""
    groups: dict[tuple, list[Series]] = {}
    for s in series:
        groups.setdefault((s.step.tobytes(), s.values["tokens_per_second"].tobytes()), []).append(s)
    out = []
    for group in groups.values():
        if len(group) == 1:
            out.append(group[0])
            continue
        name = f"one batch of {len(group)}: " + ", ".join(g.strategy for g in group)
        name = name if len(name) <= 60 else f"one batch of {len(group)} strategies"
        out.append(Series(name, BATCH_COLOR, group[0].step, group[0].values))
    return out


# --- several profiles as one set of tables -------------------------------------------------------


def unique_names(names: Sequence[str]) -> list[str]:
    """``names`` with repeats numbered ("run", "run (2)"), so each profile keeps its own labels."""
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n} ({seen[n]})")
    return out


def strategy_labels(names: Sequence[str], strategies: Sequence[Sequence[str]]) -> list[dict[str, str]]:
    """Per profile, strategy -> its label in the figures: the strategy itself for one profile,
    "profile / strategy" for several (``names`` made unique first, by :func:`unique_names`)."""
    if len(names) == 1:
        return [{s: s for s in strategies[0]}]
    return [{s: f"{name} / {s}" for s in ss} for name, ss in zip(names, strategies)]


PROFILE_COLUMN = "profile"  # added to a combined view's tables: which profile a row came from


def relabel(frame: pd.DataFrame, rename: dict[str, str], profile: str | None = None) -> pd.DataFrame:
    """``frame`` with its ``strategy`` column renamed by ``rename`` (other values kept), and, given
    ``profile``, a :data:`PROFILE_COLUMN` naming the profile its rows came from."""
    if not len(frame):
        return frame
    out = frame.assign(strategy=frame["strategy"].astype("string").map(lambda s: rename.get(s, s)))
    return out if profile is None else out.assign(**{PROFILE_COLUMN: profile})


class FigureTables(NamedTuple):
    """What the three figures read of one or more profiles, as the app's combined view holds it."""

    steps: pd.DataFrame  # every profile's steps, strategies relabelled
    strategies: list[str]  # the order that fixes the colours
    baselines: list[str]
    reference: pd.DataFrame | None
    colors: dict[str, str]


def figure_tables(runs: Sequence[tuple[str, dict, pd.DataFrame]]) -> FigureTables:
    """The figure tables of ``runs`` (name, meta, steps table), each profile's strategies in its
    order, then the next profile's; one profile keeps its strategies' own names."""
    profiles = [Profile(meta) for _, meta, _ in runs]
    names = unique_names([name for name, _, _ in runs])
    renames = strategy_labels(names, [p.strategies for p in profiles])
    refs = {}
    for name, (_, meta, steps), p in zip(names, runs, profiles):
        ref = full_cache_reference(meta, steps, p.baseline)
        if ref is not None:
            refs[name] = ref
    if len(runs) == 1:
        reference = next(iter(refs.values()), None)
    else:
        reference = merge_references(refs)
    several = len(runs) > 1
    frames = [
        relabel(steps, r, name if several else None)
        for name, (_, _, steps), r in zip(names, runs, renames)
        if len(steps)
    ]
    steps = pd.concat(frames, ignore_index=True) if frames else runs[0][2].iloc[0:0]
    strategies = [label for r in renames for label in r.values()]
    baselines = [r.get(p.baseline, p.baseline) for r, p in zip(renames, profiles)]
    return FigureTables(steps, strategies, baselines, reference, strategy_colors(strategies))
