"""What the profiler's probes cost per decode step: the default probes against every probe off,
with 3 and 8 strategies, on the bundled model, both backends.

Target (issue #34): the default probes at most 2% over probes off, with 3 and with 8 strategies
(issue #5's older targets: memory+ring probes at most 3%, every probe every step at most 15%;
``--configs`` adds those). The configurations decode side by side in one process, one step of
each in turn, in a random order each round (``bench_batched.RoundRobin``: threads, one running
at a time), so drift and the other jobs on a shared machine hit them alike; whole runs one after
another drift by more than the few percent measured here. A step's time runs from the moment its
run gets the turn to its step callback, so it holds all probe work and row building; decode steps
only (step 0, the prefill, is left out). Quoted: the median step (wall, and process CPU time, the
steadier figure on a busy machine), and the median over steps of each step's ratio to the same
step of ``probes off`` with its 95% interval (a block bootstrap over the steps); the 2% target is
judged by the interval's upper bound, not the median. The interval covers the steps of one run
only: separate runs (processes) of the same code differ by more (two identical configurations:
within ~0.4% of a step between runs on torch at 8 strategies, -2.9% to +4.3% on MLX at 8 over
twelve runs on the 2-core CI machine; bench/README.md), so judge over several runs.

    python bench/bench_profiler.py [--backend mlx torch] [--tokens 96] [--rounds 1] [--strategies 3 8] [--runs 1]

``--runs N`` repeats the whole measurement in N separate processes, one after another, and judges
the target over runs: each run's median step ratio is one sample, and the verdict takes the upper
bound of the 95% Student-t interval of their mean (the spread between processes, which one run's
interval cannot see, is then in the bound). Every other configuration of ``--configs`` gets its
interval over runs too (``"default, quant_error off"``: whether the probes but the quantization
error's fit the same line; ``"probes off, again"``: the reference against itself, what two
identical configurations differ by here).

Every round takes the configurations in a fresh random order (``RoundRobin``'s ``seed``, given
by ``--seed``; run i of ``--runs`` draws with ``--seed`` + i). With a fixed order, where a
configuration ran in the round, and after which, moved its steps' times by up to ~3% here, the
same way every round, and that was in every ratio (bench/README.md, 2026-12-06 21:00-22:30).

``--probe-times`` adds, per k, the probes' own host time per step, timed around each probe
function (CPU seconds of the thread that runs it) in a run of the default probes that streams its
rows to a CSV file, as the CLI and the app do (``writer``: the file's share; the interleaved
runs above keep their rows in memory only): a split that holds on a loaded machine, where the
interleaved ratios swing by more than the probes cost.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from bench_batched import PROMPT, RoundRobin  # one round robin for every interleaved bench

from cachelib.models import load
from cachelib.profile import Probes, run_profile
from cachelib.profile import run as run_module
from cachelib.profile import writer as writer_module
from cachelib.profile.backends import probe_for
from cachelib.profile.divergence import StepQuality

CONFIGS = {
    "probes off": Probes.none(),
    # the reference again, with its own caches: what two identical configurations differ by (A/A)
    "probes off, again": Probes.none(),
    "default probes": Probes(),
    "default, quality off": Probes(quality=0),  # what the quality probe's own share is
    "default, quant_error off": Probes(quant_error=0),  # what the quantization error's own share is
    "memory+ring": Probes(memory=1, ring=1, quant_error=0, quality=0, masks=0, system=0),
    "every probe, every step": Probes.every_step(),
}
# one default probe at a time, at its default period: what each costs on its own
CONFIGS.update(
    {
        f"only {name}": Probes.none().parse(f"{name}={getattr(Probes(), name)}", Probes.none())
        for name in ("memory", "ring", "quant_error", "quality", "masks", "system")
    }
)
STRATEGIES = [
    "standard",
    "rotating:max_size=64,keep=4",
    "quantized:bits=4",
    "quantized:bits=8",
    "kivi:bits=4,residual=32",
    "rotating:max_size=128,keep=4",
    "static:max_len=512",
    "concat",
]


def decodes(loaded, strategies: list[str], configs: list[str], tokens: int) -> dict:
    def decode_with(name: str):
        def decode(done):
            run_profile(
                loaded, strategies, prompt=PROMPT, max_tokens=tokens, probes=CONFIGS[name], on_step=lambda e: done()
            )

        return decode

    return {name: decode_with(name) for name in configs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", nargs="+", default=["mlx", "torch"], choices=["mlx", "torch"])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--strategies", type=int, nargs="+", default=[3, 8], metavar="K", choices=range(1, len(STRATEGIES) + 1)
    )
    ap.add_argument("--configs", nargs="+", default=["probes off", "default probes"], choices=list(CONFIGS))
    ap.add_argument("--probe-times", action="store_true", help="also time each probe's own host work per step")
    ap.add_argument("--runs", type=int, default=1, help="separate processes, judged over runs (1-31)")
    ap.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the seed of the rounds' random orders (with --runs: run i draws with seed + i)",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # a run of --runs: its results as JSON
    args = ap.parse_args()
    if not 1 <= args.runs <= len(T975):
        ap.error(f"--runs must be 1 to {len(T975)}, got {args.runs}")
    if args.runs > 1:
        over_runs(args)
        return
    configs = ["probes off"] + [c for c in args.configs if c != "probes off"]  # the reference first
    for backend in args.backend:
        loaded = load("smollm2", backend)
        load_avg = " ".join(f"{x:.1f}" for x in os.getloadavg())
        print(
            f"\n{backend} ({loaded.info.device}), {args.tokens} tokens x {args.rounds} rounds, "
            "interleaved step by step, "
            f"load average at start {load_avg}"
        )
        print(
            f"{'k':>3} {'configuration':<24} {'median step ms':>15} {'CPU ms':>8} {'overhead':>9} "
            f"{'CPU overhead':>13} "
            f"{'median step ratio':>18} {'its 95% interval':>18}"
        )
        for k in args.strategies:
            strategies = STRATEGIES[:k]
            RoundRobin(configs, args.seed).run(decodes(loaded, strategies, configs, 4))  # warm-up
            wall: dict[str, list[float]] = {c: [] for c in configs}
            cpu: dict[str, list[float]] = {c: [] for c in configs}
            for r in range(args.rounds):
                for name, steps in (
                    RoundRobin(configs, args.seed + 1000 * r)
                    .run(decodes(loaded, strategies, configs, args.tokens))
                    .items()
                ):
                    wall[name] += [w for w, _ in steps[1:]]  # decode steps: step 0 is the prefill
                    cpu[name] += [c for _, c in steps[1:]]
            ratios = report(k, wall, cpu)
            if args.child:
                print("RESULT " + json.dumps({"backend": backend, "k": k, "ratios": ratios}))
            quality = quality_seconds(loaded.info.vocab_size, k)
            print(
                f"    the quality probe alone: {quality * 1e3:.2f} ms a step with {k} rows (one baseline, {k - 1} "
                f"comparisons), {quality / statistics.median(wall['probes off']):.1%} of the probes-off step"
            )
            if args.probe_times:
                times = probe_times(loaded, strategies, args.tokens)
                print("    probes' own host ms a step: " + ", ".join(f"{k} {v:.2f}" for k, v in times.items()))


def quality_seconds(vocab: int, k: int, repeats: int = 50) -> float:
    """Median seconds of one step's quality probe over ``k`` rows of ``vocab`` float32 logits (the
    baseline's distribution once, every other row against it: :class:`StepQuality`, as
    ``run_profile`` calls it)."""
    rng = np.random.default_rng(0)
    rows = list((rng.standard_normal((k, vocab)) * 4).astype(np.float32))
    quality = StepQuality()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        quality(rows, 1)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def probe_times(loaded, strategies: list[str], tokens: int) -> dict[str, float]:
    """Milliseconds per step of each probe's own work in one run of the default probes that
    streams to a CSV file: CPU time of the thread that does it."""
    spent: dict[str, float] = defaultdict(float)
    lock = threading.Lock()

    def timed(name, fn, clock=time.thread_time):
        def wrapper(*args, **kwargs):
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                with lock:
                    spent[name] += clock() - start

        return wrapper

    probe_class = type(probe_for(loaded))
    patches = [
        (run_module._StepQuality, "results", timed("quality", run_module._StepQuality.results)),
        (run_module, "step_rows", timed("rows", run_module.step_rows)),
        (writer_module.ProfileWriter, "write", timed("writer", writer_module.ProfileWriter.write)),
        (probe_class, "pending", timed("pending", probe_class.pending)),
        (probe_class, "masks_before", timed("masks", probe_class.masks_before)),
        (probe_class, "masks_after", timed("masks", probe_class.masks_after)),
        (probe_class, "set_track_error", timed("error switches", probe_class.set_track_error)),
        (probe_class, "views_of", timed("views", probe_class.views_of)),
        (probe_class, "views", timed("views", probe_class.views)),
        (probe_class, "device_memory", timed("system", probe_class.device_memory)),
        (run_module, "process_rss", timed("system", run_module.process_rss)),
    ]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        with tempfile.TemporaryDirectory() as folder:
            run_profile(
                loaded, strategies, prompt=PROMPT, max_tokens=tokens, probes=Probes(), out=Path(folder) / "p.csv"
            )
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
    # set_track_error is inside step_rows (switching off): counted in both, as it is in the step;
    # masks are sampled (every 16 steps and the last), so their rows weigh on few steps
    return {name: spent[name] * 1e3 / tokens for name in sorted(spent)}


TARGET = 0.02  # issue #34: the default probes at most 2% over probes off, judged by the interval's upper bound


def report(k: int, wall: dict[str, list[float]], cpu: dict[str, list[float]]) -> dict[str, float]:
    """Print the table of ``k`` strategies; returns each configuration's median step ratio to
    probes off (the target's verdict printed for the default probes)."""
    ref_wall, ref_cpu = statistics.median(wall["probes off"]), statistics.median(cpu["probes off"])
    out = {}
    for name in wall:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        ratios = [a / b for a, b in zip(wall[name], wall["probes off"])]  # same step, same round
        paired = statistics.median(ratios)
        lo, hi = interval(ratios)
        print(
            f"{k:>3} {name:<24} {w * 1e3:15.2f} {c * 1e3:8.2f} {w / ref_wall - 1:+9.1%} {c / ref_cpu - 1:+13.1%} "
            f"{paired - 1:+18.1%} {f'[{lo - 1:+.1%}, {hi - 1:+.1%}]':>18}"
        )
        if name != "probes off":
            out[name] = paired
        if name == "default probes":
            verdict = "holds" if hi - 1 <= TARGET else "does not hold"
            print(
                f"    target: default probes at most {TARGET:.0%} over probes off (by the interval's upper bound): "
                f"{verdict}"
            )
    return out


# Student's t, 0.975 quantile, 1 to 31 degrees of freedom (any statistics table)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131)
T975 += (2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
T975 += (2.040,)


def over_runs(args) -> None:
    """``--runs``: the measurement in separate processes, then the verdict over runs."""
    results: dict[tuple[str, int, str], list[float]] = {}
    for run in range(args.runs):
        cmd = [sys.executable, __file__, "--child", "--tokens", str(args.tokens), "--rounds", str(args.rounds)]
        cmd += ["--backend", *args.backend, "--strategies", *map(str, args.strategies), "--configs", *args.configs]
        cmd += ["--seed", str(args.seed + run)]
        print(f"\n=== run {run + 1} of {args.runs}")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        print("".join(line for line in proc.stdout.splitlines(keepends=True) if not line.startswith("RESULT ")), end="")
        if proc.returncode:
            sys.exit(f"run {run + 1} failed:\n{proc.stderr[-2000:]}")
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                r = json.loads(line[len("RESULT ") :])
                for name, ratio in r["ratios"].items():
                    results.setdefault((r["backend"], r["k"], name), []).append(ratio)
    print(f"\nover {args.runs} runs: each configuration over probes off, each run's median step ratio")
    for (backend, k, name), ratios in results.items():
        mean, lo, hi = t_interval(ratios)
        runs = ", ".join(f"{r - 1:+.1%}" for r in ratios)
        line = (
            f"  {backend} k={k} {name}: runs {runs}; mean {mean - 1:+.2%}, 95% interval [{lo - 1:+.2%}, {hi - 1:+.2%}]"
        )
        if name == "default probes":
            verdict = "holds" if hi - 1 <= TARGET else "does not hold"
            line += f"; target at most {TARGET:.0%} (by the upper bound): {verdict}"
        elif hi - 1 <= TARGET:
            line += f"; within {TARGET:.0%} by the upper bound"
        else:
            line += f"; over {TARGET:.0%} by the upper bound"
        print(line)


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% Student-t interval of the mean of ``values`` (2 to 32 of them;
    one gives no interval)."""
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return mean, math.nan, math.nan
    half = T975[n - 2] * statistics.stdev(values) / math.sqrt(n)
    return mean, mean - half, mean + half


def interval(ratios: list[float], block: int = 8, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of the median of ``ratios`` (one a decode step, in order): a block bootstrap,
    runs of ``block`` consecutive steps drawn with replacement, since a step's neighbours share its
    drift (an i.i.d. draw would give too narrow an interval)."""
    r = np.asarray(ratios)
    n = len(r)
    if n < 2:
        return (float(r[0]), float(r[0])) if n else (float("nan"), float("nan"))
    block = min(block, n)
    starts = np.random.default_rng(seed).integers(0, n - block + 1, size=(draws, -(-n // block)))
    picks = (starts[:, :, None] + np.arange(block)).reshape(draws, -1)[:, :n]
    lo, hi = np.percentile(np.median(r[picks], axis=1), [2.5, 97.5])
    return float(lo), float(hi)


if __name__ == "__main__":
    main()
