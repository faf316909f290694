"""What the Live page draws when, and what it leaves to the decode: an empty chart before any
run (so the browser has plotly ready when Run is pressed), the charts as soon as step 0 is in
(not at the charts' next refresh), and a core left to the page by the decode's BLAS.

How fast that is, in a real browser, is measured by ``bench/bench_app.py``; these check behaviour.
"""

from __future__ import annotations

import os
import threading
import time

from app_helpers import MAIN, TINY_STRATEGIES, finish_run, plotly_figures
from streamlit.testing.v1 import AppTest

from app.keys import Keys
from app.live import LiveRun, RunOptions, leave_a_core
from cachelib.core.blas import openblas
from cachelib.spec import parse_spec

TIMEOUT = 180


def test_the_idle_page_shows_one_empty_chart_and_a_run_replaces_it_by_its_charts(profiles_dir):
    at = AppTest.from_file(str(MAIN), default_timeout=TIMEOUT)
    at.run()
    (idle,) = plotly_figures(at)
    assert idle["data"] == [] and idle["layout"]["title"]["text"] == "Cache memory"
    assert "fill in here" in idle["layout"]["annotations"][0]["text"]

    at.selectbox(key="model").set_value("tiny-llama").run()
    at.slider(key="max_tokens").set_value(3)
    at.button(key="run").click().run()
    finish_run(at)
    figures = plotly_figures(at)
    assert not at.exception and len(figures) == 4
    assert all(f["data"] for f in figures)  # the run's charts, the empty one gone


def test_the_first_chart_is_due_once_step_0_is_in_and_nothing_is_drawn(profiles_dir, load_model):
    model = load_model("tiny-llama", "mlx")
    specs = [parse_spec(s) for s in TINY_STRATEGIES]
    busy = threading.Lock()
    busy.acquire()  # another session's run: this one waits before its prefill
    run = LiveRun(model, specs, profiles_dir / "first.csv", "first", RunOptions(prompt="Hello", max_tokens=50))
    run.start(busy)
    assert run.step == -1 and not run.first_draw_due() and run.view() is None  # nothing to draw yet
    busy.release()
    deadline = time.monotonic() + TIMEOUT
    while run.step < 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert run.first_draw_due()  # step 0 is in and no chart drawn: draw now
    assert not run.first_draw_due()  # ...asked once, not at every poll
    view = run.view()
    assert view is not None and 0 in set(view.steps["step"])
    run.stop()
    assert run.done.wait(TIMEOUT) and not run.error


def test_a_live_run_redraws_its_charts_from_a_newer_snapshot(profiles_dir):
    at = AppTest.from_file(str(MAIN), default_timeout=TIMEOUT)
    at.run()
    at.selectbox(key="model").set_value("tiny-llama").run()
    at.slider(key="max_tokens").set_value(2048)
    at.button(key="run").click().run()
    run = at.session_state[Keys.LIVE]
    deadline = time.monotonic() + TIMEOUT
    while run.step < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    at.run()
    first = run.drawn_view
    drawn = len(run.refreshes)
    last = int(first.steps["step"].max())
    time.sleep(run.min_gap)  # drawing slowly spaces the snapshots out by this much
    while run.step <= last and time.monotonic() < deadline:
        time.sleep(0.01)
    at.run()
    assert run.drawn_view is not first and int(run.drawn_view.steps["step"].max()) > last
    assert len(run.refreshes) == drawn + 1
    run.stop()
    finish_run(at)
    assert not at.exception


def test_leave_a_core_gives_openblas_one_thread_fewer_than_the_cores():
    lib = openblas()
    get = None if lib is None else lib.openblas_get_num_threads
    if get is None:  # no OpenBLAS in this process (macOS, or bootstrap.sh not run): nothing to set
        assert leave_a_core.__wrapped__() is None
        return
    before = get()
    try:
        threads = leave_a_core.__wrapped__()
        assert threads == max(1, len(os.sched_getaffinity(0)) - 1) == get()
    finally:
        lib.openblas_set_num_threads(before)


def test_the_app_blas_threads_can_be_given_or_left_alone(monkeypatch):
    import pytest

    lib = openblas()
    get = None if lib is None else lib.openblas_get_num_threads
    if get is None:
        pytest.skip("no OpenBLAS in this process (macOS, or bootstrap.sh not run)")
    before = get()
    try:
        monkeypatch.setenv("CACHELIB_APP_BLAS_THREADS", "0")
        lib.openblas_set_num_threads(2)
        assert leave_a_core.__wrapped__() is None and get() == 2
        monkeypatch.setenv("CACHELIB_APP_BLAS_THREADS", "1")
        assert leave_a_core.__wrapped__() == 1 == get()
        monkeypatch.setenv("CACHELIB_APP_BLAS_THREADS", "two")
        with pytest.raises(ValueError, match="CACHELIB_APP_BLAS_THREADS must be a whole number"):
            leave_a_core.__wrapped__()
    finally:
        lib.openblas_set_num_threads(before)


def test_a_live_run_releases_its_threads_mlx_streams_before_it_says_it_is_done(profiles_dir, load_model, monkeypatch):
    # MLX asks a thread that evaluated to destroy its streams before it ends (ml-explore/mlx#4373);
    # the run's own thread does it, last, before ``done`` (cachelib.core.threads)
    import app.live as live

    calls = []
    monkeypatch.setattr(
        live, "release_thread_streams", lambda: calls.append((threading.current_thread(), run.done.is_set()))
    )
    model = load_model("tiny-llama", "mlx")
    run = LiveRun(
        model,
        [parse_spec(s) for s in TINY_STRATEGIES],
        profiles_dir / "r.csv",
        "r",
        RunOptions(prompt="Hello", max_tokens=2),
    )
    run.start(threading.Lock())
    assert run.done.wait(TIMEOUT) and not run.error and run.step == 1
    assert calls == [(run._thread, False)]
