"""Figure builders for the app: profile tables in, plotly figures out.

Every public function takes DataFrames of the profile schema (``profiles/README.md``) and returns
a ``go.Figure``; none touches Streamlit or the disk, so each is tested on small hand-made frames.
Each figure is built in two steps, as optuna does: ``*_info(data) -> NamedTuple`` selects and
reshapes the numbers (what the tests pin), ``_*_plot(info) -> go.Figure`` only draws. The cache
memory, quality and speed figures read their info from :mod:`cachelib.profile.figure_data`, as
the HTML report does (:mod:`cachelib.profile.report`): the same series, names and colours in both.

One colour per strategy everywhere: :func:`app.figures.strategy_colors` maps a run's strategy
order to the palette, and every figure that draws strategies asks it. The Inspector's slot and
mask figures live in :mod:`app.inspector_charts`, the Planner page's in :mod:`app.plan_charts`.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from cachelib.profile.figure_data import (
    MemoryInfo,
    QualityInfo,
    Series,
    SpeedInfo,
    floats,
    memory_info,
    quality_info,
    sampled_note,
    speed_info,
)

from .figures import LEGEND_RIGHT, PALETTE, REFERENCE_COLOR, empty_figure, legend_below, strategy_colors

MIB = 2**20
KIB = 2**10
PLOT_PX = 320  # the plot area's height in the strategy figures; their legends add to it, below


def _two_rows(top: str, bottom: str) -> go.Figure:
    """Two stacked panels sharing the step axis (what make_subplots builds, at a tenth of its cost:
    these figures are rebuilt twice a second during a live run)."""
    fig = go.Figure()
    title = {"x": 0.5, "xref": "paper", "yref": "paper", "xanchor": "center", "yanchor": "bottom", "showarrow": False}
    fig.update_layout(
        xaxis={"anchor": "y", "matches": "x2", "showticklabels": False},
        yaxis={"domain": [0.56, 1.0], "anchor": "x"},
        xaxis2={"anchor": "y2", "title": {"text": "step"}},
        yaxis2={"domain": [0.0, 0.44], "anchor": "x2"},
        annotations=[{**title, "text": top, "y": 1.0}, {**title, "text": bottom, "y": 0.44}],
    )
    return fig


# --- total cache memory vs step ----------------------------------------------------------------

SMALL_MULTIPLES_FROM = 7  # strategies shown: from this many, one panel per strategy (lines overlap)


def _memory_traces(info: MemoryInfo, s: Series, *, legend: bool, **axes) -> list[go.Scatter]:
    mode = "lines+markers" if (info.every or 1) > 1 else "lines"
    out = []
    for kind, dash in (("used", "solid"), ("allocated", "dash")):
        y = s.values[kind]
        out.append(
            go.Scatter(
                x=s.step,
                y=y / MIB,
                name=s.strategy,
                legendgroup=s.strategy,
                mode=mode,
                showlegend=legend and kind == "used",
                marker={"size": 4},
                line={"color": s.color, "dash": dash, "width": 2 if kind == "used" else 1.5},
                customdata=y,
                meta=kind,
                hovertemplate=f"{s.strategy}<br>step %{{x}}<br>{kind} %{{customdata:,.0f}} B<extra></extra>",
                **axes,
            )
        )
    return out


def _reference_traces(info: MemoryInfo, *, legend: bool, **axes) -> list[go.Scatter]:
    return [
        go.Scatter(
            x=x,
            y=y / MIB,
            name=label,
            legendgroup=label,
            mode="lines",
            showlegend=legend,
            line={"color": REFERENCE_COLOR, "dash": "dot", "width": 2},
            meta="reference",
            customdata=y,
            hovertemplate="step %{x}<br>full cache %{customdata:,.0f} B<extra></extra>",
            **axes,
        )
        for label, (x, y) in info.references.items()
    ]


def _memory_title(info: MemoryInfo, multiples: bool) -> dict:
    """Two lines (a half-width chart cuts one long line off): what it is, then how to read it."""
    head = ("Cache memory per strategy" if multiples else "Cache memory") + sampled_note(info.every, "memory")
    key = "used (solid), allocated (dashed)" + (", full cache (grey dots)" if multiples else "")
    return {"text": f"{head}<br><sup>{key}</sup>"}


def _memory_plot(info: MemoryInfo) -> go.Figure:
    fig = go.Figure()
    for s in info.series:
        fig.add_traces(_memory_traces(info, s, legend=True))
    fig.add_traces(_reference_traces(info, legend=True))  # on top: it matches the baseline's line
    fig.update_layout(title=_memory_title(info, False), xaxis_title="step", yaxis_title="MiB")
    return legend_below(fig, PLOT_PX)


def _panel_title(label: str, width: int = 30) -> str:
    """A strategy label for a small panel: broken after its name when it is long."""
    if len(label) <= width:
        return label
    head, sep, tail = label.rpartition(" / ")
    if sep:
        return f"{head}<br>{_panel_title(tail, width)}"
    name, sep, knobs = label.partition(":")
    return f"{name}:<br>{knobs}" if sep else label


def _memory_multiples_plot(info: MemoryInfo, columns: int = 2) -> go.Figure:
    """One small panel per strategy on shared axes, each with the full-cache reference."""
    n = len(info.series)
    rows = -(-n // columns)
    panel, gap = 150, 46  # pixels: a panel's height, and the room above it for its title
    plot_height = rows * panel + (rows - 1) * gap
    gap_x = 0.08
    fig = go.Figure()
    layout: dict = {}
    annotations = []

    def frac(v: float) -> float:
        return round(min(1.0, max(0.0, v)), 6)

    for i, s in enumerate(info.series):
        r, c = divmod(i, columns)
        ax = "" if i == 0 else str(i + 1)
        x0 = frac(c * (1.0 + gap_x) / columns)
        x1 = frac(x0 + (1.0 - gap_x * (columns - 1)) / columns)
        y1 = frac(1.0 - r * (panel + gap) / plot_height)
        y0 = frac(y1 - panel / plot_height)
        layout[f"xaxis{ax}"] = {
            "domain": [x0, x1],
            "anchor": f"y{ax}",
            "matches": "x" if i else None,
            "showticklabels": i + columns >= n,
            "title": {"text": "step"} if i + columns >= n else None,
        }
        layout[f"yaxis{ax}"] = {
            "domain": [y0, y1],
            "anchor": f"x{ax}",
            "matches": "y" if i else None,
            "showticklabels": c == 0,
            "title": {"text": "MiB"} if c == 0 else None,
            "rangemode": "tozero",
        }
        axes = {"xaxis": f"x{ax}", "yaxis": f"y{ax}"}
        fig.add_traces(_reference_traces(info, legend=False, **axes))
        fig.add_traces(_memory_traces(info, s, legend=False, **axes))
        annotations.append(
            {
                "text": _panel_title(s.strategy),
                "x": (x0 + x1) / 2,
                "y": y1,
                "xref": "paper",
                "yref": "paper",
                "xanchor": "center",
                "yanchor": "bottom",
                "showarrow": False,
                "font": {"size": 11, "color": s.color},
            }
        )
    fig.update_layout(
        **layout,
        annotations=annotations,
        title=_memory_title(info, True),
        showlegend=False,  # each panel is titled by its strategy, in its colour
        height=plot_height + 110 + 70,
        margin={"t": 110, "b": 70},
    )
    return fig


def cache_memory_figure(
    steps: pd.DataFrame,
    strategies: Sequence[str],
    reference: pd.DataFrame | None = None,
    colors: dict[str, str] | None = None,
    small_multiples: bool | None = None,
) -> go.Figure:
    """Total cache bytes used and allocated per strategy vs step; ``reference`` (columns ``step``,
    ``bytes`` and optionally ``label``, one line per label) draws the full-precision full cache.
    ``colors`` (default: by the order of ``strategies``) keeps a subset in the run's colours;
    ``small_multiples`` draws one panel per strategy (default: from SMALL_MULTIPLES_FROM of them)."""
    if not len(steps):
        return empty_figure("Cache memory", "no steps recorded yet")
    info = memory_info(steps, strategies, reference, colors)
    if not info.series:
        return empty_figure("Cache memory", "no cache bytes recorded (the memory probe was off)")
    many = len(info.series) >= SMALL_MULTIPLES_FROM if small_multiples is None else small_multiples
    return _memory_multiples_plot(info) if many and len(info.series) > 1 else _memory_plot(info)


# --- per-layer memory heatmap --------------------------------------------------------------------

LAYER_VALUES = {  # the first is what the page shows first
    "bytes_used": ("bytes used", KIB, "KiB"),
    "bytes_allocated": ("bytes allocated", KIB, "KiB"),
    "tokens_held": ("tokens held", 1, "tokens"),
    "capacity": ("slots allocated", 1, "slots"),
}


class HeatmapInfo(NamedTuple):
    title: str
    z: np.ndarray  # (layers, steps)
    x: np.ndarray  # steps
    y: np.ndarray  # layers
    zmax: float | None
    unit: str


def _grid(part: pd.DataFrame, value: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(z (layer x step), steps, layers) of one strategy's rows; NaN where a cell was not recorded."""
    layer = floats(part["layer"]).astype(np.int64)
    step = floats(part["step"]).astype(np.int64)
    layers, li = np.unique(layer, return_inverse=True)
    steps, si = np.unique(step, return_inverse=True)
    z = np.full((len(layers), len(steps)), np.nan)
    z[li, si] = floats(part[value])
    return z, steps, layers


