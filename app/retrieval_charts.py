"""The needle-in-a-haystack heatmap: retrieval samples in, plotly figure out.

``retrieval_heatmap_info(samples)`` reduces the rows of :func:`cachelib.profile.retrieval.retrieval`
(one per strategy x context x depth x trial) to exact-match accuracy per strategy on a shared
context x depth grid; ``retrieval_heatmap(info)`` draws one heatmap per strategy, side by side, on
one colour scale from 0 (never retrieved) to 1 (always). No Streamlit, no I/O.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .figures import empty_figure

REQUIRED = ("strategy", "context", "depth", "exact_match")
COLORSCALE = [[0.0, "#D55E00"], [0.5, "#F0E442"], [1.0, "#009E73"]]  # failed -> solved
PANELS_PER_ROW = 4


class RetrievalHeatmapInfo(NamedTuple):
    strategies: list[str]  # in the samples' order
    contexts: list[int]  # x axis, ascending
    depths: list[float]  # y axis, ascending (0 = needle at the start of the filler)
    accuracy: dict[str, np.ndarray]  # strategy -> (len(depths), len(contexts)) mean exact match; NaN: not measured
    trials: dict[str, np.ndarray]  # strategy -> trials behind each cell (0: not measured)
    kept_fraction: dict[str, np.ndarray]  # strategy -> mean kept fraction per cell (NaN where unknown)
    title: str  # model, backend and task the samples come from


def retrieval_heatmap_info(samples: pd.DataFrame) -> RetrievalHeatmapInfo:
    """Accuracy (mean exact match over trials) per strategy x depth x context."""
    missing = [c for c in REQUIRED if c not in samples.columns]
    if missing:
        raise ValueError(f"retrieval samples lack the column(s) {', '.join(missing)}")
    frame = samples.dropna(subset=list(REQUIRED))
    strategies = list(dict.fromkeys(frame["strategy"].astype(str)))
    contexts = sorted({int(c) for c in frame["context"]})
    depths = sorted({float(d) for d in frame["depth"]})
    shape = (len(depths), len(contexts))
    accuracy, trials, kept = {}, {}, {}
    for s in strategies:
        accuracy[s], trials[s], kept[s] = np.full(shape, np.nan), np.zeros(shape, dtype=int), np.full(shape, np.nan)
    if len(frame):
        cells = frame.assign(
            strategy=frame["strategy"].astype(str),
            context=frame["context"].astype(int),
            depth=frame["depth"].astype(float),
            exact_match=pd.to_numeric(frame["exact_match"], errors="coerce"),
            kept_fraction=pd.to_numeric(frame["kept_fraction"], errors="coerce")
            if "kept_fraction" in frame
            else np.nan,
        ).groupby(["strategy", "depth", "context"], sort=False)
        stats = cells.agg(
            accuracy=("exact_match", "mean"), trials=("exact_match", "count"), kept=("kept_fraction", "mean")
        )
        for (s, depth, context), row in stats.iterrows():
            i, j = depths.index(depth), contexts.index(context)
            accuracy[s][i, j], trials[s][i, j], kept[s][i, j] = row["accuracy"], row["trials"], row["kept"]
    return RetrievalHeatmapInfo(strategies, contexts, depths, accuracy, trials, kept, _title(frame))


def _title(frame: pd.DataFrame) -> str:
    parts = []
    for col in ("model", "backend", "task"):
        if col in frame.columns:
            values = list(dict.fromkeys(frame[col].dropna().astype(str)))
            if values:
                parts.append(", ".join(values))
    return "Retrieval accuracy" + (f" ({'; '.join(parts)})" if parts else "")


def retrieval_heatmap(info: RetrievalHeatmapInfo) -> go.Figure:
    """Small multiples: one heatmap per strategy, context on x, needle depth on y, exact-match
    accuracy on one colour scale 0..1 shared by all panels."""
    if not info.strategies:
        return empty_figure("Retrieval accuracy", "no retrieval samples")
    n = len(info.strategies)
    cols = min(n, PANELS_PER_ROW)
    rows = -(-n // cols)
    fig = make_subplots(
        rows=rows,
        cols=cols,
        subplot_titles=info.strategies,
        shared_yaxes=True,
        horizontal_spacing=0.03,
        vertical_spacing=0.5 / rows,
    )
    x = [f"{c:,}" for c in info.contexts]  # categories: contexts are usually powers of two
    y = [f"{d:g}" for d in info.depths]
    for i, s in enumerate(info.strategies):
        row, col = i // cols + 1, i % cols + 1
        acc, n_trials, kept = info.accuracy[s], info.trials[s], info.kept_fraction[s]
        text = [[("" if np.isnan(a) else f"{a:.0%}") for a in line] for line in acc]
        custom = np.dstack([n_trials, kept])
        fig.add_trace(
            go.Heatmap(
                z=acc,
                x=x,
                y=y,
                coloraxis="coloraxis",
                text=text,
                texttemplate="%{text}",
                customdata=custom,
                hovertemplate=(
                    f"{s}<br>context %{{x}} tokens<br>depth %{{y}}<br>accuracy %{{z:.0%}}"
                    "<br>trials %{customdata[0]}<br>kept fraction %{customdata[1]:.3f}<extra></extra>"
                ),
            ),
            row=row,
            col=col,
        )
        fig.update_xaxes(title_text="context (tokens)", type="category", row=row, col=col)
        fig.update_yaxes(type="category", autorange="reversed", row=row, col=col)
        if col == 1:
            fig.update_yaxes(title_text="needle depth (0 = start)", row=row, col=col)
    fig.update_layout(
        title=info.title,
        coloraxis={
            "colorscale": COLORSCALE,
            "cmin": 0.0,
            "cmax": 1.0,
            "colorbar": {"title": "exact match", "tickformat": ".0%"},
        },
        height=80 + 260 * rows,
        margin={"t": 70, "b": 10},
    )
    return fig
