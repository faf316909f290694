"""How the Live comparison page feels, in a real browser: seconds from pressing Run to the first
chart (cold: the server has not loaded the model yet; warm: it has), steps per second with the
default three strategies, how often the charts refresh, and how many steps a run takes after
Stop is pressed (issues #13, #15).

Starts ``streamlit run app/main.py`` on a free port with a temporary profiles folder, drives
headless Chromium (Debian's ``/usr/bin/chromium`` through Playwright), sets the tokens slider,
keeps the default three strategies (standard, a 64-token ring, 4-bit) on the bundled model and
presses Run:

- ``--cold`` times (default 1) on a freshly started server each, so the first Run loads the
  model (with the on-disk weights cache as it stands; ``--no-weights-cache`` turns it off, which
  is what the very first start on a machine costs, less writing the cache);
- ``--runs`` warm runs of ``--tokens`` tokens on one server (the model already loaded);
- ``--stops`` runs stopped by pressing Stop once the page shows step ``--stop-at``: the steps
  recorded after the click, counted against the step the page showed and against the step the
  run had reached when the click came (read from the run's partial profile file just before it).

"First chart" is a chart of the run (the idle page's empty placeholder chart does not count).
Each warm run also reports the CPU seconds the server and the browser spent on it, which say what
each side costs however busy the machine is, and the load average, which says how busy it was.
Medians close the report. The server runs with the environment of ``scripts/env.sh``.

    source scripts/env.sh && python bench/bench_app.py [--tokens 256] [--runs 3] [--cold 1] [--stops 3]
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
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CHROMIUM = "/usr/bin/chromium"
DEFAULT_TOKENS = 64  # the slider's first value
STRATEGIES = 3  # the Live page's default rows
RUN_CHARTS = "[class*=st-key-live_]"  # the live run's charts (keys live_memory, ...), not the idle page's placeholder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(profiles: Path, log: Path, weights_cache: bool, environ: dict):
    """A Streamlit server of the app on a free port; yields its URL."""
    port = free_port()
    env = {**environ, "CACHELIB_PROFILES_DIR": str(profiles)}
    if not weights_cache:
        env["CACHELIB_WEIGHTS_CACHE"] = "0"
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
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"streamlit exited with {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("streamlit did not answer within 90 s") from None
                time.sleep(0.3)
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def cpu_meter(server_pid: int):
    """``() -> (server CPU s, browser CPU s)`` so far: the Streamlit process, and every Chromium
    process under this one. CPU seconds, unlike wall seconds, say what each side costs however
    busy the machine is with other work."""
    import psutil

    server = psutil.Process(server_pid)

    def seconds(p) -> float:
        try:
            t = p.cpu_times()
            return t.user + t.system
        except psutil.Error:
            return 0.0

    def read() -> tuple[float, float]:
        browser = [c for c in psutil.Process().children(recursive=True) if "chrom" in c.name().lower()]
        return seconds(server), sum(seconds(c) for c in browser)

    return read


def open_page(browser, url: str, tokens: int):
    page = browser.new_page(viewport={"width": 1440, "height": 2200})
    page.set_default_timeout(120_000)
    page.goto(url)
    page.locator(".st-key-run button").wait_for(timeout=90_000)
    slider = page.get_by_role("slider", name="Tokens to decode")
    slider.focus()
    key = "ArrowRight" if tokens > DEFAULT_TOKENS else "ArrowLeft"
    for _ in range(abs(tokens - DEFAULT_TOKENS)):
        slider.press(key)
    page.wait_for_function(
        f"() => document.querySelector('[data-testid=stSliderThumbValue]')?.innerText === '{tokens}'"
    )
    page.wait_for_timeout(1000)
    return page


def shown_step(page) -> int:
    """The step the page's progress bar shows ("step k/N")."""
    text = page.evaluate("() => document.querySelector('[data-testid=stProgress]')?.innerText || ''")
    m = re.search(r"step (\d+)/", text)
    return int(m.group(1)) if m else -1


def caption_figures(page) -> dict:
    page.wait_for_timeout(1500)
    caption = page.get_by_text(re.compile("charts refreshed")).first.inner_text()
    m = re.search(r"charts refreshed (\d+) times, every ([\d.]+) s", caption)
    rate = re.search(r"([\d.]+) steps/s", caption)
    return {
        "refreshes": int(m.group(1)) if m else 0,
        "refresh_every_s": float(m.group(2)) if m else float("nan"),
        "steps_per_s": float(rate.group(1)) if rate else float("nan"),
    }


