"""Figures and tables of the Planner page: the planner's results in, plotly figures and DataFrames out.

What it knows: :class:`cachelib.plan.Fit` (one strategy against one workload and budget) and the
curves :mod:`cachelib.plan.curves` samples over a range of contexts (each point what
``python -m cachelib plan`` prints for that context). What it does not know: Streamlit, files, or
any byte rule (those live in :mod:`cachelib.plan`). Figures are built as in :mod:`app.charts`:
``_*_info(data) -> NamedTuple`` picks the numbers (what the tests pin), ``_*_plot(info)`` draws.

Bytes are shown in binary units (GiB = 2^30 bytes), the unit of the budget and of the CLI.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from cachelib.core.units import (
    GiB,  # the planner counts device memory in GiB
    human_gib,
)
from cachelib.plan import Fit
from cachelib.plan.quality import Evidence
from cachelib.spec import parse_spec

from .figures import empty_figure, strategy_colors

BUDGET_COLOR = "#7f7f7f"
WORKLOAD_COLOR = "#000000"  # the outline of a white star: no strategy colour is white
FRONTIER_MEASURES = {
    "max_batch": "max batch (one run of B sequences)",
    "sessions": "concurrent sessions (batch 1 each)",
}
LIMITS = {  # Fit.context_limit -> what the table says
    "memory": "memory",
    "model": "model length",  # max_position_embeddings: memory would allow more
    "max_len": "max_len",  # a static cache's preallocated length
    "unbounded": "nothing",  # the cache stops growing and fits
    "": "",
}


PLOT_HEIGHT = 330  # px of plotting area a chart keeps, whatever its legend holds


def legend_beside(entries: int) -> dict:
    """Layout keys that put the legend beside the plot, top-aligned: a legend taller than the
    plot scrolls inside its box (plotly.js does so for vertical legends), so the plotting area
    keeps :data:`PLOT_HEIGHT` px at any number of strategies (``entries`` is what it holds)."""
    return {
        "legend": {
            "orientation": "v",
            "x": 1.02,
            "xanchor": "left",
            "y": 1,
            "yanchor": "top",
            "font": {"size": 11 if entries > 8 else 12},
        },
        "height": 100 + PLOT_HEIGHT + 70,  # title and subtitle + plot + axis title
        "margin": {"t": 100, "b": 70},
    }


# --- memory vs context -----------------------------------------------------------------------------


class _Curve(NamedTuple):
    strategy: str
    color: str
    context: np.ndarray
    values: dict[str, np.ndarray]


class PlanMemoryInfo(NamedTuple):
    curves: list[_Curve]  # values: "allocated", "peak" in bytes
    cache_budget: int | None  # bytes left for the cache (budget - weights - reserve)
    context: int | None  # the asked context
    max_context: dict[str, int]  # strategy -> longest context that fits, where memory binds


def _curves(frame: pd.DataFrame, strategies: Sequence[str], columns: dict[str, str]) -> list[_Curve]:
    colors = strategy_colors(strategies)
    groups = dict(tuple(frame.groupby("strategy", sort=False)))
    out = []
    for s in strategies:
        part = groups.get(s)
        if part is None or not len(part):
            continue
        part = part.sort_values("context")
        values = {name: part[col].to_numpy(dtype="float64") for name, col in columns.items()}
        out.append(_Curve(s, colors[s], part["context"].to_numpy(dtype="int64"), values))
    return out


def _plan_memory_info(
    curves: pd.DataFrame,
    strategies: Sequence[str],
    cache_budget: int | None,
    context: int | None,
    fits: Sequence[Fit],
) -> PlanMemoryInfo:
    drawn = _curves(curves, strategies, {"allocated": "bytes_allocated", "peak": "peak_bytes"})
    end = max((c.context.max() for c in drawn), default=0)
    limits = {
        f.spec: f.max_context
        for f in fits
        if f.context_limit == "memory" and f.max_context is not None and f.max_context <= end
    }
    return PlanMemoryInfo(drawn, cache_budget, context, limits)


def _plan_memory_plot(info: PlanMemoryInfo, log: bool) -> go.Figure:
    fig = go.Figure()
    for c in info.curves:
        for kind, dash, width in (("allocated", "solid", 2), ("peak", "dot", 1.5)):
            y = c.values[kind]
            fig.add_trace(
                go.Scatter(
                    x=c.context,
                    y=y / GiB,
                    name=c.strategy,
                    legendgroup=c.strategy,
                    showlegend=kind == "allocated",
                    mode="lines",
                    line={"color": c.color, "dash": dash, "width": width},
                    customdata=y,
                    meta=kind,
                    hovertemplate=f"{c.strategy}<br>context %{{x:,}}<br>{kind} %{{customdata:,.0f}} B<extra></extra>",
                )
            )
    if info.cache_budget is not None:
        budget = info.cache_budget
        fig.add_hline(
            y=budget / GiB,
            line={"color": BUDGET_COLOR, "dash": "dash", "width": 2},
            annotation_text=f"left for cache + activations {human_gib(budget)}",
            annotation_position="top left",
        )
        if info.max_context:
            colors = {c.strategy: c.color for c in info.curves}
            names = list(info.max_context)
            fig.add_trace(
                go.Scatter(
                    x=[info.max_context[s] for s in names],
                    y=[budget / GiB] * len(names),
                    mode="markers",
                    name="max context in the budget",
                    customdata=names,
                    marker={"symbol": "x", "size": 11, "color": [colors[s] for s in names], "line": {"width": 1}},
                    hovertemplate="%{customdata}<br>max context %{x:,} tokens<extra></extra>",
                )
            )
    if info.context is not None:
        fig.add_vline(
            x=info.context,
            line={"color": WORKLOAD_COLOR, "dash": "dot", "width": 1},
            annotation_text=f"context {info.context:,}",
            annotation_position="top right",
        )
    fig.update_layout(
        title={
            "text": "Cache memory vs context",
            "subtitle": {"text": "solid: allocated at the end of the run · dotted: peak during it"},
        },
        xaxis={"title": "context (tokens)", "type": "log" if log else "linear"},
        yaxis={"title": "GiB (2^30 bytes)", "type": "log" if log else "linear", "rangemode": "tozero"},
        **legend_beside(len(info.curves) + 1),
    )
    return fig


def plan_memory_figure(
    curves: pd.DataFrame,
    strategies: Sequence[str],
    *,
    cache_budget: int | None = None,
    context: int | None = None,
    fits: Sequence[Fit] = (),
    log: bool = False,
) -> go.Figure:
    """Bytes allocated and peak bytes per strategy vs context (``curves`` from
    :func:`cachelib.plan.memory_curves`), the cache budget as a horizontal line, the asked context as a
    vertical one, and an x where each strategy's ``fits`` say memory stops it. ``log``: both
    axes logarithmic."""
    if not len(curves):
        return empty_figure("Cache memory vs context", "no strategy to plan", height=300)
    return _plan_memory_plot(_plan_memory_info(curves, strategies, cache_budget, context, fits), log)


# --- the fit frontier ------------------------------------------------------------------------------


class FrontierInfo(NamedTuple):
    curves: list[_Curve]  # values: "count" (max batch or sessions), NaN where the run is refused
    measure: str  # "max_batch" | "sessions"
    workload: tuple[int, int] | None  # (context, batch or sessions) asked


def _frontier_info(
    frontier: pd.DataFrame, strategies: Sequence[str], measure: str, workload: tuple[int, int] | None
) -> FrontierInfo:
    if measure not in FRONTIER_MEASURES:
        raise ValueError(f"measure must be one of {', '.join(FRONTIER_MEASURES)}, got {measure!r}")
    return FrontierInfo(_curves(frontier, strategies, {"count": measure}), measure, workload)


def _frontier_plot(info: FrontierInfo, log: bool) -> go.Figure:
    fig = go.Figure()
    what = FRONTIER_MEASURES[info.measure].split(" (")[0]
    top = max(
        [np.nanmax(c.values["count"], initial=1) for c in info.curves] + [info.workload[1] if info.workload else 1]
    )
    ticks = [m * 10**e for e in range(len(str(int(top))) + 1) for m in (1, 2, 5) if m * 10**e <= 10 * top]
    for c in info.curves:
        fig.add_trace(
            go.Scatter(
                x=c.context,
                y=c.values["count"],
                name=c.strategy,
                mode="lines",
                line_shape="vh",
                line={"color": c.color, "width": 2},
                hovertemplate=f"{c.strategy}<br>context %{{x:,}}<br>{what} %{{y:,}}<extra></extra>",
            )
        )
    if info.workload is not None:
        x, y = info.workload
        label = "your workload" if info.measure == "max_batch" else "one session"
        fig.add_trace(
            go.Scatter(
                x=[x],
                y=[y],
                mode="markers",
                name=f"{label} ({y} x {x:,} tokens)",
                marker={"symbol": "star", "size": 16, "color": "white", "line": {"color": WORKLOAD_COLOR, "width": 2}},
                hovertemplate=f"{label}<br>context %{{x:,}}<br>{what} %{{y}}<extra></extra>",
            )
        )
    fig.update_layout(
        title={
            "text": f"Fit frontier: {what} vs context",
            "subtitle": {"text": "what fits the budget: every point on or below a strategy's line"},
        },
        xaxis={"title": "context (tokens)", "type": "log" if log else "linear"},
        # counts span orders of magnitude over the range: a log axis, labelled 1, 2, 5, 10, 20, ...
        yaxis={"title": f"{what} (log scale)", "type": "log", "tickvals": ticks, "ticktext": [f"{t:,}" for t in ticks]},
        **legend_beside(len(info.curves) + 1),
    )
    return fig


def plan_frontier_figure(
    frontier: pd.DataFrame,
    strategies: Sequence[str],
    *,
    measure: str = "max_batch",
    workload: tuple[int, int] | None = None,
    log: bool = False,
) -> go.Figure:
    """Per strategy, the largest batch (or the most concurrent sessions) whose cache fits the
    budget vs context (``frontier`` from :func:`cachelib.plan.frontier_curves`), drawn as steps that drop at
    the first sampled context where the count falls, so the line never promises more than
    what was computed; ``workload`` (context, count) is marked with a star. The count axis is
    logarithmic (counts span orders of magnitude); ``log`` makes the context axis so too."""
    if not len(frontier):
        return empty_figure("Fit frontier", "give a memory budget to see what fits", height=300)
    return _frontier_plot(_frontier_info(frontier, strategies, measure, workload), log)


# --- tables and words ------------------------------------------------------------------------------

BYTE_COLUMNS = (
    "allocated",
    "all devices",
    "used",
    "peak",
    "per token",
    "host",
    "activations",
    "headroom",
    "budget needed",
)


def plan_table(fits: Sequence[Fit]) -> pd.DataFrame:
    """One row per strategy with the CLI's columns (raw byte counts; :func:`styled_plan_table`
    shows them as the CLI prints them). Budget columns only with a budget, quality columns only
    when some strategy has measured quality, host bytes only when some layer is offloaded."""
    budgeted = any(f.budget_bytes is not None for f in fits)
    measured = any(f.quality is not None for f in fits)
    offloaded = any(f.cache.host_bytes for f in fits)
    spread = any(f.cache.devices > 1 for f in fits)
    rows = []
    for f in fits:
        c = f.cache
        row = {"strategy": f.spec, "allocated": c.bytes_allocated}
        if spread:  # one device's bytes, then the cache over every device of the deployment
            row["all devices"] = c.total_bytes
        row.update({"used": c.bytes_used, "peak": c.peak_bytes, "per token": c.bytes_per_token})
        if offloaded:
            row["host"] = c.host_bytes
        row["activations"] = f.activation_bytes
        if measured:
            q = f.quality
            row.update({"mean KL": q and q.mean_kl, "top-1": q and q.top1_agreement, "measured on": q and q.model})
        if budgeted:
            row.update(
                {
                    "fits": "yes" if f.fits else "NO",
                    "headroom": f.headroom_bytes,
                    "max context": f.max_context,
                    "limited by": LIMITS.get(f.context_limit, f.context_limit),
                    "max batch": f.max_batch,
                    "sessions": f.sessions,
                    "budget needed": f.budget_needed,
                }
            )
        rows.append(row)
    table = pd.DataFrame(rows)
    for col in (
        "allocated",
        "all devices",
        "used",
        "peak",
        "host",
        "activations",
        "headroom",
        "budget needed",
        "max context",
        "max batch",
        "sessions",
    ):
        if col in table:
            table[col] = table[col].astype("Int64")
    for col in ("mean KL", "top-1"):
        if col in table:
            table[col] = table[col].astype("Float64")
    return table


NO_VALUE = "–"
NOT_COVERED = "not covered"  # what the CLI prints too
TEXT_FORMATS: dict[str, Callable] = {
    **{c: human_gib for c in BYTE_COLUMNS},
    **{c: "{:,}".format for c in ("max context", "max batch", "sessions")},
    "mean KL": "{:.4g}".format,
    "top-1": "{:.1%}".format,
}


def plan_table_text(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` as the page shows it: bytes in SI units as the CLI prints them, counts with
    thousands separators, and a dash where there is no value (Streamlit would print "None")."""
    out = pd.DataFrame(index=table.index)
    for col in table.columns:
        fmt = TEXT_FORMATS.get(col, str)
        empty = NOT_COVERED if col == "mean KL" else NO_VALUE  # no quality: the evidence does not cover it
        out[col] = [empty if v is None or v is pd.NA or v != v else fmt(v) for v in table[col].tolist()]
    return out


