"""Figures and tables of the Planner page: the planner's results in, plotly figures and DataFrames out.

What it knows: :class:`cachelib.plan.Fit` (one strategy against one workload and budget) and how
to sample the planner over a range of contexts. :func:`memory_curves` and :func:`frontier_curves`
call :func:`cachelib.plan.account`, :func:`~cachelib.plan.max_batch` and
:func:`~cachelib.plan.max_sessions` once per context, so each point is what
``python -m cachelib plan`` prints for that context. What it does not know: Streamlit, files, or
any byte rule (those live in :mod:`cachelib.plan`). Figures are built as in :mod:`app.charts`:
``_*_info(data) -> NamedTuple`` picks the numbers (what the tests pin), ``_*_plot(info)`` draws.

Bytes are shown in SI units ("GB" = 10^9 bytes), the unit of the budget and of the CLI.
"""

from __future__ import annotations

import shlex
from typing import Callable, NamedTuple, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from cachelib.plan import GB, Arch, Fit, account, max_batch, max_sessions
from cachelib.plan.quality import Evidence
from cachelib.core.units import human_bytes
from cachelib.spec import parse_spec

BUDGET_COLOR = "#7f7f7f"
WORKLOAD_COLOR = "#000000"  # the outline of a white star: no strategy colour is white
GRID_POINTS = 64  # contexts sampled per curve; the asked context is always one of them
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


def _colors(strategies: Sequence[str]) -> dict[str, str]:
    # app.charts re-exports this module at its end: importing it here, at call time, keeps
    # either import order working.
    from .charts import strategy_colors

    return strategy_colors(strategies)


# --- sampling the planner over contexts ----------------------------------------------------------


def chart_range(context: int, max_position: int | None = None) -> int:
    """The default end of the context axis: twice the asked context, cut to the model's
    context length when that still covers the asked context."""
    end = 2 * context
    if max_position and max_position >= context:
        end = min(end, max_position)
    return end


def context_grid(context: int, end: int, *, points: int = GRID_POINTS, log: bool = False) -> list[int]:
    """About ``points`` contexts from 1 (log) or ``end / points`` (linear) to ``end``, evenly
    (or geometrically) spaced, with ``context`` itself always included."""
    if context < 1 or end < 1:
        raise ValueError(f"context and the chart range must be >= 1 token, got context={context}, end={end}")
    if log:
        grid = np.geomspace(1, end, points)
    else:
        grid = np.linspace(end / points, end, points)
    values = {int(round(x)) for x in grid if x >= 1} | {context, end}
    return sorted(v for v in values if v >= 1)


def memory_curves(
    arch: Arch,
    specs: Sequence[str],
    contexts: Sequence[int],
    *,
    batch: int = 1,
    backend: str = "mlx",
    dtype: str = "float16",
    prefill: int | None = None,
    prefill_chunk: int | None = None,
) -> pd.DataFrame:
    """Per strategy and context: bytes allocated at the end of the run and the run's peak.
    A run the strategy refuses (a static cache shorter than the context) is NaN; a strategy
    that refuses every run raises its error."""
    rows = []
    for spec in specs:
        errors = []
        for n in contexts:
            prompt = None if prefill is None else min(prefill, n)  # a shorter run is all prompt, as the solver has it
            try:
                acc = account(arch, spec, backend, context=n, prefill=prompt, prefill_chunk=prefill_chunk, batch=batch,
                              dtype=dtype)  # fmt: skip
            except ValueError as e:
                errors.append(e)
                rows.append({"strategy": spec, "context": n, "bytes_allocated": np.nan, "peak_bytes": np.nan})
                continue
            rows.append(
                {"strategy": spec, "context": n, "bytes_allocated": acc.bytes_allocated, "peak_bytes": acc.peak_bytes}
            )
        if contexts and len(errors) == len(contexts):
            raise errors[0]
    return pd.DataFrame(rows, columns=["strategy", "context", "bytes_allocated", "peak_bytes"]).astype(
        {"context": "int64", "bytes_allocated": "float64", "peak_bytes": "float64"}
    )