def timed_run(page, meter) -> dict:
    """Press Run; seconds to the first chart and to the end, the page's own rate figures, and the
    CPU seconds the server and the browser spent from the click to the end."""
    cpu = meter()
    clicked = time.perf_counter()
    page.locator(".st-key-run button").click()
    page.wait_for_function("() => document.querySelector('[data-testid=stProgress]')", timeout=600_000, polling=50)
    started = time.perf_counter() - clicked  # the run's progress bar is on the page (the model is loaded)
    page.wait_for_function(
        f"() => document.querySelector('{RUN_CHARTS} [data-testid=stPlotlyChart]')", timeout=600_000, polling=50
    )
    chart_sent = time.perf_counter() - clicked  # the server sent the run's first chart
    page.wait_for_function(f"() => document.querySelector('{RUN_CHARTS} .js-plotly-plot')", timeout=600_000, polling=50)
    first_chart = time.perf_counter() - clicked  # ...and plotly drew it
    page.wait_for_function("() => document.querySelectorAll('.st-key-stop').length === 0", timeout=1_200_000)
    ended = time.perf_counter() - clicked
    server_cpu, browser_cpu = (b - a for a, b in zip(cpu, meter()))
    return {
        "started_s": started,
        "chart_sent_s": chart_sent,
        "first_chart_s": first_chart,
        "run_s": ended,
        "server_cpu_s": server_cpu,
        "browser_cpu_s": browser_cpu,
        **caption_figures(page),
    }