# What a reader of the plan decides by, shown first (and the strategy pinned) so that the page
# never needs sideways scrolling to reach them; the byte detail follows.
KEY_COLUMNS = ("strategy", "fits", "sessions", "max batch", "max context", "mean KL", "top-1", "peak", "per token")


def page_column_order(table: pd.DataFrame) -> list[str]:
    """The Planner page's column order: :data:`KEY_COLUMNS` present in ``table`` first, then
    every other column in the table's own order (none is dropped)."""
    first = [c for c in KEY_COLUMNS if c in table.columns]
    return first + [c for c in table.columns if c not in first]


def styled_plan_table(table: pd.DataFrame, strategies: Sequence[str]):
    """:func:`plan_table_text` of ``table`` with each strategy in its colour."""
    colors = strategy_colors(strategies)
    return plan_table_text(table).style.map(
        lambda s: f"color: {colors.get(s, '#000')}; font-weight: 600", subset=["strategy"]
    )


def parse_strategies(text: str) -> list[str]:
    """Canonical specs from text with one spec per line (blank lines and ``#`` comments skipped,
    repeats dropped); a bad line raises ValueError naming the line. Empty text is an empty list
    (the page then plans the runtime's standard set)."""
    specs: list[str] = []
    for i, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            spec = str(parse_spec(line))
        except ValueError as e:
            raise ValueError(f"strategy on line {i} ({line!r}): {e}") from None
        if spec not in specs:
            specs.append(spec)
    return specs