def frontier_curves(
    arch: Arch,
    specs: Sequence[str],
    contexts: Sequence[int],
    available_bytes: int,
    *,
    backend: str = "mlx",
    dtype: str = "float16",
    prefill: int | None = None,
    prefill_chunk: int | None = None,
) -> pd.DataFrame:
    """Per strategy and context: the largest batch and the most concurrent sessions whose cache
    fits in ``available_bytes`` (the budget less weights and reserve). NaN where the strategy
    refuses the run."""
    rows = []
    for spec in specs:
        for n in contexts:
            # the solver cuts the prompt to the context itself
            opts = dict(context=n, backend=backend, dtype=dtype, prefill=prefill, prefill_chunk=prefill_chunk)
            try:
                most = max_batch(arch, spec, available_bytes, **opts)
                sessions = max_sessions(arch, spec, available_bytes, **opts)
            except ValueError:
                most = sessions = np.nan
            rows.append({"strategy": spec, "context": n, "max_batch": most, "sessions": sessions})
    return pd.DataFrame(rows, columns=["strategy", "context", "max_batch", "sessions"]).astype(
        {"context": "int64", "max_batch": "float64", "sessions": "float64"}
    )


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
    colors = _colors(strategies)
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
                    x=c.context, y=y / GB, name=c.strategy, legendgroup=c.strategy, showlegend=kind == "allocated",
                    mode="lines", line={"color": c.color, "dash": dash, "width": width}, customdata=y, meta=kind,
                    hovertemplate=f"{c.strategy}<br>context %{{x:,}}<br>{kind} %{{customdata:,.0f}} B<extra></extra>",
                )
            )  # fmt: skip
    if info.cache_budget is not None:
        budget = info.cache_budget
        fig.add_hline(
            y=budget / GB, line={"color": BUDGET_COLOR, "dash": "dash", "width": 2},
            annotation_text=f"cache budget {human_bytes(budget)}", annotation_position="top left",
        )  # fmt: skip
        if info.max_context:
            colors = {c.strategy: c.color for c in info.curves}
            names = list(info.max_context)
            fig.add_trace(
                go.Scatter(
                    x=[info.max_context[s] for s in names], y=[budget / GB] * len(names), mode="markers",
                    name="max context in the budget", customdata=names,
                    marker={"symbol": "x", "size": 11, "color": [colors[s] for s in names], "line": {"width": 1}},
                    hovertemplate="%{customdata}<br>max context %{x:,} tokens<extra></extra>",
                )
            )  # fmt: skip
    if info.context is not None:
        fig.add_vline(x=info.context, line={"color": WORKLOAD_COLOR, "dash": "dot", "width": 1},
                      annotation_text=f"context {info.context:,}", annotation_position="top right")  # fmt: skip
    fig.update_layout(
        title={
            "text": "Cache memory vs context",
            "subtitle": {"text": "solid: allocated at the end of the run · dotted: peak during it"},
        },
        xaxis={"title": "context (tokens)", "type": "log" if log else "linear"},
        yaxis={"title": "GB (10^9 bytes)", "type": "log" if log else "linear", "rangemode": "tozero"},
        legend={"orientation": "h", "y": -0.22},
        height=500,
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
    :func:`memory_curves`), the cache budget as a horizontal line, the asked context as a
    vertical one, and an x where each strategy's ``fits`` say memory stops it. ``log``: both
    axes logarithmic."""
    if not len(curves):
        return _empty_figure("Cache memory vs context", "no strategy to plan")
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
                x=c.context, y=c.values["count"], name=c.strategy, mode="lines", line_shape="vh",
                line={"color": c.color, "width": 2},
                hovertemplate=f"{c.strategy}<br>context %{{x:,}}<br>{what} %{{y:,}}<extra></extra>",
            )
        )  # fmt: skip
    if info.workload is not None:
        x, y = info.workload
        label = "your workload" if info.measure == "max_batch" else "one session"
        fig.add_trace(
            go.Scatter(
                x=[x], y=[y], mode="markers", name=f"{label} ({y} x {x:,} tokens)",
                marker={"symbol": "star", "size": 16, "color": "white", "line": {"color": WORKLOAD_COLOR, "width": 2}},
                hovertemplate=f"{label}<br>context %{{x:,}}<br>{what} %{{y}}<extra></extra>",
            )
        )  # fmt: skip
    fig.update_layout(
        title={
            "text": f"Fit frontier: {what} vs context",
            "subtitle": {"text": "what fits the budget: every point on or below a strategy's line"},
        },
        xaxis={"title": "context (tokens)", "type": "log" if log else "linear"},
        # counts span orders of magnitude over the range: a log axis, labelled 1, 2, 5, 10, 20, ...
        yaxis={"title": f"{what} (log scale)", "type": "log", "tickvals": ticks, "ticktext": [f"{t:,}" for t in ticks]},
        legend={"orientation": "h", "y": -0.22},
        height=500,
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
    budget vs context (``frontier`` from :func:`frontier_curves`), drawn as steps that drop at
    the first sampled context where the count falls, so the line never promises more than
    what was computed; ``workload`` (context, count) is marked with a star. The count axis is
    logarithmic (counts span orders of magnitude); ``log`` makes the context axis so too."""
    if not len(frontier):
        return _empty_figure("Fit frontier", "give a memory budget to see what fits")
    return _frontier_plot(_frontier_info(frontier, strategies, measure, workload), log)


