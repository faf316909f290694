"""Page sections shared by the Live comparison and Profiles pages: the same charts for a live
run, a finished one, or several profiles side by side. Layout only; figures come from
:mod:`app.charts`, numbers from :mod:`app.data`."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from cachelib.core.units import human_bytes

from . import charts
from .data import SUMMARY_DISPLAY, RunView, measured_on, probes_of
from .figures import below_toolbar
from .keys import Keys, kept
from .plain import md

PLOTLY_CONFIG = {"displaylogo": False}


def chart(fig, key: str) -> None:
    """Draw ``fig`` with the app's plotly settings, its title clear of plotly's toolbar."""
    st.plotly_chart(below_toolbar(fig), key=key, config=PLOTLY_CONFIG)


def status(view: RunView) -> None:
    """Say plainly whether the run finished, and why not when it did not."""
    if view.complete:
        return
    if view.status == "running":
        return
    st.warning(f"**Incomplete profile** — {md(view.reason or 'the run did not finish')}", icon=":material/warning:")


def summary(view: RunView) -> None:
    """The summary table, what its memory numbers were measured against, and each strategy's
    verdict in plain words as text under it (a table cell would cut it off)."""
    table = view.summary
    if not len(table):
        return
    colors = charts.strategy_colors(view.strategies)
    shown = table[[c for c in SUMMARY_DISPLAY if c in table]].rename(columns=SUMMARY_DISPLAY)
    styled = view.figure(("summary",), lambda: _styled(shown, colors))
    st.dataframe(styled, hide_index=True, width="stretch", column_config=SUMMARY_HEADS)
    st.caption(md(measured_on(table)))
    lines = [f"- **{md(s)}** — {md(v)}" for s, v in zip(table["strategy"], table["verdict"]) if v != "baseline"]
    if lines:
        st.markdown("**In plain words**\n\n" + "\n".join(lines))


# Short headers, the full name on hover, the strategy column pinned: ten columns fit a 1,400 px
# window without scrolling sideways (long "profile / strategy" labels end in "…", whole on hover).
SUMMARY_HEADS = {
    name: st.column_config.Column(short, help=name, width="small")
    if short != "strategy"
    else st.column_config.Column(short, help=name, width=260, pinned=True)
    for name, short in {
        "strategy": "strategy",
        "steps": "steps",
        "peak MiB allocated": "peak MiB",
        "MiB used": "MiB used",
        "tokens held": "tokens held",
        "bytes/token held": "B/token",
        "saved vs full cache": "saved",
        "mean KL (nats)": "mean KL",
        "top-1 agreement": "top-1",
        "tokens/s": "tokens/s",
    }.items()
}


def _styled(shown, colors: dict[str, str]):
    return shown.style.format(
        {
            "peak MiB allocated": "{:,.2f}",
            "MiB used": "{:,.2f}",
            "tokens held": "{:,.0f}",
            "bytes/token held": "{:,.0f}",
            "saved vs full cache": "{:.0%}",
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
    shown, multiples = strategy_picker(view, key)
    colors = charts.strategy_colors(view.strategies)  # the run's colours, whichever are shown
    picked = tuple(shown)
    left, right = st.columns(2)
    with left:
        fig = view.figure(
            ("memory", picked, multiples),
            lambda: charts.cache_memory_figure(view.steps, shown, view.reference, colors, multiples),
        )
        chart(fig, f"{key}_memory")
    with right:
        fig = view.figure(("quality", picked), lambda: charts.quality_figure(view.steps, shown, view.baselines, colors))
        chart(fig, f"{key}_quality")
    left, right = st.columns(2)
    with left:
        layers = table_when_asked(view, "layers", key, "Per-layer memory")
        if layers is not None:
            present = [s for s in view.strategies if (layers["strategy"] == s).any()] or view.strategies
            a, b = st.columns([3, 2])
            strategy = a.selectbox("Per-layer memory of", present, **kept(Keys.layer_strategy(key)))
            value = b.selectbox(
                "showing",
                list(charts.LAYER_VALUES),
                **kept(Keys.layer_value(key)),
                format_func=lambda v: charts.LAYER_VALUES[v][0],
            )
            fig = view.figure(
                ("layers", strategy, value), lambda: charts.layer_heatmap_figure(layers, strategy or "", value)
            )
            chart(fig, f"{key}_layers")
    with right:
        fig = view.figure(("speed", picked), lambda: charts.speed_figure(view.steps, shown, colors))
        chart(fig, f"{key}_speed")
    if note := sampling_note(view):
        st.caption(note)


LAYOUTS = {"auto": None, "one chart": False, "one panel per strategy": True}


def strategy_picker(view: RunView, key: str) -> tuple[list[str], bool | None]:
    """Which strategies the charts draw (all by default; an empty choice draws all), and the
    memory chart's layout (auto: one panel per strategy from charts.SMALL_MULTIPLES_FROM)."""
    options = list(view.strategies)
    if len(options) <= 2:
        return options, None
    k = Keys.shown(key)
    if k in st.session_state:  # the run changed under a kept choice: drop what it no longer has
        st.session_state[k] = [s for s in st.session_state[k] if s in options]
    a, b = st.columns([4, 2], vertical_alignment="bottom")
    chosen = a.multiselect(
        "Strategies shown",
        options,
        default=options if k not in st.session_state else None,
        **kept(k),
        help="the charts draw these; each strategy keeps its colour whichever are shown",
    )
    layout = b.selectbox(
        "Memory chart",
        list(LAYOUTS),
        **kept(Keys.layout(key)),
        help=f"auto: one panel per strategy from {charts.SMALL_MULTIPLES_FROM} strategies shown, where lines overlap",
    )
    if not chosen:
        st.caption("No strategy picked: the charts show all of them.")
    return [s for s in options if s in chosen] or options, LAYOUTS[layout]


CHARTED_PROBES = ("memory", "quality", "system")  # the probes whose rows these charts draw


def sampling_note(view: RunView) -> str:
    """Which of the charted probes recorded only every k-th step, and how the charts draw that."""
    probes = probes_of(view.meta)
    sampled = {k: probes[k] for k in CHARTED_PROBES if isinstance(probes.get(k), int) and probes[k] > 1}
    if not sampled:
        return ""
    what = ", ".join(f"{k} every {v} steps" for k, v in sampled.items())
    return (
        f"Sampled probes in this run: {what} (and the last step). Lines join the recorded steps "
        "and mark each one; nothing is drawn for the steps in between."
    )


def table_when_asked(view: RunView, table: str, key: str, what: str) -> pd.DataFrame | None:
    """``view``'s ``table`` for a figure: read now, or, for a large profile's table not yet read,
    when the user asks (a toggle that says the file's size); None until then, or when the table
    is malformed (one line naming the file, line and column)."""
    if view.large and not view.loaded(table):
        size = human_bytes(view.size_bytes)
        if not st.toggle(f"{what}: read the {table} table ({size} profile)", **kept(Keys.read_table(key, table))):
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
