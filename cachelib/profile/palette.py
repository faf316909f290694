"""What every figure of profiles shares, in the app and in the HTML report alike: one colour per
strategy (by its place in the run's order, so a strategy has the same colour on every page and in
every report of the same profiles), the grey of the full-cache reference, binary byte units
(MiB = 2^20 bytes, as the summary tables count), and a legend under the plot that grows the
figure instead of squeezing the plot, however many series there are."""

from __future__ import annotations

from typing import Sequence

# Okabe-Ito (colour-blind safe, yellow left out: unreadable on white), then Tol's muted and
# light sets: 20 distinct colours before one repeats.
PALETTE = (
    "#0072B2",
    "#E69F00",
    "#009E73",
    "#CC79A7",
    "#D55E00",
    "#56B4E9",
    "#000000",
    "#882255",
    "#117733",
    "#999933",
    "#44AA99",
    "#AA4499",
    "#332288",
    "#DDCC77",
    "#CC6677",
    "#88CCEE",
    "#661100",
    "#6699CC",
    "#AAAA00",
    "#EE8866",
)
REFERENCE_COLOR = "#7f7f7f"  # the full cache holding every token so far (drawn dotted)

KIB, MIB, GIB = 2**10, 2**20, 2**30
BYTE_UNIT = "MiB"  # byte axes: values divided by MIB, ticks plain numbers


def strategy_colors(strategies: Sequence[str]) -> dict[str, str]:
    """The colour of each strategy, by its place in ``strategies`` (the run's full order, the
    baseline first; for several profiles, each profile's strategies in turn). Pass the full order
    even when a figure shows a subset: a strategy keeps its colour whichever others are shown."""
    return {s: PALETTE[i % len(PALETTE)] for i, s in enumerate(strategies)}


LEGEND_ROW = 19  # pixels per legend entry (font 11)


def legend_below(fig, plot_height: int, top: int = 80, bottom: int = 50):
    """Put ``fig``'s legend under its plot, one entry a row, and size the figure so the plot area
    stays ``plot_height`` pixels high whatever the entry count (a legend beside the plot takes its
    width from the plot: 15 entries left a half-width chart 60 px wide). Returns ``fig``."""
    entries = sum(1 for t in fig.data if t.showlegend is not False and t.name)
    legend_px = entries * LEGEND_ROW + 8 if entries else 0
    fig.update_layout(
        height=top + plot_height + bottom + legend_px,
        margin={"t": top, "b": bottom + legend_px},
        showlegend=bool(entries),
        legend={
            "orientation": "v",
            "yref": "container",
            "y": 0,
            "yanchor": "bottom",
            "x": 0,
            "xanchor": "left",
            "font": {"size": 11},
            "tracegroupgap": 0,
        },
    )
    return fig