def _empty_figure(title: str, message: str) -> go.Figure:
    from .charts import _empty  # at call time: app.charts imports this module at its end

    return _empty(title, message).update_layout(height=300)


# --- tables and words ------------------------------------------------------------------------------

BYTE_COLUMNS = ("allocated", "used", "peak", "per token", "host", "headroom", "budget needed")


def plan_table(fits: Sequence[Fit]) -> pd.DataFrame:
    """One row per strategy with the CLI's columns (raw byte counts; :func:`styled_plan_table`
    shows them as the CLI prints them). Budget columns only with a budget, quality columns only
    when some strategy has measured quality, host bytes only when some layer is offloaded."""
    budgeted = any(f.budget_bytes is not None for f in fits)
    measured = any(f.quality is not None for f in fits)
    offloaded = any(f.cache.host_bytes for f in fits)
    rows = []
    for f in fits:
        c = f.cache
        row = {"strategy": f.spec, "allocated": c.bytes_allocated, "used": c.bytes_used, "peak": c.peak_bytes,
               "per token": c.bytes_per_token}  # fmt: skip
        if offloaded:
            row["host"] = c.host_bytes
        if measured:
            q = f.quality
            row.update({"mean KL": q and q.mean_kl, "top-1": q and q.top1_agreement, "measured on": q and q.model})
        if budgeted:
            row.update({
                "fits": "yes" if f.fits else "NO", "headroom": f.headroom_bytes, "max context": f.max_context,
                "limited by": LIMITS.get(f.context_limit, f.context_limit), "max batch": f.max_batch,
                "sessions": f.sessions, "budget needed": f.budget_needed,
            })  # fmt: skip
        rows.append(row)
    table = pd.DataFrame(rows)
    for col in ("allocated", "used", "peak", "host", "headroom", "budget needed", "max context", "max batch",
                "sessions"):  # fmt: skip
        if col in table:
            table[col] = table[col].astype("Int64")
    for col in ("mean KL", "top-1"):
        if col in table:
            table[col] = table[col].astype("Float64")
    return table


