"""A comparison of profiles as one self-contained HTML file, and the token streams of a run.

:func:`report_html` turns one or more profiles into a page a teammate opens with no network and
no cachelib: what ran (model, backend, dtype, mode, prompt), the summary table of
:func:`~cachelib.profile.summarize` with each strategy's verdict in plain words, and the figures
(cache memory per step against the full cache, quality against each profile's baseline, decode
speed), drawn with plotly and with plotly.js inlined once. The app's download button and
``python -m cachelib report`` both call it.

Each figure is ``*_info(tables) -> NamedTuple`` from :mod:`cachelib.profile.figure_data` (the data
behind it, the very series, names and colours the app's figure draws) then ``*_plot(info) ->
go.Figure``. Sampled probes (``memory=4``) leave steps empty: the lines join the recorded steps,
so a sampled profile never draws an empty chart.

:func:`token_streams` reads what each strategy predicted at each step (``token_id``) and where it
first departs from the baseline's choice; it knows no tokenizer (the caller decodes).
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import pandas as pd
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from .. import __version__
from .figure_data import (
    FigureTables,
    MemoryInfo,
    QualityInfo,
    SpeedInfo,
    figure_tables,
    memory_info,
    quality_info,
    sampled_note,
    speed_info,
)
from .palette import BYTE_UNIT, MIB, REFERENCE_COLOR, legend_below
from .store import Profile
from .summary import summarize, verdict

PLOT_PX = 340  # the plot area's height; each figure's legend, under it, adds its own rows


@dataclass(frozen=True)
class ReportRun:
    """What the report reads of one profile: its name, metadata and steps table."""

    name: str
    meta: dict
    steps: pd.DataFrame

    @classmethod
    def of(cls, profile: Profile, name: str | None = None) -> "ReportRun":
        return cls(
            name or profile.name or str(profile.meta.get("run_id", "run")), dict(profile.meta), profile.frame("steps")
        )

    @property
    def strategies(self) -> list[str]:
        return Profile(self.meta).strategies

    @property
    def baseline(self) -> str:
        return str(self.meta.get("baseline", ""))


# --- the figures ----------------------------------------------------------------------------


def report_tables(runs: Sequence[ReportRun]) -> FigureTables:
    """The tables the figures read: the runs' steps relabelled as the app's combined view does."""
    return figure_tables([(r.name, r.meta, r.steps) for r in runs])


def _scatter(x, y, name: str, color: str, *, dash: str = "solid", group: str | None = None, **more) -> go.Scatter:
    return go.Scatter(
        x=x,
        y=y,
        name=name,
        mode="lines+markers" if len(x) < 40 else "lines",
        line=dict(color=color, dash=dash),
        marker=dict(size=4),
        legendgroup=group or name,
        **more,
    )


def _layout(fig: go.Figure, title: str, plot_px: int = PLOT_PX) -> go.Figure:
    # The legend sits under the plot, one entry a row, in room of its own: the plot keeps its
    # size and no line or axis title is covered, however many strategies there are.
    fig.update_layout(title=title, template="plotly_white", margin=dict(l=60, r=20))
    return legend_below(fig, plot_px, top=60, bottom=50)


def memory_plot(info: MemoryInfo) -> go.Figure:
    """Used (solid) and allocated (dashed) bytes per strategy, and the full cache (dotted), in MiB."""
    fig = go.Figure()
    # One legend entry per strategy: its used and allocated lines toggle together.
    for s in info.series:
        for kind, dash in (("used", "solid"), ("allocated", "dash")):
            y = s.values[kind] / MIB
            fig.add_trace(_scatter(s.step, y, s.strategy, s.color, dash=dash, meta=kind, showlegend=kind == "used"))
    for label, (x, y) in info.references.items():
        fig.add_trace(_scatter(x, y / MIB, label, REFERENCE_COLOR, dash="dot", meta="reference"))
    fig.update_xaxes(title="step")
    fig.update_yaxes(title=f"{BYTE_UNIT} (all layers)")  # binary units, as the summary table's
    title = "Cache memory: used (solid), allocated (dashed), full cache (dotted)" + sampled_note(info.every, "memory")
    return _layout(fig, title)


def quality_plot(info: QualityInfo) -> go.Figure:
    """KL per step (top) and the running top-1 agreement in % (bottom), per non-baseline strategy."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08)
    for s in info.series:
        fig.add_trace(_scatter(s.step, s.values["kl"], s.strategy, s.color, meta="kl"), row=1, col=1)
        agreement = s.values["agreement"] * 100
        fig.add_trace(
            _scatter(s.step, agreement, s.strategy, s.color, meta="agreement", showlegend=False), row=2, col=1
        )
    fig.update_yaxes(title="KL (nats)", row=1, col=1)
    fig.update_yaxes(title="top-1 agreement (%)", range=[0, 101], row=2, col=1)
    fig.update_xaxes(title="step", row=2, col=1)
    return _layout(fig, "Quality vs the baseline: KL per step, and top-1 agreement so far", PLOT_PX + 100)


