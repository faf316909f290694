"""Figure builders for the app: profile tables in, plotly figures out.

Every public function takes DataFrames of the profile schema (``profiles/README.md``) and returns
a ``go.Figure``; none touches Streamlit or the disk, so each is tested on small hand-made frames.
Each figure is built in two steps, as optuna does: ``_*_info(data) -> NamedTuple`` selects and
reshapes the numbers (what the tests pin), ``_*_plot(info) -> go.Figure`` only draws.

One colour per strategy everywhere: :func:`app.figures.strategy_colors` maps a run's strategy
order to the palette, and every figure that draws strategies asks it. The Planner page's figures
live in :mod:`app.plan_charts`.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from .figures import PALETTE, empty_figure, strategy_colors

MIB = 2**20
KIB = 2**10
REFERENCE_COLOR = "#7f7f7f"
EMPTY_SLOT_COLOR = "#e5e5e5"


def _floats(s: pd.Series) -> np.ndarray:
    """A nullable column as float64 with NaN for missing values (what plotly draws as gaps)."""
    try:
        return s.to_numpy(dtype="float64", na_value=np.nan)
    except (TypeError, ValueError):  # text or objects: coerce what parses
        return pd.to_numeric(s, errors="coerce").to_numpy(dtype="float64", na_value=np.nan)


def _ordered(frame: pd.DataFrame, strategies: Sequence[str]) -> list[tuple[str, pd.DataFrame]]:
    """(strategy, its rows sorted by step) in run order, skipping strategies with no rows yet."""
    groups = dict(tuple(frame.groupby("strategy", sort=False, observed=True)))
    return [(s, groups[s].sort_values("step")) for s in strategies if s in groups and len(groups[s])]


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


class _Series(NamedTuple):
    strategy: str
    color: str
    step: np.ndarray
    values: dict[str, np.ndarray]


class MemoryInfo(NamedTuple):
    series: list[_Series]  # values: "used", "allocated" in bytes
    references: dict[str, tuple[np.ndarray, np.ndarray]]  # label -> (step, bytes) of a full cache


def _memory_info(steps: pd.DataFrame, strategies: Sequence[str], reference: pd.DataFrame | None) -> MemoryInfo:
    colors = strategy_colors(strategies)
    series = [
        _Series(
            s,
            colors[s],
            _floats(part["step"]),
            {"used": _floats(part["cache_bytes_used"]), "allocated": _floats(part["cache_bytes_allocated"])},
        )
        for s, part in _ordered(steps, strategies)
    ]
    refs = {}
    if reference is not None and len(reference):
        labels = reference["label"] if "label" in reference else pd.Series("full cache", index=reference.index)
        for label, part in reference.groupby(labels, sort=False):
            part = part.sort_values("step")
            refs[str(label)] = (_floats(part["step"]), _floats(part["bytes"]))
    return MemoryInfo(series, refs)


def _memory_plot(info: MemoryInfo) -> go.Figure:
    fig = go.Figure()
    for label, (x, y) in info.references.items():
        fig.add_trace(
            go.Scatter(
                x=x, y=y / MIB, name=label, mode="lines",
                line={"color": REFERENCE_COLOR, "dash": "dot", "width": 2},
                customdata=y, hovertemplate="step %{x}<br>full cache %{customdata:,.0f} B<extra></extra>",
            )
        )  # fmt: skip
    for s in info.series:
        for kind, dash in (("used", "solid"), ("allocated", "dash")):
            y = s.values[kind]
            fig.add_trace(
                go.Scatter(
                    x=s.step, y=y / MIB, name=f"{s.strategy} · {kind}", legendgroup=s.strategy, mode="lines",
                    line={"color": s.color, "dash": dash, "width": 2 if kind == "used" else 1.5},
                    customdata=y,
                    hovertemplate=f"{s.strategy}<br>step %{{x}}<br>{kind} %{{customdata:,.0f}} B<extra></extra>",
                )
            )  # fmt: skip
    fig.update_layout(
        title="Cache memory: bytes used (solid) and allocated (dashed)",
        xaxis_title="step",
        yaxis_title="MiB",
        legend={"orientation": "h", "y": -0.25},
        height=460,
    )
    return fig


def cache_memory_figure(
    steps: pd.DataFrame, strategies: Sequence[str], reference: pd.DataFrame | None = None
) -> go.Figure:
    """Total cache bytes used and allocated per strategy vs step; ``reference`` (columns ``step``,
    ``bytes`` and optionally ``label``, one line per label) draws the full-precision full cache."""
    if not len(steps):
        return empty_figure("Cache memory", "no steps recorded yet")
    return _memory_plot(_memory_info(steps, strategies, reference))


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
    layer = _floats(part["layer"]).astype(np.int64)
    step = _floats(part["step"]).astype(np.int64)
    layers, li = np.unique(layer, return_inverse=True)
    steps, si = np.unique(step, return_inverse=True)
    z = np.full((len(layers), len(steps)), np.nan)
    z[li, si] = _floats(part[value])
    return z, steps, layers


def _layer_info(layers: pd.DataFrame, strategy: str, value: str) -> HeatmapInfo:
    label, scale, unit = LAYER_VALUES[value]
    z, steps, layer_ids = _grid(layers[layers["strategy"] == strategy], value)
    all_values = _floats(layers[value])
    zmax = float(np.nanmax(all_values)) / scale if np.isfinite(all_values).any() else None
    return HeatmapInfo(f"{strategy}: {label} per layer", z / scale, steps, layer_ids, zmax, unit)


def _heatmap_plot(info: HeatmapInfo, colorscale: str = "Viridis") -> go.Figure:
    fig = go.Figure(
        go.Heatmap(
            z=info.z, x=info.x, y=info.y, zmin=0, zmax=info.zmax, colorscale=colorscale,
            colorbar={"title": info.unit},
            hovertemplate=f"step %{{x}}<br>layer %{{y}}<br>%{{z:,.3g}} {info.unit}<extra></extra>",
        )
    )  # fmt: skip
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


class QualityInfo(NamedTuple):
    series: list[_Series]  # values: "kl" (nats), "agreement" (running share of agreeing steps, 0..1)


def _quality_info(steps: pd.DataFrame, strategies: Sequence[str], baselines: set[str]) -> QualityInfo:
    colors = strategy_colors(strategies)
    series = []
    for s, part in _ordered(steps, strategies):
        if s in baselines:
            continue
        part = part[part["kl"].notna() | part["top1_agree"].notna()]
        agree = _floats(part["top1_agree"].astype("Float64"))
        seen = np.cumsum(~np.isnan(agree))
        running = np.cumsum(np.nan_to_num(agree)) / np.maximum(seen, 1)
        running[seen == 0] = np.nan
        series.append(_Series(s, colors[s], _floats(part["step"]), {"kl": _floats(part["kl"]), "agreement": running}))
    return QualityInfo(series)


def _quality_plot(info: QualityInfo) -> go.Figure:
    fig = _two_rows("KL(baseline ‖ strategy) per step, nats", "top-1 agreement with the baseline so far")
    for s in info.series:
        fig.add_trace(
            go.Scatter(
                x=s.step, y=s.values["kl"], name=s.strategy, legendgroup=s.strategy, mode="lines+markers",
                marker={"size": 4}, line={"color": s.color},
                hovertemplate=f"{s.strategy}<br>step %{{x}}<br>KL %{{y:.4g}} nats<extra></extra>",
                xaxis="x", yaxis="y",
            )
        )  # fmt: skip
        fig.add_trace(
            go.Scatter(
                x=s.step, y=s.values["agreement"] * 100, name=s.strategy, legendgroup=s.strategy, showlegend=False,
                mode="lines", line={"color": s.color},
                hovertemplate=f"{s.strategy}<br>step %{{x}}<br>agreement %{{y:.1f}}%<extra></extra>",
                xaxis="x2", yaxis="y2",
            )
        )  # fmt: skip
    fig.update_layout(
        title="Quality vs the baseline",
        yaxis_title="nats",
        yaxis2={"title": {"text": "%"}, "range": [0, 101]},
        height=480,
        legend={"orientation": "h", "y": -0.15},
    )
    return fig


def quality_figure(steps: pd.DataFrame, strategies: Sequence[str], baselines: Sequence[str] | None = None) -> go.Figure:
    """KL and running top-1 agreement vs step for every strategy but the baseline(s)
    (default: the first strategy)."""
    base = set(baselines) if baselines is not None else set(strategies[:1])
    info = _quality_info(steps, strategies, base) if len(steps) else QualityInfo([])
    if not info.series:
        why = "only the baseline ran, or the quality probe was off: nothing to compare"
        return empty_figure("Quality vs the baseline", why)
    return _quality_plot(info)


# --- speed and process memory ----------------------------------------------------------------


class SpeedInfo(NamedTuple):
    series: list[_Series]  # values: "tokens_per_second" (decode steps only)
    process: dict[str, tuple[np.ndarray, np.ndarray]]  # name -> (step, bytes), process-wide counters


PROCESS_COUNTERS = {"device_active_bytes": "device active memory", "rss_bytes": "process RSS"}
PROCESS_COLORS = {"device_active_bytes": "#444444", "rss_bytes": "#aaaaaa"}


def _speed_info(steps: pd.DataFrame, strategies: Sequence[str]) -> SpeedInfo:
    colors = strategy_colors(strategies)
    decode = steps[steps["phase"] == "decode"]
    series = [
        _Series(s, colors[s], _floats(part["step"]), {"tokens_per_second": _floats(part["tokens_per_second"])})
        for s, part in _ordered(decode, strategies)
        if part["tokens_per_second"].notna().any()
    ]
    process = {}
    for col in PROCESS_COUNTERS:
        # One process holds every strategy's caches: these counters are not per strategy.
        per_step = steps.groupby("step")[col].max().dropna()
        if len(per_step):
            process[col] = (per_step.index.to_numpy(dtype="float64"), _floats(per_step))
    return SpeedInfo(series, process)


def _speed_plot(info: SpeedInfo) -> go.Figure:
    fig = _two_rows("decode speed per strategy, tokens/s", "process memory (all strategies together), MiB")
    for s in info.series:
        fig.add_trace(
            go.Scatter(
                x=s.step, y=s.values["tokens_per_second"], name=s.strategy, legendgroup=s.strategy,
                mode="lines", line={"color": s.color},
                hovertemplate=f"{s.strategy}<br>step %{{x}}<br>%{{y:.1f}} tokens/s<extra></extra>",
                xaxis="x", yaxis="y",
            )
        )  # fmt: skip
    for col, (x, y) in info.process.items():
        fig.add_trace(
            go.Scatter(
                x=x, y=y / MIB, name=PROCESS_COUNTERS[col], mode="lines",
                line={"color": PROCESS_COLORS[col], "dash": "dot"},
                customdata=y,
                hovertemplate=f"step %{{x}}<br>{PROCESS_COUNTERS[col]} %{{customdata:,.0f}} B<extra></extra>",
                xaxis="x2", yaxis="y2",
            )
        )  # fmt: skip
    fig.update_layout(
        title="Speed and memory of the process",
        yaxis={"title": {"text": "tokens/s"}, "rangemode": "tozero"},
        yaxis2_title="MiB",
        height=480,
        legend={"orientation": "h", "y": -0.15},
    )
    return fig


def speed_figure(steps: pd.DataFrame, strategies: Sequence[str]) -> go.Figure:
    """Decode tokens/s per strategy vs step, and the process's device/RSS memory vs step."""
    info = _speed_info(steps, strategies) if len(steps) else SpeedInfo([], {})
    if not info.series and not info.process:
        return empty_figure("Speed and memory of the process", "no timings recorded (the system probe was off)")
    return _speed_plot(info)


