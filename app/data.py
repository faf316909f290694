"""The numbers the pages show, shaped from profiles: no Streamlit, no disk.

:class:`RunView` is what every chart and table of the app reads: the tables of one profile (or
of several, relabelled "profile / strategy" so they share the charts), the strategy order (which
fixes the colours), the baseline(s) and the per-strategy summary in plain words.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator, Sequence

import pandas as pd

from cachelib.profile import Profile, summarize, verdict
from cachelib.profile.figure_data import full_cache_reference, merge_references, relabel, strategy_labels, unique_names

TABLES = ("steps", "layers", "slots", "masks")
LARGE_BYTES = 50 * 2**20  # a profile file this big reads its per-layer table only when asked to


class LazyTables(Mapping):
    """A view's four tables, each read on first use by ``load(table)``: a large profile's
    layers, slots and masks wait until a figure needs them. ``loaded`` starts it off."""

    def __init__(self, load: Callable[[str], pd.DataFrame], loaded: dict[str, pd.DataFrame] | None = None):
        self.load = load
        self.loaded = dict(loaded or {})

    def __getitem__(self, table: str) -> pd.DataFrame:
        if table not in TABLES:
            raise KeyError(table)
        if table not in self.loaded:
            self.loaded[table] = self.load(table)
        return self.loaded[table]

    def __iter__(self) -> Iterator[str]:
        return iter(TABLES)

    def __len__(self) -> int:
        return len(TABLES)


@dataclass
class RunView:
    """One run (or several runs side by side), ready to draw."""

    name: str
    meta: dict
    strategies: list[str]
    baselines: list[str]
    status: str
    reason: str
    tables: Mapping[str, pd.DataFrame]  # a dict, or LazyTables that read each on first use
    summary: pd.DataFrame = field(default_factory=pd.DataFrame)
    reference: pd.DataFrame | None = None  # full-cache bytes per step: columns step, bytes, label
    memo: dict = field(default_factory=dict, repr=False, compare=False)  # figures drawn from this view
    size_bytes: int | None = None  # the profile file's size (None: not from a file)

    def figure(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """``build()`` once per view and key: a rerun that changes nothing rebuilds nothing."""
        if key not in self.memo:
            self.memo[key] = build()
        return self.memo[key]

    @property
    def steps(self) -> pd.DataFrame:
        return self.tables["steps"]

    @property
    def layers(self) -> pd.DataFrame:
        return self.tables["layers"]

    @property
    def slots(self) -> pd.DataFrame:
        return self.tables["slots"]

    @property
    def masks(self) -> pd.DataFrame:
        return self.tables["masks"]

    @property
    def complete(self) -> bool:
        return self.status == "complete"

    @property
    def large(self) -> bool:
        """Whether the file is big enough that its tables are read only when a figure asks."""
        return (self.size_bytes or 0) >= LARGE_BYTES

    def loaded(self, table: str) -> bool:
        """Whether ``table`` is in memory (reading it costs nothing more)."""
        return not isinstance(self.tables, LazyTables) or table in self.tables.loaded

    def steps_recorded(self, strategy: str, table: str = "steps") -> list[int]:
        frame = self.tables[table]
        return sorted(int(s) for s in frame.loc[frame["strategy"] == strategy, "step"].unique())


def run_view(
    profile: Profile,
    name: str | None = None,
    tables: Mapping[str, pd.DataFrame] | None = None,
    size_bytes: int | None = None,
) -> RunView:
    """The view of one profile. ``tables`` overrides the profile's frames (a live snapshot, or
    :class:`LazyTables` of a file); only the steps table is read here."""
    tables = tables if tables is not None else {t: profile.frame(t) for t in TABLES}
    summary = summary_table(profile, tables["steps"])
    ref = full_cache_reference(profile.meta, tables["steps"], profile.baseline)
    return RunView(
        name=name or profile.name or str(profile.meta.get("run_id", "run")),
        meta=dict(profile.meta),
        strategies=profile.strategies,
        baselines=[profile.baseline],
        status=profile.status,
        reason=str(profile.meta.get("reason", "")),
        tables=tables,
        summary=summary,
        reference=ref,
        size_bytes=size_bytes,
    )


SUMMARY_DISPLAY = {
    "strategy": "strategy",
    "steps": "steps",
    "peak_mib": "peak MiB allocated",
    "used_mib": "MiB used",
    "tokens_held": "tokens held",
    "bytes_per_token": "bytes/token held",
    "memory_saved": "saved vs full cache",
    "mean_kl": "mean KL (nats)",
    "top1_agreement": "top-1 agreement",
    "decode_tokens_per_second": "tokens/s",
}
SUMMARY_COLUMNS = [*SUMMARY_DISPLAY, "saved_against", "tokens", "memory_step", "verdict"]


def summary_table(profile: Profile, steps: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per strategy: peak bytes allocated, bytes used, tokens held and bytes per token held at
    the last memory sample, memory saved against the full cache in the run's dtype at that step
    (:mod:`cachelib.profile.summary` defines both), mean KL, agreement, tokens/s, and the verdict
    ("saved 62% memory vs a float32 full cache at 104 tokens, for 0.013 nats mean KL ...")."""
    table = summarize(profile, steps)
    if not len(table):
        return pd.DataFrame(columns=SUMMARY_COLUMNS)

    def num(col: str) -> pd.Series:
        return pd.to_numeric(table[col], errors="coerce")

    out = pd.DataFrame(
        {
            "strategy": table["strategy"],
            "steps": table["steps"],
            "peak_mib": num("peak_bytes_allocated") / 2**20,
            "used_mib": num("bytes_used") / 2**20,
            "tokens_held": num("tokens_held"),
            "bytes_per_token": num("bytes_per_token"),
            "memory_saved": num("memory_saved"),
            "mean_kl": num("mean_kl"),
            "top1_agreement": num("top1_agreement"),
            "decode_tokens_per_second": num("decode_tokens_per_second"),
            "saved_against": table["saved_against"],
            "tokens": num("tokens"),
            "memory_step": num("memory_step"),
            "verdict": [verdict(r, profile.baseline) for _, r in table.iterrows()],
        }
    )
    return out.reset_index(drop=True)