def _layer_info(layers: pd.DataFrame, strategy: str, value: str) -> HeatmapInfo:
    label, scale, unit = LAYER_VALUES[value]
    z, steps, layer_ids = _grid(layers[layers["strategy"] == strategy], value)
    all_values = floats(layers[value])
    zmax = float(np.nanmax(all_values)) / scale if np.isfinite(all_values).any() else None
    return HeatmapInfo(f"{strategy}: {label} per layer", z / scale, steps, layer_ids, zmax, unit)


def _heatmap_plot(info: HeatmapInfo, colorscale: str = "Viridis") -> go.Figure:
    fig = go.Figure(
        go.Heatmap(
            z=info.z,
            x=info.x,
            y=info.y,
            zmin=0,
            zmax=info.zmax,
            colorscale=colorscale,
            colorbar={"title": info.unit},
            hovertemplate=f"step %{{x}}<br>layer %{{y}}<br>%{{z:,.3g}} {info.unit}<extra></extra>",
        )
    )
    fig.update_layout(title=info.title, xaxis_title="step", yaxis_title="layer", height=420)
    fig.update_yaxes(autorange="reversed")  # layer 0 on top, as in a table
    return fig


def layer_heatmap_figure(layers: pd.DataFrame, strategy: str, value: str = "bytes_used") -> go.Figure:
    """Layer x step heatmap of one strategy; the colour scale spans all strategies of ``layers``
    so switching strategy keeps colours comparable."""
    if value not in LAYER_VALUES:
        raise ValueError(f"value must be one of {', '.join(LAYER_VALUES)}, got {value!r}")
    if not (layers["strategy"] == strategy).any():
        return empty_figure(f"{strategy}: per-layer memory", "no per-layer rows (the memory probe was off)")
    return _heatmap_plot(_layer_info(layers, strategy, value))


