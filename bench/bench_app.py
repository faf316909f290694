"""How the Live comparison page feels: time from pressing Run to the first chart, and how often
the charts refresh while a run decodes (issue #6), in a real browser.

Starts ``streamlit run app/main.py`` on a free port with a temporary profiles folder, drives
headless Chromium (Debian's ``/usr/bin/chromium`` through Playwright), sets the tokens slider,
keeps the default three strategies (standard, a 64-token ring, 4-bit) on the bundled model and
presses Run ``--runs`` times. The first run includes loading the model (``st.cache_resource``
keeps it for the next); the others are warm. Per run it prints the seconds from the click to the
first plotly chart in the page, to the end of the run, and the app's own count of chart
refreshes and their mean interval (the caption under the finished run); medians over the warm
runs close the report.

    source scripts/env.sh && python bench/bench_app.py [--tokens 256] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
DEFAULT_TOKENS = 64  # the slider's first value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, profiles: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "CACHELIB_PROFILES_DIR": str(profiles)}
    cmd = [
        sys.executable, "-m", "streamlit", "run", "app/main.py", "--server.headless", "true",
        "--server.port", str(port), "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false",
    ]  # fmt: skip
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"streamlit exited with {server.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2):
                return server
        except OSError:
            time.sleep(0.3)
    server.kill()
    raise SystemExit("streamlit did not answer within 90 s")


def one_run(page, tokens: int) -> dict:
    run = page.locator(".st-key-run button")
    run.wait_for(timeout=90_000)
    slider = page.get_by_role("slider", name="Tokens to decode")
    slider.focus()
    key = "ArrowRight" if tokens > DEFAULT_TOKENS else "ArrowLeft"
    for _ in range(abs(tokens - DEFAULT_TOKENS)):
        slider.press(key)
    page.wait_for_function(
        f"() => document.querySelector('[data-testid=stSliderThumbValue]')?.innerText === '{tokens}'"
    )
    page.wait_for_timeout(1000)
    clicked = time.perf_counter()
    run.click()
    page.locator(".st-key-stop button").first.wait_for(timeout=600_000)
    page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length >= 1", timeout=600_000, polling=50)
    first_chart = time.perf_counter() - clicked
    page.wait_for_function("() => document.querySelectorAll('.st-key-stop').length === 0", timeout=1_200_000)
    ended = time.perf_counter() - clicked
    page.wait_for_timeout(1500)
    caption = page.get_by_text(re.compile("charts refreshed")).first.inner_text()
    m = re.search(r"charts refreshed (\d+) times, every ([\d.]+) s", caption)
    rate = re.search(r"([\d.]+) steps/s", caption)
    return {
        "first_chart_s": first_chart,
        "run_s": ended,
        "refreshes": int(m.group(1)) if m else 0,
        "refresh_every_s": float(m.group(2)) if m else float("nan"),
        "steps_per_s": float(rate.group(1)) if rate else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3, help="runs; the first is cold (loads the model)")
    args = parser.parse_args()
    if not Path(CHROMIUM).exists():
        raise SystemExit(f"needs Chromium at {CHROMIUM} (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        server = start_server(port := free_port(), tmp / "profiles", tmp / "streamlit.log")
        os.environ.pop("LD_PRELOAD", None)  # the browser needs none of the BLAS the server preloads
        results = []
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
                for i in range(args.runs):
                    page = browser.new_page(viewport={"width": 1440, "height": 2200})
                    page.set_default_timeout(120_000)
                    page.goto(f"http://127.0.0.1:{port}")
                    r = one_run(page, args.tokens)
                    page.close()
                    results.append(r)
                    kind = "cold (loads the model)" if i == 0 else "warm"
                    print(
                        f"run {i + 1} {kind}: first chart {r['first_chart_s']:.2f} s after Run, run {r['run_s']:.1f} s, "
                        f"{r['steps_per_s']:.1f} steps/s x 3 strategies, charts refreshed {r['refreshes']} times, "
                        f"every {r['refresh_every_s']:.2f} s",
                        flush=True,
                    )
                browser.close()
        finally:
            server.terminate()
            server.wait(timeout=10)
    warm = results[1:] or results
    med = {k: statistics.median(r[k] for r in warm) for k in warm[0]}
    print(
        f"\n{args.tokens} tokens x 3 strategies, median of {len(warm)} warm run(s): first chart {med['first_chart_s']:.2f} s "
        f"after Run; charts refreshed every {med['refresh_every_s']:.2f} s ({med['refreshes']:.0f} times per run; "
        f"{1 / med['refresh_every_s']:.1f} refreshes/s); run {med['run_s']:.1f} s"
    )


if __name__ == "__main__":
    main()