def speed_plot(info: SpeedInfo) -> go.Figure:
    """Decode tokens/s per strategy (top) and the process's device-active and RSS memory (bottom)."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08)
    for s in info.series:
        rate = s.values["tokens_per_second"]
        fig.add_trace(_scatter(s.step, rate, s.strategy, s.color, meta="tokens_per_second"), row=1, col=1)
    for line in info.process:
        fig.add_trace(
            _scatter(line.step, line.bytes / MIB, line.name, line.color, dash=line.dash, meta=line.counter),
            row=2,
            col=1,
        )
    fig.update_yaxes(title="tokens/s", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title=f"process {BYTE_UNIT}", row=2, col=1)
    fig.update_xaxes(title="step", row=2, col=1)
    return _layout(fig, "Decode speed of each strategy's forward pass, and the process's memory", PLOT_PX + 100)


def report_figures(runs: Sequence[ReportRun]) -> dict[str, go.Figure]:
    """The report's figures by name, each drawn from the info the app's figure draws."""
    t = report_tables(runs)
    return {
        "memory": memory_plot(memory_info(t.steps, t.strategies, t.reference, t.colors)),
        "quality": quality_plot(quality_info(t.steps, t.strategies, t.baselines, t.colors)),
        "speed": speed_plot(speed_info(t.steps, t.strategies, t.colors)),
    }


# --- token streams --------------------------------------------------------------------------


class TokenStream(NamedTuple):
    """What one strategy predicted at each step (``token_id``), against the baseline."""

    strategy: str
    steps: list[int]
    token_ids: list[int]
    first_departure: int | None  # the first step whose token differs from the baseline's
    baseline_token: int | None  # the baseline's token at that step
    differing_steps: int  # steps whose token differs from the baseline's (of the steps both recorded)


def token_streams(steps: pd.DataFrame, strategies: Sequence[str], baseline: str) -> list[TokenStream]:
    """Per strategy, in order: its tokens and where they first depart from the baseline's. In a
    free-running run these are the strategy's own text; teacher-forced, every strategy is fed
    the baseline's tokens and these are its greedy choices at each step."""

    def tokens(strategy: str) -> pd.Series:
        rows = steps[(steps["strategy"] == strategy) & steps["token_id"].notna()].sort_values("step")
        return pd.Series(rows["token_id"].astype(int).to_numpy(), index=rows["step"].astype(int).to_numpy())

    base = tokens(baseline)
    out = []
    for strategy in strategies:
        mine = tokens(strategy)
        common = mine.index.intersection(base.index)
        differs = [int(s) for s in common if mine[s] != base[s]]
        first = differs[0] if differs else None
        out.append(
            TokenStream(
                strategy,
                mine.index.tolist(),
                mine.tolist(),
                first,
                int(base[first]) if first is not None else None,
                len(differs),
            )
        )
    return out


def decoder_for(meta: dict) -> Callable[[list[int]], str] | None:
    """``ids -> text`` with the tokenizer of the model a profile names (its ``model_source``: the
    bundled GGUF, or a model folder), or None when that is not on this machine."""
    from ..models import folder, gguf

    source = Path(str(meta.get("model_source", "") or ""))
    try:
        if source.suffix == ".gguf" and source.is_file():
            tokenizer = gguf.load_tokenizer(str(source))
        elif str(source) not in ("", ".") and source.is_dir():
            tokenizer = folder.load_tokenizer(source)
        else:
            return None
    except (ValueError, OSError):
        return None
    return lambda ids: tokenizer.decode(list(ids))