def recorded_steps(profiles: Path, strategies: int = STRATEGIES) -> int:
    """Steps every strategy has written to the running run's partial profile file (-1: none
    found). Counts the ``steps`` rows, a cheap read that does not parse the file."""
    best = -1
    for p in profiles.glob(".*.partial"):
        try:
            with open(p, "rb") as f:
                rows = sum(1 for line in f if line.startswith(b"steps,"))
        except OSError:
            continue
        best = max(best, rows // strategies)
    return best


def stopped_run(page, profiles: Path, stop_at: int) -> dict:
    """Press Run, then Stop once the page shows ``stop_at`` steps; steps recorded after the click."""
    from cachelib.profile import load_profile

    before = set(profiles.glob("*.csv"))
    page.locator(".st-key-run button").click()
    page.wait_for_function(
        f"() => /step (\\d+)\\//.test(document.querySelector('[data-testid=stProgress]')?.innerText || '') && "
        f"+document.querySelector('[data-testid=stProgress]').innerText.match(/step (\\d+)\\//)[1] >= {stop_at}",
        timeout=600_000,
        polling=50,
    )
    shown = shown_step(page)
    reached = recorded_steps(profiles)  # the run's own count, read right before the click
    clicked = time.perf_counter()
    page.locator(".st-key-stop button").first.click()  # (Streamlit draws a help-text button twice)
    page.wait_for_function("() => document.querySelectorAll('.st-key-stop').length === 0", timeout=600_000)
    ended = time.perf_counter() - clicked
    (saved,) = set(profiles.glob("*.csv")) - before
    final = int(load_profile(saved).meta["steps_completed"])
    return {
        "shown_at_click": shown,
        "recorded_at_click": reached,
        "final_steps": final,
        "steps_after_shown": final - shown,
        "steps_after_click": final - reached if reached >= 0 else float("nan"),
        "stop_s": ended,
    }


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3, help="warm runs (the model already loaded)")
    parser.add_argument("--cold", type=int, default=1, help="cold runs, each on a freshly started server")
    parser.add_argument("--stops", type=int, default=3, help="runs stopped with the Stop button")
    parser.add_argument("--stop-at", type=int, default=10, help="press Stop once the page shows this step")
    parser.add_argument("--no-weights-cache", action="store_true", help="cold runs without the on-disk weights cache")
    args = parser.parse_args()
    if not Path(CHROMIUM).exists():
        raise SystemExit(f"needs Chromium at {CHROMIUM} (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    from cachelib.models import gguf, weights_cache

    cache_state = "off" if args.no_weights_cache else "on"
    if not args.no_weights_cache:
        hit = weights_cache.lookup(gguf.bundled_path(), "mlx", "dequantized-float32")[1] is not None
        cache_state += ", " + (
            "cached weights present" if hit else "no cached weights yet: the first cold run writes them"
        )
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the start")
    print(
        f"bench_app: {args.tokens} tokens x {STRATEGIES} strategies, bundled SmolLM2, backend mlx (the page's "
        "default); "
        f"weights cache {cache_state}; {os.cpu_count()} CPU cores",
        flush=True,
    )
    cold, warm, stops = [], [], []
    server_env = dict(os.environ)
    os.environ.pop("LD_PRELOAD", None)  # the browser and Playwright's driver need none of the BLAS the server preloads
    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as p:
        tmp = Path(tmp)
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
        for i in range(args.cold + (1 if not args.cold and (args.runs or args.stops) else 0)):
            profiles = tmp / f"profiles-{i}"
            last = i == max(args.cold, 1) - 1
            with server(profiles, tmp / f"streamlit-{i}.log", not args.no_weights_cache, server_env) as (url, pid):
                meter = cpu_meter(pid)
                page = open_page(browser, url, args.tokens)
                r = timed_run(page, meter)
                page.close()
                if args.cold:
                    cold.append(r)
                    print(
                        f"cold run {i + 1}: first chart {r['first_chart_s']:.2f} s after Run (loads the model; "
                        f"progress bar at {r['started_s']:.2f} s, chart sent at {r['chart_sent_s']:.2f} s), "
                        f"run {r['run_s']:.1f} s, {r['steps_per_s']:.2f} steps/s",
                        flush=True,
                    )
                if not last:
                    continue
                for j in range(args.runs):
                    page = open_page(browser, url, args.tokens)
                    r = timed_run(page, meter)
                    page.close()
                    warm.append(r)
                    print(
                        f"warm run {j + 1}: first chart {r['first_chart_s']:.2f} s after Run (progress bar at "
                        f"{r['started_s']:.2f} s, chart sent at {r['chart_sent_s']:.2f} s), run {r['run_s']:.1f} s, "
                        f"{r['steps_per_s']:.2f} steps/s x {STRATEGIES} strategies, charts refreshed "
                        f"{r['refreshes']} times, every {r['refresh_every_s']:.2f} s; CPU: server "
                        f"{r['server_cpu_s']:.1f} s, "
                        f"browser {r['browser_cpu_s']:.1f} s; load average {os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
                for j in range(args.stops):
                    page = open_page(browser, url, args.tokens)
                    r = stopped_run(page, profiles, args.stop_at)
                    page.close()
                    stops.append(r)
                    print(
                        f"stop run {j + 1}: Stop pressed at step {r['shown_at_click']} shown "
                        f"({r['recorded_at_click']} recorded), run ended after step {r['final_steps']}: "
                        f"{r['steps_after_shown']} steps after the step shown, {r['steps_after_click']} after "
                        "the click, "
                        f"{r['stop_s']:.2f} s",
                        flush=True,
                    )
        browser.close()

    print()
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end")
    if cold:
        print(
            f"cold (server started, model not loaded; weights cache {cache_state.split(',')[0]}): "
            f"first chart {median(cold, 'first_chart_s'):.2f} s after Run (chart sent at "
            f"{median(cold, 'chart_sent_s'):.2f} s; median of {len(cold)})"
        )
    if warm:
        print(
            f"warm (model loaded), median of {len(warm)}: first chart {median(warm, 'first_chart_s'):.2f} s after Run; "
            f"(chart sent by the server at {median(warm, 'chart_sent_s'):.2f} s); "
            f"{median(warm, 'steps_per_s'):.2f} steps/s x {STRATEGIES} strategies; charts refreshed every "
            f"{median(warm, 'refresh_every_s'):.2f} s; run {median(warm, 'run_s'):.1f} s; CPU: server "
            f"{median(warm, 'server_cpu_s'):.1f} s, browser {median(warm, 'browser_cpu_s'):.1f} s"
        )
    if stops:
        print(
            f"Stop, median of {len(stops)}: {median(stops, 'steps_after_click'):.0f} step(s) after the click "
            f"({median(stops, 'steps_after_shown'):.0f} after the step the page showed), ended "
            f"{median(stops, 'stop_s'):.2f} s after the click"
        )


if __name__ == "__main__":
    main()