NO_VALUE = "–"
TEXT_FORMATS: dict[str, Callable] = {
    **{c: human_bytes for c in BYTE_COLUMNS},
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
        out[col] = [NO_VALUE if v is None or v is pd.NA or v != v else fmt(v) for v in table[col].tolist()]
    return out


def styled_plan_table(table: pd.DataFrame, strategies: Sequence[str]):
    """:func:`plan_table_text` of ``table`` with each strategy in its colour."""
    colors = _colors(strategies)
    return plan_table_text(table).style.map(
        lambda s: f"color: {colors.get(s, '#000')}; font-weight: 600", subset=["strategy"]
    )


def parse_strategies(text: str) -> list[str]:
    """Canonical specs from text with one spec per line (blank lines and ``#`` comments skipped,
    repeats dropped); a bad line raises ValueError naming the line."""
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
    if not specs:
        raise ValueError("give at least one strategy spec, one per line (e.g. standard)")
    return specs


def evidence_table(evidence: Sequence[Evidence]) -> pd.DataFrame:
    """What the profiles measured, one row per (model, backend, strategy)."""
    cols = ["strategy", "model", "backend", "runs", "steps", "mean KL", "top-1", "files"]
    rows = [
        [e.spec, e.model, e.backend, e.runs, e.steps, e.mean_kl, e.top1_agreement, ", ".join(e.files)] for e in evidence
    ]
    return pd.DataFrame(rows, columns=cols)


def savings_text(pick: Fit, fits: Sequence[Fit]) -> str:
    """What ``pick`` saves against the first strategy of ``fits`` (the reference), in words."""
    ref = fits[0]
    if pick.spec == ref.spec:
        return f"It is the reference (the first strategy listed): nothing saved against {ref.spec}."
    a, b = ref.cache.peak_bytes, pick.cache.peak_bytes
    if b <= a:
        share = f" ({(a - b) / a:.0%} less)" if a else ""
        text = f"Against {ref.spec} it needs {human_bytes(a - b)} less cache at its peak{share}"
    else:
        text = f"It needs {human_bytes(b - a)} more cache at its peak than {ref.spec}"
    if pick.sessions is not None and ref.sessions is not None:
        text += f", and {pick.sessions:,} concurrent sessions fit instead of {ref.sessions:,}"
    if pick.max_context is not None and ref.max_context is not None and pick.max_context != ref.max_context:
        text += f"; its longest context in the budget is {pick.max_context:,} tokens instead of {ref.max_context:,}"
    return text + "."


def cli_command(
    model: str,
    specs: Sequence[str],
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
    quality_from: str | None = None,
    max_kl: float | None = None,
    min_agreement: float | None = None,
) -> str:
    """The ``python -m cachelib plan`` command that prints the same plan."""
    args = ["python", "-m", "cachelib", "plan", "--model", model, "--context", str(context)]
    if batch != 1:
        args += ["--batch", str(batch)]
    for spec in specs:
        args += ["--strategy", spec]
    args += ["--backend", backend, "--dtype", dtype]
    for flag, value in (("--prefill", prefill), ("--prefill-chunk", prefill_chunk)):
        if value is not None:
            args += [flag, str(value)]
    if budget_gb is not None:
        args += ["--budget-gb", _number(budget_gb)]
    if weights_gb is not None:
        args += ["--weights-gb", _number(weights_gb)]
    elif weight_bits != 16:
        args += ["--weight-bits", _number(weight_bits)]
    if reserve_gb:
        args += ["--reserve-gb", _number(reserve_gb)]
    if quality_from is not None:
        args += ["--quality-from", quality_from]
    if max_kl is not None:
        args += ["--max-kl", _number(max_kl)]
    if min_agreement is not None:
        args += ["--min-agreement", _number(min_agreement)]
    return shlex.join(args)


def _number(value: float) -> str:
    """The shortest text that reads back as exactly ``value``."""
    short = f"{value:g}"
    return short if float(short) == value else repr(float(value))
