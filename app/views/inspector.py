"""Inspector: step through one strategy of a run: its slots, its attention masks, its quantization error."""

from __future__ import annotations

import streamlit as st

from app import charts, importance_charts, inspector_charts, state
from app.data import RunView, nearest_at_or_before
from app.keys import Keys, kept
from app.panels import chart
from app.plain import md

PLAY_SECONDS = 0.6  # one step per tick while playing

st.title("Inspector")
st.caption(
    "One strategy of a run, step by step: which absolute position each cache slot holds, what the "
    "attention mask lets each query see, and how much quantization distorted keys and values."
)

sources: dict[str, RunView] = {}
if (cur := state.current()) is not None:
    sources[f"current run · {cur[1].name}"] = cur[1]
sources.update(st.session_state.get(Keys.LOADED, {}))
live = state.live_run()
if live is not None and live.running:
    st.info("A run is in progress on the Live comparison page; it appears here when it ends.")
if not sources:
    st.info(
        "Nothing to inspect yet: press **Run** on the Live comparison page, or load a profile on the Profiles page."
    )
    st.stop()

top = st.columns([3, 3, 2])
source = top[0].selectbox("Run", list(sources), **kept(Keys.INSP_SOURCE))
view = sources[source]
try:  # a large profile's per-layer, slot and mask tables are read when a page first needs them
    with st.spinner("Reading the per-layer, slot and mask tables…"):
        for table in ("layers", "slots", "masks"):
            _ = view.tables[table]  # read it now (a bare expression would be drawn: Streamlit magic)
except ValueError as e:  # a malformed table: one line naming the file, line and column
    st.error(md(e))
    st.stop()
strategies = [s for s in view.strategies if (view.layers["strategy"] == s).any()]
if not strategies:
    st.warning("This run recorded no per-layer rows (the memory probe was off): nothing to inspect.")
    st.stop()
strategy = top[1].selectbox("Strategy", strategies, **kept(Keys.INSP_STRATEGY))
steps = view.steps_recorded(strategy, "layers")
layers = sorted(int(x) for x in view.layers.loc[view.layers["strategy"] == strategy, "layer"].unique())
layer = top[2].selectbox("Layer", layers, **kept(Keys.INSP_LAYER))


def _toggle_play() -> None:
    st.session_state[Keys.INSP_PLAYING] = not st.session_state.get(Keys.INSP_PLAYING, False)


playing = bool(st.session_state.get(Keys.INSP_PLAYING)) and len(steps) > 1
st.button(
    "⏸ Pause" if playing else "▶ Play",
    key=Keys.INSP_PLAY,
    on_click=_toggle_play,
    disabled=len(steps) < 2,
    help=f"advance one step every {PLAY_SECONDS} s",
)


