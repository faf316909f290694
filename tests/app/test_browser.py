"""The app in a real browser: ``streamlit run`` on a free port, driven by headless Chromium.

Press Run on the default settings (tokens set to 32 through the slider), wait for the charts,
check that the plotly charts are drawn with data, then open the Inspector, Profiles and Planner pages.
Screenshots go to the test's output folder, and also to ``$CACHELIB_SCREENSHOTS`` when set
(that is how ``assets/app-*.png`` are made).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
START_TIMEOUT = 90  # seconds for the server to answer
RUN_TIMEOUT = 300  # seconds for the default run (model load + 32 steps x 3 strategies) on a busy 2-core machine
UI_TIMEOUT = 60  # seconds for anything else the page does

pytestmark = [pytest.mark.browser, pytest.mark.bundled, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(port: int, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"streamlit exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    pytest.fail(f"streamlit did not answer on port {port} within {START_TIMEOUT} s:\n{log.read_text()[-3000:]}")


@pytest.fixture
def app_url(tmp_path):
    """The app served by a real ``streamlit run`` subprocess, with the test process's environment
    (scripts/env.sh) and a temporary profiles folder."""
    port = _free_port()
    log = tmp_path / "streamlit.log"
    env = {**os.environ, "CACHELIB_PROFILES_DIR": str(tmp_path / "profiles")}
    cmd = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        "app/main.py",
        "--server.headless",
        "true",
        "--server.port",
        str(port),
        "--server.address",
        "127.0.0.1",
        "--browser.gatherUsageStats",
        "false",
    ]
    with open(log, "w") as out:
        server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(port, server, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=5)
        except subprocess.TimeoutExpired:
            server.kill()


@pytest.fixture
def browser(monkeypatch):
    if not CHROMIUM.exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    # The OpenBLAS that scripts/env.sh preloads for MLX makes Chromium and Playwright's node driver
    # fail to start threads; the browser needs none of it (the app server keeps it).
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def _shoot(page, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"app-{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000
    if os.environ.get("CACHELIB_SCREENSHOTS"):
        folder = Path(os.environ["CACHELIB_SCREENSHOTS"])
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, folder / path.name)
    return path


def _traces_per_chart(page) -> list[int]:
    script = "() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(d => (d.data || []).length)"
    return page.evaluate(script)


def test_default_run_in_a_real_browser_draws_the_charts(app_url, browser, tmp_path):
    page = browser.new_page(viewport={"width": 1440, "height": 2200})
    page.set_default_timeout(UI_TIMEOUT * 1000)
    page.goto(app_url)
    run = page.locator(".st-key-run button")
    run.wait_for(timeout=START_TIMEOUT * 1000)

    # 64 -> 32 tokens with the keyboard, as a user would.
    slider = page.get_by_role("slider", name="Tokens to decode")
    slider.focus()
    for _ in range(32):
        slider.press("ArrowLeft")
    page.wait_for_function("() => document.querySelector('[data-testid=stSliderThumbValue]')?.innerText === '32'")
    page.wait_for_timeout(1000)  # let the rerun the slider caused settle before pressing Run

    run.click()
    page.locator(".st-key-stop button").first.wait_for(timeout=RUN_TIMEOUT * 1000)  # the run started and polls
    page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length >= 4", timeout=RUN_TIMEOUT * 1000)
    ended = "() => document.querySelectorAll('.st-key-stop').length === 0"  # the run ended: final redraw
    page.wait_for_function(ended, timeout=RUN_TIMEOUT * 1000)
    page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length === 4")
    page.wait_for_timeout(1000)

    assert page.get_by_text("Traceback").count() == 0
    assert page.locator("[data-testid='stException']").count() == 0
    traces = _traces_per_chart(page)
    assert len(traces) == 4 and min(traces) >= 1, traces
    assert page.locator("[data-testid='stDataFrame']").count() == 1  # the summary table
    _shoot(page, tmp_path, "live")
    assert len(list((tmp_path / "profiles").glob("*.csv"))) == 1

    page.get_by_role("link", name="Inspector").click()
    # slots, masks in slot and temporal order, the mask over the run (standard is not quantized:
    # one line says so instead of two empty error frames)
    page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length === 4")
    page.get_by_role("combobox", name="Strategy").click()
    page.get_by_role("option", name=re.compile("^rotating")).click()
    step = page.get_by_role("slider", name="Step")
    step.focus()
    step.press("End")  # the last step: the ring has wrapped
    page.wait_for_function(
        "() => (document.querySelector('.st-key-insp_ring .js-plotly-plot')?.layout?.title?.text || '')"
        ".includes('rotating:max_size=64,keep=4 · layer 0 · step 31:')"
    )
    page.wait_for_timeout(1000)
    assert min(_traces_per_chart(page)[:3]) >= 1  # slots and both masks
    _shoot(page, tmp_path, "inspector")

    page.get_by_role("link", name="Profiles").click()
    page.get_by_text("Current run").wait_for()
    page.get_by_role("combobox", name="Compare").click()
    page.get_by_role("option", name=re.compile(r"\.csv$")).first.click()  # not "Select all"
    page.keyboard.press("Escape")
    page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length === 4")
    page.wait_for_timeout(1000)
    _shoot(page, tmp_path, "profiles")

    # The Planner, judged by the committed evidence (a run saved on the Live page is not evidence
    # unless picked): the answer first, memory and frontier with the runtime's standard set and,
    # suggested, the evidence's candidates; the retrieval heatmap of the committed passkey trials
    # and the quality-evidence chart, shown on demand.
    page.get_by_role("link", name="Planner").click()
    page.locator(".st-key-plan_answer").get_by_text("mlx_lm.generate").wait_for()
    page.locator(".st-key-plan_frontier .js-plotly-plot").wait_for()
    page.get_by_text("Suggest from the evidence").click()
    page.get_by_text("Also planned, suggested by the evidence").wait_for()
    page.get_by_text("Show the evidence").click()
    page.locator(".st-key-plan_quality .js-plotly-plot").wait_for()
    page.locator(".st-key-plan_retrieval .js-plotly-plot").wait_for()
    page.wait_for_timeout(1000)
    assert page.locator("[data-testid='stException']").count() == 0
    traces = _traces_per_chart(page)
    # the 3 asked strategies drawn (allocated + peak, the max-context marks; their lines and the star), the
    # suggested ones listed in the table and offered in "Strategies shown"
    assert len(traces) == 4 and traces[:2] == [7, 4], traces
    _shoot(page, tmp_path, "planner")

    # A page's own URL, opened directly (a bookmark, a reload), runs through main.py's routes.
    page.goto(f"{app_url}/inspector")
    page.get_by_role("link", name="Live comparison").wait_for()
    assert page.get_by_role("link", name="main", exact=True).count() == 0  # no page list of Streamlit's own