class Segment(NamedTuple):
    text: str
    kind: str  # "same" (as the baseline), "departure" (the first differing token), "after", "instead"


def stream_segments(
    stream: TokenStream, base: TokenStream, mode: str, decode: Callable[[list[int]], str]
) -> list[Segment]:
    """``stream`` as text in pieces to style: up to its first departure as the baseline, the
    departing token, then (free-running) its own continuation, or (teacher-forced) the baseline's
    text it was fed on, with the baseline's token at the departure shown as what it replaced."""
    if stream.first_departure is None:
        return [Segment(decode(stream.token_ids), "same")]
    i = stream.steps.index(stream.first_departure)
    if mode == "free-running":
        parts = [
            Segment(decode(stream.token_ids[:i]), "same"),
            Segment(decode([stream.token_ids[i]]), "departure"),
            Segment(decode(stream.token_ids[i + 1 :]), "after"),
        ]
    else:
        j = base.steps.index(stream.first_departure)
        parts = [
            Segment(decode(base.token_ids[:j]), "same"),
            Segment(decode([stream.token_ids[i]]), "departure"),
            Segment(decode([base.token_ids[j]]), "instead"),
            Segment(decode(base.token_ids[j + 1 :]), "after"),
        ]
    return [p for p in parts if p.text]