def step_panel() -> None:
    if st.session_state.get(Keys.INSP_STEP) not in steps:
        st.session_state[Keys.INSP_STEP] = steps[0]
    if playing:
        i = steps.index(st.session_state[Keys.INSP_STEP])
        if i + 1 < len(steps):
            st.session_state[Keys.INSP_STEP] = steps[i + 1]
        else:
            st.session_state[Keys.INSP_PLAYING] = False
            st.rerun()  # redraw the Play button and stop the ticking
    if len(steps) > 1:
        step = st.select_slider("Step", steps, **kept(Keys.INSP_STEP))
    else:
        step = steps[0]
        st.caption(f"step {step} (the only step recorded)")

    slot_steps = view.steps_recorded(strategy, "slots")
    ring_step = nearest_at_or_before(slot_steps, step) if slot_steps else step
    fig = inspector_charts.ring_figure(view.slots, view.layers, strategy, ring_step, layer)
    chart(fig, "insp_ring")
    if ring_step != step:
        st.caption(f"Slots are sampled; showing step {ring_step}, the last recorded at or before {step}.")

    st.subheader("Attention mask")
    st.caption(
        "Each key is **visible** to the query, **masked by causality** (a later position), **held, masked** "
        "(the cache holds it but the mask hides it) or **evicted** (the cache no longer holds it). Slot order "
        "is the order the cache hands keys to attention; temporal order lays out every position up to the "
        "query's, so a ring's evicted positions show as evicted. Hovering a key names its slot and its "
        "position in both views."
    )
    mask_steps = view.steps_recorded(strategy, "masks")
    if not mask_steps:
        st.caption("No masks recorded for this strategy (the masks probe was off).")
    else:
        mask_step = nearest_at_or_before(mask_steps, step)
        listed = ", ".join(map(str, mask_steps[:12])) + ("…" if len(mask_steps) > 12 else "")
        st.caption(f"Masks are sampled at steps {listed}; showing step {mask_step}.")
        left, right = st.columns(2)
        for col, order in ((left, "slot"), (right, "temporal")):
            with col:
                chart(inspector_charts.mask_figure(view.masks, strategy, mask_step, layer, order), f"insp_mask_{order}")

    st.subheader("What the cache holds over the run")
    span = st.select_slider(
        "Rows in the block",
        [16, 32, 64, 128, 256],
        value=inspector_charts.RUN_SPAN,
        **kept(Keys.INSP_SPAN),
        help="how many recorded decode steps the block shows, ending at the chosen one",
    )
    tables = (view.steps, view.layers, view.slots, view.masks)
    fig = inspector_charts.mask_run_figure(*tables, strategy, layer, step, span)
    chart(fig, "insp_mask_run")
    held_from = "its slot table (ring probe)" if (view.slots["strategy"] == strategy).any() else "its per-layer rows"
    st.caption(
        f"One row per recorded decode step: what {md(strategy)} held, from {held_from}; the rows are only the "
        "steps that probe recorded. At steps with a recorded mask, visibility is the mask's; at the others a "
        "decode query is drawn seeing every key the cache holds."
    )

    st.subheader("Kept positions per layer")
    if not importance_charts.has_slots(view.slots, strategy):
        st.caption(f"{md(strategy)} recorded no slot table (only rings and importance caches do, with the ring probe).")
    else:
        left, right = st.columns(2)
        with left:
            fig = importance_charts.kept_layers_figure(view.slots, view.layers, strategy, ring_step)
            chart(fig, "insp_kept_layers")
        with right:
            fig = importance_charts.kept_steps_figure(view.slots, view.layers, strategy, layer, step)
            chart(fig, "insp_kept_steps")
        st.caption(
            f"From the slot table (ring probe), step {ring_step}: which absolute positions each layer holds, and "
            f"which positions layer {layer} holds at each recorded step. For caches that evict per KV head "
            "(knorm, snapkv, tova, h2o) a cell is the share of the layer's KV heads that hold the position. "
            "A ring's window climbs the diagonal; SnapKV's prompt positions, chosen once, stay as rows; H2O's "
            "heavy hitters stay while its recent window climbs."
        )

    st.subheader("Quantization error")
    column = st.radio(
        "Error of",
        list(charts.ERROR_COLUMNS),
        **kept(Keys.INSP_ERROR),
        horizontal=True,
        format_func=lambda c: charts.ERROR_COLUMNS[c],
    )
    quantized = (view.layers["strategy"] == strategy) & view.layers[["key_rel_rms", "value_rel_rms"]].notna().any(
        axis=1
    )
    if not quantized.any():  # one line, not two empty frames
        st.caption(f"{md(strategy)}: {charts.NO_QUANT_ERROR}.")
        return
    left, right = st.columns(2)
    with left:
        fig = charts.quant_error_heatmap(view.layers, strategy, column)
        chart(fig, "insp_qheat")
    with right:
        fig = charts.quant_error_bars(view.layers, view.strategies, strategy, step)
        chart(fig, "insp_qbars")


st.fragment(run_every=PLAY_SECONDS if playing else None)(step_panel)()
