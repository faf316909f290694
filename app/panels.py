"""Page sections shared by the Live comparison and Profiles pages: the same charts for a live
run, a finished one, or several profiles side by side. Layout only; figures come from
:mod:`app.charts`, numbers from :mod:`app.data`."""

from __future__ import annotations

import streamlit as st

from . import charts
from .data import SUMMARY_DISPLAY, RunView
from .keys import Keys

PLOTLY_CONFIG = {"displaylogo": False}


def status(view: RunView) -> None:
    """Say plainly whether the run finished, and why not when it did not."""
    if view.complete:
        return
    if view.status == "running":
        return
    st.warning(f"**Incomplete profile** — {view.reason or 'the run did not finish'}", icon=":material/warning:")


def summary(view: RunView) -> None:
    table = view.summary
    if not len(table):
        return
    colors = charts.strategy_colors(view.strategies)
    shown = table.rename(columns=SUMMARY_DISPLAY)
    styled = view.figure(("summary",), lambda: _styled(shown, colors))
    st.dataframe(styled, hide_index=True, width="stretch")


def _styled(shown, colors: dict[str, str]):
    return shown.style.format(
        {
            "peak MiB allocated": "{:,.2f}",
            "bytes/token": "{:,.0f}",
            "mean KL (nats)": "{:.4g}",
            "top-1 agreement": "{:.1%}",
            "tokens/s": "{:.1f}",
        },
        na_rep="–",
    ).map(lambda s: f"color: {colors.get(s, '#000')}; font-weight: 600", subset=["strategy"])


def charts_grid(view: RunView, key: str) -> None:
    """Memory, quality, per-layer memory and speed charts of ``view``, plus the summary table."""
    status(view)
    summary(view)
    left, right = st.columns(2)
    with left:
        fig = view.figure("memory", lambda: charts.cache_memory_figure(view.steps, view.strategies, view.reference))
        st.plotly_chart(fig, key=f"{key}_memory", config=PLOTLY_CONFIG)
    with right:
        fig = view.figure("quality", lambda: charts.quality_figure(view.steps, view.strategies, view.baselines))
        st.plotly_chart(fig, key=f"{key}_quality", config=PLOTLY_CONFIG)
    left, right = st.columns(2)
    with left:
        present = [s for s in view.strategies if (view.layers["strategy"] == s).any()] or view.strategies
        a, b = st.columns([3, 2])
        strategy = a.selectbox("Per-layer memory of", present, key=Keys.layer_strategy(key))
        value = b.selectbox(
            "showing", list(charts.LAYER_VALUES), key=Keys.layer_value(key),
            format_func=lambda v: charts.LAYER_VALUES[v][0],
        )  # fmt: skip
        fig = view.figure(
            ("layers", strategy, value), lambda: charts.layer_heatmap_figure(view.layers, strategy or "", value)
        )
        st.plotly_chart(fig, key=f"{key}_layers", config=PLOTLY_CONFIG)
    with right:
        fig = view.figure("speed", lambda: charts.speed_figure(view.steps, view.strategies))
        st.plotly_chart(fig, key=f"{key}_speed", config=PLOTLY_CONFIG)


def describe(view: RunView) -> str:
    m = view.meta
    if not m:
        return view.name
    what = m.get("prompt", "")
    what = (what[:80] + "…") if len(what) > 80 else what
    return (
        f"**{view.name}** · {m.get('model', '')} on {m.get('backend', '')}/{m.get('device', '')} · "
        f"{m.get('mode', '')} · {m.get('steps_completed', '?')}/{m.get('max_tokens', '?')} steps · “{what}”"
    )