EVIDENCE_SHARES = ("kept", "top-1", "± top-1", "retrieval")  # shares of 1: the page shows them as percentages


def evidence_table(evidence: Sequence[Evidence]) -> pd.DataFrame:
    """The measured points, one row per (model, backend, strategy, context), with their 95% CIs."""
    cols = [
        "strategy",
        "model",
        "backend",
        "context",
        "kept",
        "samples",
        "mean KL",
        "± KL",
        "top-1",
        "± top-1",
        "Δppl",
        "retrieval",
        "kind",
        "files",
    ]
    rows = [
        [
            e.spec,
            e.model,
            e.backend,
            e.context,
            e.kept_fraction,
            e.samples,
            e.mean_kl,
            e.mean_kl_ci95,
            e.top1_agreement,
            e.top1_ci95,
            e.delta_ppl,
            e.retrieval,
            e.kind,
            ", ".join(e.files),
        ]
        for e in evidence
    ]
    return pd.DataFrame(rows, columns=cols)


# --- quality against context and kept fraction ----------------------------------------------------


class QualityPoint(NamedTuple):
    family: str  # the strategy apart from its bound, e.g. "rotating keep=4"
    spec: str
    context: int
    kept_fraction: float
    mean_kl: float
    ci95: float | None


class PlanQualityInfo(NamedTuple):
    points: list[QualityPoint]  # measured, on the planned backend (or all, when it has none)
    targets: list[tuple[str, str, float]]  # (family, spec, kept fraction) of each planned strategy at its context
    context: int  # the planned context
    backend: str