# --- quality vs the baseline ---------------------------------------------------------------------


def _quality_plot(info: QualityInfo) -> go.Figure:
    fig = _two_rows("KL(baseline ‖ strategy) per step, nats", "top-1 agreement with the baseline so far")
    for s in info.series:
        fig.add_trace(
            go.Scatter(
                x=s.step,
                y=s.values["kl"],
                name=s.strategy,
                legendgroup=s.strategy,
                mode="lines+markers",
                marker={"size": 4},
                line={"color": s.color},
                hovertemplate=f"{s.strategy}<br>step %{{x}}<br>KL %{{y:.4g}} nats<extra></extra>",
                xaxis="x",
                yaxis="y",
            )
        )
        fig.add_trace(
            go.Scatter(
                x=s.step,
                y=s.values["agreement"] * 100,
                name=s.strategy,
                legendgroup=s.strategy,
                showlegend=False,
                mode="lines",
                line={"color": s.color},
                hovertemplate=f"{s.strategy}<br>step %{{x}}<br>agreement %{{y:.1f}}%<extra></extra>",
                xaxis="x2",
                yaxis="y2",
            )
        )
    fig.update_layout(
        title="Quality vs the baseline", yaxis_title="nats", yaxis2={"title": {"text": "%"}, "range": [0, 101]}
    )
    return legend_below(fig, PLOT_PX + 60, top=70)


def quality_figure(
    steps: pd.DataFrame,
    strategies: Sequence[str],
    baselines: Sequence[str] | None = None,
    colors: dict[str, str] | None = None,
) -> go.Figure:
    """KL and running top-1 agreement vs step for every strategy but the baseline(s)
    (default: the first strategy); ``colors`` as in :func:`cache_memory_figure`."""
    base = set(baselines) if baselines is not None else set(strategies[:1])
    info = quality_info(steps, strategies, base, colors) if len(steps) else QualityInfo([])
    if not info.series:
        why = "only the baseline ran, or the quality probe was off: nothing to compare"
        return empty_figure("Quality vs the baseline", why)
    return _quality_plot(info)


# --- speed and process memory ----------------------------------------------------------------


def _speed_plot(info: SpeedInfo) -> go.Figure:
    fig = _two_rows(
        "decode speed per strategy, tokens/s", "process memory (each run's process: all its strategies together), MiB"
    )
    for s in info.series:
        fig.add_trace(
            go.Scatter(
                x=s.step,
                y=s.values["tokens_per_second"],
                name=s.strategy,
                legendgroup=s.strategy,
                mode="lines",
                line={"color": s.color},
                hovertemplate=f"{s.strategy}<br>step %{{x}}<br>%{{y:.1f}} tokens/s<extra></extra>",
                xaxis="x",
                yaxis="y",
            )
        )
    for line in info.process:
        fig.add_trace(
            go.Scatter(
                x=line.step,
                y=line.bytes / MIB,
                name=line.name,
                mode="lines",
                line={"color": line.color, "dash": line.dash},
                customdata=line.bytes,
                hovertemplate=f"step %{{x}}<br>{line.name} %{{customdata:,.0f}} B<extra></extra>",
                xaxis="x2",
                yaxis="y2",
            )
        )
    fig.update_layout(
        title="Speed and memory of the process",
        yaxis={"title": {"text": "tokens/s"}, "rangemode": "tozero"},
        yaxis2_title="MiB",
    )
    return legend_below(fig, PLOT_PX + 60, top=70)


