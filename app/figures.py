"""What every figure module of the app shares: one colour per strategy, legends that stay out of
the plot, the sampling period of a probe read from the steps it recorded, and the figure drawn
where there is nothing to draw. :mod:`app.charts` (profiles) and :mod:`app.plan_charts` (the
planner) both import it; neither imports the other."""

from __future__ import annotations

import plotly.graph_objects as go

from cachelib.profile.figure_data import sampling_period
from cachelib.profile.palette import PALETTE, REFERENCE_COLOR, legend_below, strategy_colors

__all__ = [
    "PALETTE",
    "REFERENCE_COLOR",
    "LEGEND_RIGHT",
    "below_toolbar",
    "empty_figure",
    "legend_below",
    "sampling_period",
    "strategy_colors",
]

# One palette, byte unit and legend rule for the app and the HTML report (they live in cachelib,
# which the report is part of); LEGEND_RIGHT stays for figures of few, short entries.
LEGEND_RIGHT = {
    "orientation": "v",
    "x": 1.02,
    "xanchor": "left",
    "y": 1.0,
    "yanchor": "top",
    "font": {"size": 11},
}
TOOLBAR_PX = 36  # plotly's toolbar (top right, on hover): a title starts below it


def below_toolbar(fig: go.Figure) -> go.Figure:
    """Move ``fig``'s title below plotly's toolbar, growing the top margin to match (at 800 px a
    centred title ran under the toolbar's buttons). Idempotent: figures are kept and drawn again."""
    title = fig.layout.title
    if not title or not title.text or fig.layout.meta == "below_toolbar":
        return fig
    height = fig.layout.height or 450
    lines = str(title.text).count("<br>") + 1
    top = TOOLBAR_PX + 22 * lines + 12
    margin = fig.layout.margin.t if fig.layout.margin.t is not None else 80
    if margin < top:  # the plot keeps its own height: the figure grows by what the margin grows
        fig.update_layout(height=height + top - margin, margin={"t": top})
    # Pixels from the figure's top (pad), whatever height the figure is drawn at; plotly lifts a
    # title of several lines by the lines after the first (measured: 16-17 px each, Chromium).
    fig.update_layout(
        title={
            "yref": "container",
            "y": 1,
            "yanchor": "top",
            "pad": {"t": TOOLBAR_PX + 18 * (lines - 1)},
            "x": 0,
            "xref": "paper",
            "xanchor": "left",
        },
        meta="below_toolbar",
    )
    return fig


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
