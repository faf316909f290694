"""Live comparison: configure a run, watch its charts fill in, stop it, keep what it recorded."""

from __future__ import annotations

import time
from dataclasses import replace

import streamlit as st

from app import panels, profile_folder, shelf, state, streams, widgets
from app.figures import empty_figure
from app.keys import Keys
from app.live import CHART_SECONDS, PROGRESS_SECONDS, LiveRun
from app.plain import md
from cachelib.profile import default_profile_name, parse_memory_limit

st.title("Live comparison")
st.caption(
    "Decode one prompt with several KV-cache strategies side by side. The first strategy is the "
    "baseline; the others are fed the same tokens and compared to it."
)

run = state.live_run()
state.collect(run)
running = bool(run and run.running)

with st.sidebar:
    st.subheader("Model")
    model = widgets.model_settings()
    st.subheader("Input")
    options = widgets.input_settings()
    probes, memory_limit, problems = widgets.probe_settings()

with st.expander("Strategies", expanded=state.current() is None):
    rows = widgets.strategy_editor(model["backend"])
problems += [r["problem"] for r in rows if r["problem"]]


def start() -> None:
    """Validate everything, load the model (cached), start the run; ValueError on bad input."""
    specs = widgets.specs_of(rows, model["backend"])
    text = options.prompt if options.prompt is not None else options.text
    if not (text or "").strip():
        raise ValueError(
            "the prompt is empty; type a prompt to decode from"
            if options.prompt is not None
            else "the evaluation text is empty; paste a text to evaluate on"
        )
    if not model["name"]:
        raise ValueError("give the path of a model folder (config.json + safetensors)")
    limit = parse_memory_limit(memory_limit)
    loaded = load_model(model["name"], model["backend"], model["device"])
    name = default_profile_name(model["name"].rstrip("/").split("/")[-1], specs)
    while (profile_folder.profiles_dir() / f"{name}.csv").exists():
        name += "-b"
    state.start_run(loaded, specs, name, replace(options, probes=probes, memory_limit=limit))


def load_model(name: str, backend: str, device: str):
    """The shared model (:func:`shelf.loaded_model`); a first load shows its stages as it goes."""
    if shelf.model_is_loaded(name, backend, device):
        return shelf.loaded_model(name, backend, device)
    with st.status(f"Loading {name} on {backend}/{device}…", expanded=True) as box:
        bar = st.progress(0.0, text="starting")
        loaded = shelf.loaded_model(
            name, backend, device, progress=lambda stage, f: bar.progress(min(f, 1.0), text=stage)
        )
        box.update(label=f"Loaded {name} in {loaded.info.load_seconds:.1f} s", state="complete", expanded=False)
    return loaded


run_col, note_col = st.columns([1, 5], vertical_alignment="center")
clicked = run_col.button(
    "Run",
    type="primary",
    key=Keys.RUN,
    disabled=running or bool(problems),
    width="stretch",
    help="off while a field is marked in red" if problems else None,
)
if problems:  # each is shown beside its field; this says why Run is off
    where = "field is" if len(problems) == 1 else f"{len(problems)} fields are"
    note_col.caption(f":red[Run is off until the {where} fixed (marked in red above or in the sidebar).]")
else:
    note_col.caption(f"Runs are saved to {md(profile_folder.profiles_dir())} when they end (finished or stopped).")
if clicked and not problems:
    st.session_state.pop(Keys.LIVE, None)  # a finished run's results are already current
    try:
        start()
    except ValueError as e:
        st.error(md(e))
    except Exception as e:  # a model that fails to load, a broken install: one line, no traceback
        st.error(md(f"{type(e).__name__}: {e}"))
    else:
        st.rerun()  # redraw with Run disabled and the live panel polling
    run = None  # the start failed: no run of this click to show


def live_progress(run: LiveRun) -> None:
    """The progress bar and rate, polled often: cheap to send and to draw, so the step shown
    stays close to the run's own (what Stop is pressed against)."""
    if not run.running:
        state.collect(run)
        st.rerun()  # the final redraw, outside the polling fragments
    done = max(run.step + 1, 0)
    st.progress(done / max(run.total, 1), text=run.rate_text())
    if run.waiting:
        st.info("Waiting for another session's run to finish…")
    elif run.step < 0:
        st.info("Prefilling the prompt…")
    elif run.first_draw_due():
        st.rerun()  # the first step is in: draw the charts now, not at their next refresh


def live_charts(run: LiveRun) -> None:
    """The charts of what the run recorded so far, redrawn every ``CHART_SECONDS``: each redraw
    of a changed figure costs the browser a fresh plotly plot, on the cores the decode needs."""
    if not run.running:
        state.collect(run)
        st.rerun()
    start = time.perf_counter()
    view = run.view()
    if view is None:
        return
    panels.charts_grid(view, key="live")
    if view is not run.drawn_view:
        run.drawn_view = view
        run.note_refresh(time.perf_counter() - start)


if running:
    # Stop lives outside the polling fragments: a button redrawn every tick loses clicks (the
    # browser's element is replaced under the pointer), and a full rerun interrupts the fragment.
    stopping = run.stop_event.is_set()
    st.button(
        "Stopping…" if stopping else "Stop",
        key=Keys.STOP,
        on_click=run.stop,
        disabled=stopping,
        help="stop after the current step; keeps what was recorded",
    )
    # The charts are drawn before the progress bar (into the box below it), so that a full rerun
    # draws them first and the progress bar, seeing them drawn, asks for no rerun of its own.
    progress_box, charts_box = st.container(), st.container()
    with charts_box:
        st.fragment(run_every=CHART_SECONDS)(live_charts)(run)
    with progress_box:
        st.fragment(run_every=PROGRESS_SECONDS)(live_progress)(run)
else:
    if run is not None and run.error:
        st.error(md(run.error))
    result = state.current()
    if result is not None:
        profile, view = result
        st.markdown(panels.describe(view))
        if run is not None and run.first_step_at is not None and run.final is profile:
            st.caption(run.rate_text())
        panels.charts_grid(view, key="current")
        with st.expander("Generated text", expanded=view.meta.get("mode") == "free-running"):
            streams.generated_text(view, shelf.decoder_of(view.meta))
    elif not clicked:
        st.info("Press **Run** to decode with the strategies above (defaults: the bundled SmolLM2, 64 tokens).")
        # An empty chart where the charts will be: the browser fetches and starts plotly (a
        # 4.7 MB script, seconds on a busy 2-core machine) while the run is set up, not after Run.
        idle = empty_figure("Cache memory", "the charts of a run fill in here as it goes", height=200)
        panels.chart(idle, "idle_chart")