def measured_on(summary: pd.DataFrame) -> str:
    """What the summary's memory numbers were measured against, in one sentence."""
    against = sorted({str(a) for a in summary.get("saved_against", pd.Series(dtype=object)).dropna() if a})
    if not against:
        return (
            "MiB used, tokens held and bytes/token held: at each strategy's last memory sample; "
            "allocated MiB is the peak."
        )
    what = " / ".join(
        "the baseline's bytes used (the profile lacks the cache geometry)"
        if a == "baseline"
        else f"a {a} holding every token so far in every layer"
        for a in against
    )
    return (
        "MiB used, tokens held and bytes/token held (bytes used / tokens held) are read at each strategy's last "
        f"memory sample; saved = 1 - bytes used / the bytes used at that step by {what}. "
        "Peak MiB allocated includes reserved, unfilled space."
    )


def combine(views: Sequence[RunView]) -> RunView:
    """Several runs as one view: every strategy relabelled "run name / strategy"."""
    if len(views) == 1:
        return views[0]
    names = unique_names([v.name for v in views])
    renames = strategy_labels(names, [v.strategies for v in views])
    strategies, baselines, summaries, references = [], [], [], {}

    def relabelled(table: str) -> pd.DataFrame:
        """``table`` of every run, read when a figure asks for it (as each run's own)."""
        parts = []
        for name, rename, v in zip(names, renames, views):
            frame = v.tables[table]
            if len(frame):
                parts.append(relabel(frame, rename, name))
        return _concat(parts, views[0].tables[table])

    for name, v, rename in zip(names, views, renames):
        strategies += list(rename.values())
        baselines += [rename.get(b, f"{name} / {b}") for b in v.baselines]
        if len(v.summary):
            summaries.append(v.summary.assign(strategy=v.summary["strategy"].map(lambda s, r=rename: r.get(s, s))))
        if v.reference is not None:
            references[name] = v.reference
    status = "complete" if all(v.complete for v in views) else "incomplete"
    reasons = [f"{n}: {v.reason or v.status}" for n, v in zip(names, views) if not v.complete]
    return RunView(
        name=" + ".join(names),
        meta={},
        strategies=strategies,
        baselines=baselines,
        status=status,
        reason="; ".join(reasons),
        tables=LazyTables(relabelled),
        summary=pd.concat(summaries, ignore_index=True) if summaries else pd.DataFrame(columns=SUMMARY_COLUMNS),
        reference=merge_references(references),
        size_bytes=sum(v.size_bytes or 0 for v in views) or None,
    )


def _concat(parts: list[pd.DataFrame], like: pd.DataFrame) -> pd.DataFrame:
    return pd.concat(parts, ignore_index=True) if parts else like.iloc[0:0]


def nearest_at_or_before(recorded: Sequence[int], step: int) -> int | None:
    """The last recorded step <= ``step`` (sampled probes), else the first recorded one."""
    before = [s for s in recorded if s <= step]
    if before:
        return before[-1]
    return recorded[0] if recorded else None


def probes_of(meta: dict) -> dict[str, int]:
    try:
        return json.loads(meta.get("probes") or "{}")
    except (TypeError, ValueError):
        return {}
