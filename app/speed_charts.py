"""The Planner page's speed section: decode tokens/s per session and per device, the time to
first token, and the frontier of sessions against tokens/s per session for each strategy at the
target context. The numbers come from :func:`cachelib.plan.speed.speed_report` and
:func:`cachelib.plan.speed.speed_frontier` (what ``python -m cachelib plan --hardware NAME``
prints); this module only lays them out and draws them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from cachelib.plan.hardware import hardware_names
from cachelib.plan.speed import FrontierPoint, SpeedModel, speed_frontier, speed_report

from .figures import empty_figure, strategy_colors

NONE = "(no speed)"


def speed_frontier_figure(
    points: Sequence[FrontierPoint], strategies: Sequence[str], *, min_tokens_per_s=None, title: str = ""
) -> go.Figure:
    """Sessions (x) against decode tokens/s per session (y), one line per strategy with its
    interval as a band; sessions past what memory fits are dotted."""
    if not points:
        return empty_figure(title or "Speed frontier", "nothing planned")
    colors = strategy_colors(list(strategies))
    fig = go.Figure()
    frame = pd.DataFrame(points, columns=FrontierPoint._fields)
    for spec in strategies:
        rows = frame[frame.strategy == spec].sort_values("sessions")
        if rows.empty:
            continue
        color = colors.get(spec, "#888")
        band = pd.concat([rows, rows.iloc[::-1]])
        fig.add_scatter(
            x=band.sessions,
            y=list(rows.high) + list(rows.low.iloc[::-1]),
            fill="toself",
            line_width=0,
            fillcolor=color,
            opacity=0.15,
            hoverinfo="skip",
            showlegend=False,
            legendgroup=spec,
        )
        for fits, dash in ((True, "solid"), (False, "dot")):
            part = rows[rows.fits == fits]
            if part.empty:
                continue
            fig.add_scatter(
                x=part.sessions,
                y=part.tokens_per_s,
                mode="lines+markers",
                name=spec if fits else None,
                line={"color": color, "dash": dash},
                legendgroup=spec,
                showlegend=fits,
                customdata=part.aggregate_tokens_per_s,
                hovertemplate=f"{spec}<br>%{{x}} sessions: %{{y:.1f}} tokens/s each, "
                "%{customdata:,.0f} in all<extra></extra>",
            )
    if min_tokens_per_s is not None:
        fig.add_hline(
            y=min_tokens_per_s, line_dash="dash", line_color="#888", annotation_text=f">= {min_tokens_per_s:g} tokens/s"
        )
    fig.update_layout(
        title=title or "Sessions against decode tokens/s per session",
        height=380,
        xaxis_title="concurrent sessions (dotted: past what memory fits)",
        yaxis_title="decode tokens/s per session",
        margin={"t": 50, "b": 40},
    )
    return fig


def speed_values() -> dict:
    """The speed section's fields as the plan's request takes them: ``plan_hardware`` (None for no
    speed) and ``plan_min_tokens_per_s``."""
    name = st.session_state.get("plan_hardware", NONE)
    return {
        "plan_hardware": None if name == NONE else name,
        "plan_min_tokens_per_s": st.session_state.get("plan_min_tokens_per_s"),
    }


def speed_section(planned) -> None:
    """The page's speed fields, table and frontier for ``planned`` (the page's Planned plan)."""
    st.subheader("Speed")
    left, right = st.columns(2)
    name = left.selectbox(
        "Hardware",
        [NONE, *hardware_names()],
        key="plan_hardware",
        help="published peaks with their sources; cpu probes this machine",
    )
    wanted = right.number_input(
        "Min tokens/s per session",
        min_value=0.0,
        value=None,
        key="plan_min_tokens_per_s",
        help="the most sessions that each decode at least this fast, judged by the low end of the speed interval",
    )
    if name == NONE:
        st.caption("Pick a device to plan decode tokens/s and the time to first token (`--hardware NAME`).")
        return
    arch, fits = planned.arch, planned.fits
    try:
        request = replace(planned.result.request, hardware=name, min_tokens_per_s=wanted)
        report = planned.speed  # the plan's own, computed with the answer from these fields
        if report is None or request != planned.result.request:  # none (its error, said here) or an older plan's
            report = speed_report(arch, request, fits, flash_attn=request.flash_attn != "off")
        points = speed_frontier(SpeedModel(arch, request, name), fits)
    except ValueError as e:
        st.error(str(e))
        return
    hw, eff = report.hardware, report.efficiency
    st.caption(
        f"{hw.name}: {hw.bandwidth / 1e9:,.0f} GB/s ({'; '.join(hw.sources)}). The runtime reaches "
        f"{eff.bandwidth_fraction:.0%} of the bandwidth, {eff.compute_fraction:.0%} of the compute, "
        f"+{eff.overhead_s * 1e3:.2f} ms per step, interval ±{eff.spread:.0%}: {eff.source}. "
        f"`python -m cachelib plan ... --hardware {name}` prints the same."
    )
    st.dataframe(pd.DataFrame(report.rows()), hide_index=True, width="stretch", key="plan_speed_table")
    for line in [s.explain() for s in report.speeds] + report.speedups:
        st.caption(line)
    title = f"Sessions against tokens/s per session at {request.context:,} tokens on {name}"
    fig = speed_frontier_figure(points, [f.spec for f in fits], min_tokens_per_s=wanted, title=title)
    st.plotly_chart(fig, key="plan_speed_frontier")