def _family_label(spec: str) -> str:
    s = parse_spec(spec)
    knob = s.strategy.window
    rest = [f"{k}={v}" for k, v in s.params if k != knob]
    return s.name + (" " + ",".join(rest) if rest else "")


def quality_info(evidence: Sequence[Evidence], fits: Sequence[Fit], context: int, backend: str) -> PlanQualityInfo:
    """The measured quality per strategy family against context and kept fraction, and where
    each planned (lossy) strategy sits: what the Planner's evidence chart shows."""
    mine = [e for e in evidence if e.backend == backend] or list(evidence)
    points = [
        QualityPoint(_family_label(e.spec), e.spec, e.context, e.kept_fraction, e.mean_kl, e.mean_kl_ci95)
        for e in sorted(mine, key=lambda e: (_family_label(e.spec), e.context, e.kept_fraction))
    ]
    from_specs = {p.family for p in points}
    targets = []
    for f in fits:
        spec = parse_spec(f.spec)
        label = _family_label(f.spec)
        if spec.lossless or label not in from_specs:
            continue
        bound = spec.window
        targets.append((label, f.spec, 1.0 if bound is None else min(1.0, bound / f.cache.context)))
    return PlanQualityInfo(points, targets, context, backend)


def quality_figure(info: PlanQualityInfo) -> go.Figure:
    """Two panels: mean KL against context, and against kept fraction; one line per family, the
    planned context and each planned strategy's kept fraction marked."""
    if not info.points:
        return empty_figure("Quality evidence", "no measured point on this backend")
    fig = make_subplots(rows=1, cols=2, subplot_titles=("mean KL vs context", "mean KL vs kept fraction"))
    families = sorted({p.family for p in info.points})
    colors = strategy_colors(families)
    for fam in families:
        pts = [p for p in info.points if p.family == fam]
        for col, x in ((1, [p.context for p in pts]), (2, [p.kept_fraction for p in pts])):
            order = np.argsort(x, kind="stable")
            fig.add_trace(
                go.Scatter(
                    x=[x[i] for i in order],
                    y=[pts[i].mean_kl for i in order],
                    mode="lines+markers",
                    name=fam,
                    legendgroup=fam,
                    showlegend=col == 1,
                    line={"color": colors[fam]},
                    error_y={"type": "data", "array": [pts[i].ci95 or 0 for i in order], "visible": True},
                    text=[pts[i].spec for i in order],
                    hovertemplate="%{text}<br>%{x}<br>KL %{y:.4g}<extra></extra>",
                ),
                row=1,
                col=col,
            )
    fig.add_vline(x=info.context, line_dash="dash", line_color=WORKLOAD_COLOR, row=1, col=1)
    for fam, spec, kept in info.targets:
        fig.add_vline(x=kept, line_dash="dot", line_color=colors.get(fam, WORKLOAD_COLOR), row=1, col=2)
    fig.update_xaxes(type="log", title_text="context (tokens); dashed: planned", row=1, col=1)
    fig.update_xaxes(type="log", title_text="kept fraction; dotted: planned strategies", tickformat=".0%", row=1, col=2)
    fig.update_yaxes(title_text="mean KL (nats)", rangemode="tozero")
    fig.update_layout(
        title={"text": f"Quality evidence ({info.backend}): mean KL against context and kept fraction", "x": 0},
        height=360,
        margin={"t": 70, "b": 10},
        legend={"orientation": "h", "y": -0.3},
    )
    return fig


def savings_text(pick: Fit, fits: Sequence[Fit]) -> str:
    """What ``pick`` saves against the first strategy of ``fits`` (the reference), in words."""
    ref = fits[0]
    if pick.spec == ref.spec:
        return f"It is the reference (the first strategy listed): nothing saved against {ref.spec}."
    a, b = ref.cache.peak_bytes, pick.cache.peak_bytes
    if b <= a:
        share = f" ({(a - b) / a:.0%} less)" if a else ""
        text = f"Against {ref.spec} it needs {human_gib(a - b)} less cache at its peak{share}"
    else:
        text = f"It needs {human_gib(b - a)} more cache at its peak than {ref.spec}"
    if pick.sessions is not None and ref.sessions is not None:
        text += f", and {pick.sessions:,} concurrent sessions fit instead of {ref.sessions:,}"
    if pick.max_context is not None and ref.max_context is not None and pick.max_context != ref.max_context:
        text += f"; its longest context in the budget is {pick.max_context:,} tokens instead of {ref.max_context:,}"
    return text + "."
