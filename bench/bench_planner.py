"""How quick the Planner answers: the page's re-render after a number changes, and the CLI with
the default evidence (issue 29: under 1 s and under 1.5 s).

- **page**: the Planner through Streamlit's AppTest (the page script as the server runs it, no
  browser), warmed once, then ``--runs`` re-renders, each after a new value of the budget (a
  number that changes the plan, so the plan and the fit frontier are computed again; the
  evidence stays cached). Also the re-render with nothing changed, the floor AppTest itself costs.
- **CLI**: ``python -m cachelib plan`` for Llama-3.1-8B at 32,768 tokens on mlx-lm in 24 GiB with
  the default evidence, in a fresh process each time (``--runs``), against
  ``python -c "import cachelib.cli.plan"`` measured in the same run (what the plan command's
  imports alone cost; the CLI imports a subcommand's module only when it is chosen) and a bare
  ``python -c pass``, and the evidence read cold (its on-disk cache in a fresh folder) against warm.

Medians of ``--runs``; the load average says how busy the machine was.

    source scripts/env.sh && python bench/bench_planner.py [--runs 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "app")]
PLAN = [
    "plan",
    "--model",
    "llama-3.1-8b",
    "--context",
    "32768",
    "--runtime",
    "mlx-lm",
    "--budget",
    "24",
    "--max-kl",
    "0.1",
    "--min-agreement",
    "0.9",
]


def _timed(argv: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def page(runs: int) -> tuple[float, float]:
    """Median seconds of a re-render after a budget change, and of one with nothing changed."""
    from app_helpers import MAIN
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(MAIN), default_timeout=120)
    at.run()
    at.switch_page("views/planner.py").run()
    at.number_input(key="plan_budget").set_value(30.0).run()  # warm: evidence read, caches filled
    changed, same = [], []
    for i in range(runs):
        start = time.perf_counter()
        at.number_input(key="plan_budget").set_value(24.0 + 0.25 * (i + 1)).run()
        changed.append(time.perf_counter() - start)
        assert not at.exception and not at.error, at.error
        start = time.perf_counter()
        at.run()
        same.append(time.perf_counter() - start)
    return statistics.median(changed), statistics.median(same)


def cli(runs: int) -> dict[str, float]:
    env = dict(os.environ)
    out = {}
    with tempfile.TemporaryDirectory() as cold:
        times = []
        for i in range(runs):  # a fresh cache folder each time: the evidence files read and parsed
            env["CACHELIB_HOME"] = str(Path(cold) / str(i))
            times.append(_timed([sys.executable, "-m", "cachelib", *PLAN], env))
        out["cli, evidence read cold"] = statistics.median(times)
    env.pop("CACHELIB_HOME", None)
    _timed([sys.executable, "-m", "cachelib", *PLAN], env)  # fills the user's cache
    out["cli, evidence cached"] = statistics.median(
        _timed([sys.executable, "-m", "cachelib", *PLAN], env) for _ in range(runs)
    )
    out["import cachelib.cli.plan alone"] = statistics.median(
        _timed([sys.executable, "-c", "import cachelib.cli.plan"], env) for _ in range(runs)
    )
    out["python -c pass"] = statistics.median(_timed([sys.executable, "-c", "pass"], env) for _ in range(runs))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="repeats each median is taken over (default 10)")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    changed, same = page(args.runs)
    print(f"page re-render after a budget change: median {changed:.3f} s of {args.runs} (target < 1 s)")
    print(f"page re-render, nothing changed (AppTest's floor): median {same:.3f} s")
    for name, seconds in cli(args.runs).items():
        target = " (target < 1.5 s)" if name == "cli, evidence cached" else ""
        print(f"{name}: median {seconds:.3f} s of {args.runs}{target}")
    print(f"load average: {load:.2f} before, {os.getloadavg()[0]:.2f} after ({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
