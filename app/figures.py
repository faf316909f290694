"""What every figure module of the app shares: one colour per strategy, and the figure drawn
where there is nothing to draw. :mod:`app.charts` (profiles) and :mod:`app.plan_charts` (the
planner) both import it; neither imports the other."""

from __future__ import annotations

from typing import Sequence

import plotly.graph_objects as go

# Okabe-Ito (colour-blind safe, yellow left out: unreadable on white), then Tol's muted set.
PALETTE = (
    "#0072B2", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9", "#000000",
    "#882255", "#117733", "#999933", "#44AA99", "#AA4499", "#332288", "#DDCC77",
)  # fmt: skip


def strategy_colors(strategies: Sequence[str]) -> dict[str, str]:
    """The colour of each strategy, by its place in the run's order (the baseline is first)."""
    return {s: PALETTE[i % len(PALETTE)] for i, s in enumerate(strategies)}


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