# --- inspector: the slots of one layer cache --------------------------------------------------------


class RingInfo(NamedTuple):
    strategy: str
    step: int
    layer: int
    layout: str  # "ring" (from the slots table) or "linear" (derived from the layers row)
    positions: np.ndarray  # (capacity,) absolute position per slot, -1 empty
    width: int  # slots per drawn row
    write_index: int | None
    keep: int
    evicted: int
    offset: int


def slot_grid_width(capacity: int) -> int:
    return max(1, min(capacity, 32 if capacity <= 512 else 64))


def _ring_info(slots: pd.DataFrame, layers: pd.DataFrame, strategy: str, step: int, layer: int) -> RingInfo | None:
    lrow = layers[(layers["strategy"] == strategy) & (layers["step"] == step) & (layers["layer"] == layer)]
    srow = slots[(slots["strategy"] == strategy) & (slots["step"] == step) & (slots["layer"] == layer)]
    lr = lrow.iloc[0] if len(lrow) else None
    if len(srow):
        r = srow.iloc[0]
        text = str(r["positions"]).strip()
        positions = np.array([int(p) for p in text.split()] if text else [], dtype=np.int64)
        write_index = None if pd.isna(r["write_index"]) else int(r["write_index"])
        keep = 0 if pd.isna(r["keep"]) else int(r["keep"])
        layout = "ring"
    elif lr is not None:
        # Append-only layouts: the held tokens fill the first slots, ending at the newest position.
        capacity, held, offset = int(lr["capacity"]), int(lr["tokens_held"]), int(lr["offset"])
        positions = np.full(capacity, -1, dtype=np.int64)
        positions[: min(held, capacity)] = np.arange(offset - held, offset - held + min(held, capacity))
        write_index = None if pd.isna(lr["write_index"]) else int(lr["write_index"])
        keep = 0 if pd.isna(lr["keep"]) else int(lr["keep"])
        layout = "linear"
    else:
        return None
    held = positions[positions >= 0]
    offset = int(lr["offset"]) if lr is not None and pd.notna(lr["offset"]) else int(held.max() + 1 if len(held) else 0)
    evicted = int(lr["evicted"]) if lr is not None and pd.notna(lr["evicted"]) else max(0, offset - len(held))
    width = slot_grid_width(len(positions))
    return RingInfo(strategy, step, layer, layout, positions, width, write_index, keep, evicted, offset)