# --- the HTML page --------------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1200px; padding: 0 1rem; color: #222; }
table { border-collapse: collapse; font-size: 0.9rem; margin: 0.5rem 0; }
th, td { border-bottom: 1px solid #ddd; padding: 0.3rem 0.6rem; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.wide { overflow-x: auto; }
.meta { color: #555; } .note { color: #555; font-size: 0.85rem; }
.stream { white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 0.85rem; background: #f7f7f7;
  padding: 0.5rem; }
.departure { background: #ffd54f; font-weight: 700; } .instead { text-decoration: line-through; color: #999; }
.after { color: #777; }
"""


def report_html(
    profiles: Sequence[Profile | ReportRun],
    names: Sequence[str] | None = None,
    title: str | None = None,
    decode: Callable[[list[int]], str] | Sequence[Callable[[list[int]], str] | None] | None = None,
) -> str:
    """One self-contained HTML page comparing ``profiles`` (plotly.js inlined: it opens offline).
    ``decode`` turns token ids into text for the token streams: one function for all, or one per
    profile (None: that profile's streams are left out)."""
    runs = [
        p if isinstance(p, ReportRun) else ReportRun.of(p, n) for p, n in zip(profiles, names or [None] * len(profiles))
    ]
    if not runs:
        raise ValueError("a report needs at least one profile")
    decoders = list(decode) if isinstance(decode, Sequence) else [decode] * len(runs)
    title = title or (
        f"cachelib profile: {runs[0].name}"
        if len(runs) == 1
        else "cachelib comparison: " + " + ".join(r.name for r in runs)
    )
    body = [
        f"<h1>{_e(title)}</h1>",
        f"<p class='note'>Made by cachelib {_e(__version__)} on {_now()}. Every number below was measured "
        "on the model, backend and dtype named with it.</p>",
    ]
    for run, decode_run in zip(runs, decoders):
        body += _run_section(run, decode_run)
    figures = report_figures(runs)
    body.append("<h2>Figures</h2>")
    if len(runs) > 1:
        body.append(
            "<p class='note'>Strategies are labelled <i>profile / strategy</i>; each profile's strategies "
            "are compared with that profile's own baseline.</p>"
        )
    for name, fig in figures.items():
        body.append(
            fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"figure-{name}", config={"displaylogo": False})
        )
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{_e(title)}</title><style>{_CSS}</style>"
        f"<script type='text/javascript'>{get_plotlyjs()}</script></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def _run_section(run: ReportRun, decode) -> list[str]:
    m = run.meta
    status = m.get("status", "")
    if status != "complete":
        status = f"{status}: {m.get('reason', '')}".rstrip(": ")
    out = [
        f"<h2>{_e(run.name)}</h2>",
        f"<p class='meta'>{_e(m.get('model', ''))} on {_e(m.get('backend', ''))}/{_e(m.get('device', ''))}, "
        f"{_e(m.get('dtype', ''))}, {_e(m.get('mode', ''))}, {_e(m.get('steps_completed', '?'))}/"
        f"{_e(m.get('max_tokens', '?'))} steps, {_e(status)}. {_e(m.get('input', 'prompt'))}: "
        f"“{_e(m.get('prompt', ''))}”</p>",
    ]
    table = summarize(Profile(m), steps=run.steps)
    out.append(_summary_html(table, run.baseline))
    against = sorted({a for a in table["saved_against"].dropna() if a})
    if against:
        out.append(
            f"<p class='note'>bytes/token held = bytes used / tokens held, at each strategy's last memory "
            f"sample; saved = 1 - bytes used / the bytes a {_e(' or '.join(against))} holding every token so "
            "far in every layer uses at that step. Peak allocated includes reserved, unfilled space.</p>"
        )
    if decode is not None:
        out += _streams_html(run, decode)
    return out


def _summary_html(table: pd.DataFrame, baseline: str) -> str:
    heads = [
        "strategy",
        "steps",
        "peak MiB allocated",
        "MiB used",
        "tokens held",
        "bytes/token held",
        "saved",
        "mean KL (nats)",
        "top-1 agreement",
        "tokens/s",
    ]
    rows = []
    for _, r in table.iterrows():
        cells = [
            _e(r["strategy"]),
            _num(r["steps"], "{:,.0f}"),
            _num(r["peak_bytes_allocated"], "{:,.2f}", 2**20),
            _num(r["bytes_used"], "{:,.2f}", 2**20),
            _num(r["tokens_held"], "{:,.0f}"),
            _num(r["bytes_per_token"], "{:,.0f}"),
            _num(r["memory_saved"], "{:.0%}"),
            _num(r["mean_kl"], "{:.4g}"),
            _num(r["top1_agreement"], "{:.1%}"),
            _num(r["decode_tokens_per_second"], "{:.1f}"),
        ]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in heads)
    # The verdicts go under the table as sentences: a table cell would squeeze or cut them.
    words = "".join(
        f"<li><b>{_e(r['strategy'])}</b> — {_e(verdict(r, baseline))}</li>"
        for _, r in table.iterrows()
        if r["strategy"] != baseline
    )
    return (
        "<div class='wide'><table "
        f"class='summary'><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>"
        + (f"<p><b>In plain words</b></p><ul class='verdicts'>{words}</ul>" if words else "")
    )


def _streams_html(run: ReportRun, decode) -> list[str]:
    streams = token_streams(run.steps, run.strategies, run.baseline)
    by_name = {s.strategy: s for s in streams}
    base = by_name.get(run.baseline)
    if base is None:
        return []
    mode = str(run.meta.get("mode", "teacher-forced"))
    what = (
        "each strategy's own text; highlighted: its first token that differs from the baseline's"
        if mode == "free-running"
        else "every strategy was fed the baseline's tokens; highlighted: its first greedy choice that differs from "
        "the baseline's (struck through), then the baseline's text it went on being fed"
    )
    out = [f"<h3>Generated text</h3><p class='note'>{_e(mode)}: {_e(what)}.</p>"]
    for s in streams:
        pieces = "".join(
            f"<span class='{seg.kind}'>{_e(seg.text)}</span>" for seg in stream_segments(s, base, mode, decode)
        )
        where = (
            ""
            if s.strategy == run.baseline
            else " · same tokens as the baseline"
            if s.first_departure is None
            else f" · first departs at step {s.first_departure}; {s.differing_steps} of {len(s.steps)} steps differ"
        )
        out.append(f"<p><b>{_e(s.strategy)}</b>{_e(where)}</p><div class='stream'>{pieces}</div>")
    return out


def _num(value, fmt: str, scale: float = 1) -> str:
    return "–" if value is None or pd.isna(value) else fmt.format(float(value) / scale)


def _e(text) -> str:
    return html.escape(str(text))


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
