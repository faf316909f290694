"""What every figure module of the app shares: one colour per strategy, legends that stay out of
the plot, the sampling period of a probe read from the steps it recorded, and the figure drawn
where there is nothing to draw. :mod:`app.charts` (profiles) and :mod:`app.plan_charts` (the
planner) both import it; neither imports the other."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import plotly.graph_objects as go

# Okabe-Ito (colour-blind safe, yellow left out: unreadable on white), then Tol's muted set:
# 14 distinct colours, so a run of up to 14 strategies never repeats one.
PALETTE = (
    "#0072B2", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9", "#000000",
    "#882255", "#117733", "#999933", "#44AA99", "#AA4499", "#332288", "#DDCC77",
)  # fmt: skip

# A vertical legend right of the plot area: plotly widens the right margin to fit it, so it
# never lies over the data however many entries it has.
LEGEND_RIGHT = {
    "orientation": "v", "x": 1.02, "xanchor": "left", "y": 1.0, "yanchor": "top", "font": {"size": 11},
}  # fmt: skip


def strategy_colors(strategies: Sequence[str]) -> dict[str, str]:
    """The colour of each strategy, by its place in the run's order (the baseline is first).

    Pass the run's full order even when a figure shows a subset: a strategy keeps its colour
    whichever others are shown. Past len(PALETTE) strategies the colours repeat."""
    return {s: PALETTE[i % len(PALETTE)] for i, s in enumerate(strategies)}


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


def empty_figure(title: str, message: str, *, height: int = 260) -> go.Figure:
    """A figure with no axes that says why there is nothing to draw."""
    fig = go.Figure()
    fig.update_layout(
        title=title,
        xaxis={"visible": False},
        yaxis={"visible": False},
        annotations=[{"text": message, "showarrow": False, "xref": "paper", "yref": "paper", "x": 0.5, "y": 0.5}],
        height=height,
    )
    return fig
