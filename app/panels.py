"""Page sections shared by the Live comparison and Profiles pages: the same charts for a live
run, a finished one, or several profiles side by side. Layout only; figures come from
:mod:`app.charts`, numbers from :mod:`app.data`."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from cachelib.core.units import human_bytes

from . import charts
from .data import SUMMARY_DISPLAY, RunView
from .keys import Keys
from .plain import md

PLOTLY_CONFIG = {"displaylogo": False}


def status(view: RunView) -> None:
    """Say plainly whether the run finished, and why not when it did not."""
    if view.complete:
        return
    if view.status == "running":
        return
    st.warning(f"**Incomplete profile** — {md(view.reason or 'the run did not finish')}", icon=":material/warning:")


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
        layers = table_when_asked(view, "layers", key, "Per-layer memory")
        if layers is not None:
            present = [s for s in view.strategies if (layers["strategy"] == s).any()] or view.strategies
            a, b = st.columns([3, 2])
            strategy = a.selectbox("Per-layer memory of", present, key=Keys.layer_strategy(key))
            value = b.selectbox(
                "showing", list(charts.LAYER_VALUES), key=Keys.layer_value(key),
                format_func=lambda v: charts.LAYER_VALUES[v][0],
            )  # fmt: skip
            fig = view.figure(
                ("layers", strategy, value), lambda: charts.layer_heatmap_figure(layers, strategy or "", value)
            )
            st.plotly_chart(fig, key=f"{key}_layers", config=PLOTLY_CONFIG)
    with right:
        fig = view.figure("speed", lambda: charts.speed_figure(view.steps, view.strategies))
        st.plotly_chart(fig, key=f"{key}_speed", config=PLOTLY_CONFIG)


def table_when_asked(view: RunView, table: str, key: str, what: str) -> pd.DataFrame | None:
    """``view``'s ``table`` for a figure: read now, or, for a large profile's table not yet read,
    when the user asks (a toggle that says the file's size); None until then, or when the table
    is malformed (one line naming the file, line and column)."""
    if view.large and not view.loaded(table):
        size = human_bytes(view.size_bytes)
        if not st.toggle(f"{what}: read the {table} table ({size} profile)", key=Keys.read_table(key, table)):
            return None
    try:
        with st.spinner(f"Reading the {table} table…"):
            return view.tables[table]
    except ValueError as e:
        st.error(md(e))
        return None


def describe(view: RunView) -> str:
    """One markdown line about the run; every piece of user text in it (name, model, prompt) is
    escaped, so it shows as the text it is (:func:`app.plain.md`)."""
    m = view.meta
    if not m:
        return md(view.name)
    what = m.get("prompt", "")
    what = (what[:80] + "…") if len(what) > 80 else what
    size = f" · {human_bytes(view.size_bytes)} file" if view.size_bytes is not None else ""
    return (
        f"**{md(view.name)}** · {md(m.get('model', ''))} on {md(m.get('backend', ''))}/{md(m.get('device', ''))} · "
        f"{md(m.get('mode', ''))} · {md(m.get('steps_completed', '?'))}/{md(m.get('max_tokens', '?'))} steps{size} · "
        f"“{md(what)}”"
    )