def _ring_plot(info: RingInfo) -> go.Figure:
    cap, w = len(info.positions), info.width
    rows = -(-cap // w) if cap else 0
    grid = np.full(rows * w, np.nan)
    grid[:cap] = np.where(info.positions >= 0, info.positions, np.nan)
    idx = np.arange(rows * w)
    slot_text = np.where(idx < cap, idx, -1).reshape(rows, w)
    fig = go.Figure(
        go.Heatmap(
            z=grid.reshape(rows, w), x=np.arange(w), y=np.arange(rows), customdata=slot_text,
            colorscale="Viridis", zmin=0, zmax=max(info.offset - 1, 1), xgap=1, ygap=1,
            colorbar={"title": "position"}, name="slots",
            hovertemplate="slot %{customdata}<br>position %{z}<extra></extra>",
            text=grid.reshape(rows, w) if cap <= 128 else None, texttemplate="%{text:.0f}" if cap <= 128 else None,
        )
    )  # fmt: skip
    if info.keep:
        k = np.arange(min(info.keep, cap))
        fig.add_trace(
            go.Scatter(
                x=k % w, y=k // w, mode="markers", name=f"keep region ({info.keep} sink slots)",
                marker={"symbol": "square-open", "size": 18, "color": "#D55E00", "line": {"width": 2}},
                hoverinfo="skip",
            )
        )  # fmt: skip
    if info.write_index is not None:
        wi = info.write_index
        past_end = wi >= cap
        shown = min(wi, max(cap - 1, 0))
        label = f"write pointer → slot {wi}" + (" (past the end: the next write wraps or grows)" if past_end else "")
        fig.add_trace(
            go.Scatter(
                x=[shown % w + (0.5 if past_end else 0)], y=[shown // w - 0.45], mode="markers", name=label,
                marker={"symbol": "triangle-down", "size": 14, "color": "#CC0000"}, hoverinfo="name",
            )
        )  # fmt: skip
    held = int((info.positions >= 0).sum())
    fig.update_layout(
        title=(
            f"{info.strategy} · layer {info.layer} · step {info.step}: {held} of {cap} slots hold tokens, "
            f"keep {info.keep}, evicted {info.evicted}"
        ),
        xaxis={"title": "slot (column)", "showgrid": False, "zeroline": False, "dtick": 4 if w <= 32 else 8},
        yaxis={
            "title": "slots", "autorange": "reversed", "showgrid": False, "zeroline": False,
            "tickvals": list(range(rows)), "ticktext": [f"{r * w}–{min(cap, (r + 1) * w) - 1}" for r in range(rows)],
        },
        plot_bgcolor=EMPTY_SLOT_COLOR,
        legend={"orientation": "h", "y": -0.35 if rows <= 4 else -0.12},
        height=min(900, 200 + 40 * rows),
    )  # fmt: skip
    return fig


def ring_figure(slots: pd.DataFrame, layers: pd.DataFrame, strategy: str, step: int, layer: int) -> go.Figure:
    """The slots of one layer cache at one step, coloured by the absolute position each holds:
    ring caches from the ``slots`` table, append-only caches from their ``layers`` row."""
    info = _ring_info(slots, layers, strategy, step, layer)
    if info is None:
        return empty_figure("Slots", f"nothing recorded for {strategy} at step {step}, layer {layer}")
    return _ring_plot(info)


# --- inspector: attention masks -------------------------------------------------------------------


class MaskInfo(NamedTuple):
    strategy: str
    step: int
    layer: int
    order: str  # "slot" or "temporal"
    visible: np.ndarray  # (queries, keys) bool
    query_positions: np.ndarray  # (queries,)
    key_positions: np.ndarray  # (keys,) absolute position per column, -1 for an empty slot
    key_slots: np.ndarray  # (keys,) slot index per column
    color: str


def _mask_info(masks: pd.DataFrame, strategies: Sequence[str], strategy: str, step: int, layer: int, order: str):
    if order not in ("slot", "temporal"):
        raise ValueError(f"order must be 'slot' or 'temporal', got {order!r}")
    rows = masks[(masks["strategy"] == strategy) & (masks["step"] == step) & (masks["layer"] == layer)]
    if not len(rows):
        return None
    rows = rows.sort_values("query")
    visible = np.array([[c == "1" for c in str(m)] for m in rows["mask"]], dtype=bool).reshape(len(rows), -1)
    text = str(rows.iloc[0]["key_positions"]).strip()
    keys = np.array([int(p) for p in text.split()] if text else [], dtype=np.int64)[: visible.shape[1]]
    slots = np.arange(len(keys))
    visible = visible[:, : len(keys)]
    if order == "temporal":
        # Columns by the position each key holds; empty slots hold nothing and drop out.
        sel = np.flatnonzero(keys >= 0)
        sel = sel[np.argsort(keys[sel], kind="stable")]
        visible, keys, slots = visible[:, sel], keys[sel], slots[sel]
    return MaskInfo(
        strategy, step, layer, order, visible, _floats(rows["query_position"]).astype(np.int64), keys, slots,
        strategy_colors(strategies).get(strategy, PALETTE[0]),
    )  # fmt: skip


def _mask_plot(info: MaskInfo) -> go.Figure:
    q, k = info.visible.shape
    x = info.key_slots if info.order == "slot" else info.key_positions
    keys_text = np.broadcast_to(info.key_positions, (q, k))
    slots_text = np.broadcast_to(info.key_slots, (q, k))
    fig = go.Figure(
        go.Heatmap(
            z=info.visible.astype(np.int8), x=x, y=info.query_positions, zmin=0, zmax=1,
            colorscale=[[0, "#f2f2f2"], [1, info.color]], showscale=False, xgap=0.5, ygap=0.5,
            customdata=np.dstack([keys_text, slots_text]),
            hovertemplate="query position %{y}<br>key slot %{customdata[1]} holds position %{customdata[0]}"
            "<br>visible: %{z}<extra></extra>",
        )
    )  # fmt: skip
    seen = int(info.visible[-1].sum()) if q else 0
    where = "key slot (the order the cache returns keys)" if info.order == "slot" else "key position (temporal order)"
    fig.update_layout(
        title=f"mask, {info.order} order · step {info.step} · layer {info.layer}: last query sees {seen} of {k} keys",
        xaxis_title=where,
        yaxis_title="query position",
        height=max(220, min(520, 120 + 8 * q)),
    )
    fig.update_yaxes(autorange="reversed", type="category" if q <= 1 else "linear")
    return fig


def mask_figure(
    masks: pd.DataFrame, strategies: Sequence[str], strategy: str, step: int, layer: int, order: str = "slot"
) -> go.Figure:
    """The boolean attention mask (query x key) a layer cache produced at one step, with the keys
    in slot order or sorted by the position they hold (temporal order)."""
    info = _mask_info(masks, strategies, strategy, step, layer, order)
    if info is None:
        return empty_figure("Attention mask", f"no mask recorded for {strategy} at step {step}, layer {layer}")
    return _mask_plot(info)


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
    info = HeatmapInfo(f"{strategy}: {ERROR_COLUMNS[column]} per layer and step", z, steps, layer_ids, None, "")
    return _heatmap_plot(info, colorscale="Magma")


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
    layer = _floats(at["layer"]).astype(np.int64)
    return ErrorBarsInfo(strategy, shown, layer, _floats(at["key_rel_rms"]), _floats(at["value_rel_rms"]), color)


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
        title=f"{strategy}: relative RMS error per layer at step {info.step}{note}",
        xaxis_title="layer",
        yaxis_title="‖x − deq(q(x))‖ / ‖x‖",
        barmode="group",
        height=360,
        legend={"orientation": "h", "y": -0.2},
    )
    return fig

