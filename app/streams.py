"""The generated text of a run, per strategy: layout only; the streams come from
:func:`cachelib.profile.report.token_streams`, the words from the profile's own tokenizer.

Free-running, each strategy's own text, its first token that differs from the baseline's
highlighted and what follows greyed. Teacher-forced, every strategy was fed the baseline's tokens,
so the text is the baseline's; the highlight is the strategy's first greedy choice that differs,
with the baseline's token it would have replaced struck through.
"""

from __future__ import annotations

from typing import Callable

import streamlit as st

from cachelib.profile.report import stream_segments, token_streams

from .data import RunView
from .plain import md

_STYLE = {
    "same": "{}",
    "departure": ":orange-background[**{}**]",
    "instead": "~~{}~~",
    "after": ":gray[{}]",
}


def segments_markdown(segments) -> str:
    """Styled markdown of a stream's pieces; every piece of text escaped (:func:`app.plain.md`)."""
    out = []
    for text, kind in segments:
        # A directive or emphasis cannot start or end on a space: keep the spaces outside it.
        core = text.strip()
        if not core:
            out.append(text)
            continue
        lead, trail = text[: len(text) - len(text.lstrip())], text[len(text.rstrip()) :]
        out.append(lead + _STYLE[kind].format(md(core)) + trail)
    return "".join(out)


def generated_text(view: RunView, decode: Callable[[list[int]], str] | None) -> None:
    """Each strategy's tokens as text (or as token ids when the tokenizer is not here)."""
    if not view.meta or not len(view.steps):
        return
    streams = token_streams(view.steps, view.strategies, view.baselines[0])
    base = next((s for s in streams if s.strategy == view.baselines[0]), None)
    if base is None or not base.token_ids:
        st.caption("No tokens recorded yet.")
        return
    mode = str(view.meta.get("mode", "teacher-forced"))
    if decode is None:
        st.caption(
            f"The tokenizer of {md(view.meta.get('model', 'this model'))} is not on this machine: tokens are "
            "shown as ids."
        )
        decode = lambda ids: " ".join(str(i) for i in ids)  # noqa: E731
    if mode == "free-running":
        st.caption(
            "Free-running: each strategy's own text. Highlighted: its first token that differs from the "
            "baseline's; greyed: what it generated from there."
        )
    else:
        st.caption(
            "Teacher-forced: every strategy was fed the baseline's tokens, so the text is the baseline's. "
            "Highlighted: the strategy's first greedy choice that differs, then the baseline's token it "
            "replaced (struck through); greyed: the rest of the baseline's text it was fed."
        )
    for s in streams:
        if s.strategy == view.baselines[0]:
            where = "the baseline"
        elif s.first_departure is None:
            where = f"the same {len(s.steps)} tokens as the baseline"
        else:
            where = f"first departs at step {s.first_departure}; {s.differing_steps} of {len(s.steps)} steps differ"
        st.markdown(f"**{md(s.strategy)}** — {md(where)}")
        st.markdown(segments_markdown(stream_segments(s, base, mode, decode)))