def speed_figure(steps: pd.DataFrame, strategies: Sequence[str], colors: dict[str, str] | None = None) -> go.Figure:
    """Decode tokens/s per strategy vs step, and the process's device/RSS memory vs step (the
    process counters are the process's, whichever strategies are shown)."""
    info = speed_info(steps, strategies, colors) if len(steps) else SpeedInfo([], [])
    if not info.series and not info.process:
        return empty_figure("Speed and memory of the process", "no timings recorded (the system probe was off)")
    return _speed_plot(info)


# --- inspector: quantization error ------------------------------------------------------------------

NO_QUANT_ERROR = "no quantization error recorded (not quantized, or the probe was off)"
ERROR_COLUMNS = {
    "key_rel_rms": "key relative RMS error",
    "value_rel_rms": "value relative RMS error",
    "key_max_abs": "key max abs error",
    "value_max_abs": "value max abs error",
}


def quant_error_heatmap(layers: pd.DataFrame, strategy: str, column: str = "key_rel_rms") -> go.Figure:
    """Layer x step heatmap of the quantization error of what each step quantized."""
    if column not in ERROR_COLUMNS:
        raise ValueError(f"column must be one of {', '.join(ERROR_COLUMNS)}, got {column!r}")
    part = layers[(layers["strategy"] == strategy) & layers[column].notna()]
    if not len(part):
        return empty_figure(f"{strategy}: {ERROR_COLUMNS[column]}", NO_QUANT_ERROR)
    z, steps, layer_ids = _grid(part, column)
    # Two lines: a long strategy label and the error's name do not fit a half-width chart in one.
    title = f"{strategy}<br><sup>{ERROR_COLUMNS[column]} per layer and step</sup>"
    info = HeatmapInfo(title, z, steps, layer_ids, None, "")
    # Light for a small error, dark red for a large one (Magma's light end read as a high value).
    fig = _heatmap_plot(info, colorscale="YlOrRd")
    fig.update_layout(margin={"t": 80})
    return fig


class ErrorBarsInfo(NamedTuple):
    strategy: str
    step: int | None  # the recorded step shown (the nearest at or before the one asked for)
    layer: np.ndarray
    key: np.ndarray
    value: np.ndarray
    color: str


def _error_bars_info(layers: pd.DataFrame, strategies: Sequence[str], strategy: str, step: int) -> ErrorBarsInfo:
    part = layers[(layers["strategy"] == strategy) & (layers["key_rel_rms"].notna() | layers["value_rel_rms"].notna())]
    color = strategy_colors(strategies).get(strategy, PALETTE[0])
    recorded = sorted(int(s) for s in part["step"].unique())
    before = [s for s in recorded if s <= step]
    shown = before[-1] if before else (recorded[0] if recorded else None)
    if shown is None:
        return ErrorBarsInfo(strategy, None, np.array([]), np.array([]), np.array([]), color)
    at = part[part["step"] == shown].sort_values("layer")
    layer = floats(at["layer"]).astype(np.int64)
    return ErrorBarsInfo(strategy, shown, layer, floats(at["key_rel_rms"]), floats(at["value_rel_rms"]), color)


def quant_error_bars(layers: pd.DataFrame, strategies: Sequence[str], strategy: str, step: int) -> go.Figure:
    """Per-layer key and value relative RMS error at ``step`` (or the nearest recorded step before it)."""
    info = _error_bars_info(layers, strategies, strategy, step)
    if info.step is None:
        return empty_figure(f"{strategy}: quantization error", NO_QUANT_ERROR)
    fig = go.Figure(
        [
            go.Bar(x=info.layer, y=info.key, name="keys", marker={"color": info.color}),
            go.Bar(x=info.layer, y=info.value, name="values", marker={"color": info.color, "opacity": 0.45}),
        ]
    )
    note = "" if info.step == step else f" (nearest recorded step to {step})"
    fig.update_layout(
        title={"text": f"{strategy}<br><sup>relative RMS error per layer at step {info.step}{note}</sup>"},
        margin={"t": 80},
        xaxis_title="layer",
        yaxis_title="‖x − deq(q(x))‖ / ‖x‖",
        barmode="group",
        height=360,
        legend=LEGEND_RIGHT,
    )
    return fig
