"""Steps/s of a teacher-forced profile of k strategies: a strategy batch (one forward per step,
one row per strategy) against one by one (k forwards per step), on the bundled model, both
backends.

Targets (issue #15): at least 2.5x for 4 strategies, at least 4x for 8. The two modes run
interleaved (batched, one by one, batched, ...) in one process so drift hits them alike; a
step's time is the interval between consecutive step callbacks of ``run_profile`` (default
probes), decode steps only. Medians are quoted.

    python bench/bench_batched.py [--backend mlx torch] [--tokens 256] [--rounds 2] [--strategies 4 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

from cachelib.models import load
from cachelib.profile import run_profile

STRATEGIES = [
    "standard",
    "rotating:max_size=128,keep=4",
    "quantized:bits=8",
    "quantized:bits=4",
    "kivi:bits=4,residual=32",
    "static:max_len=512",
    "rotating:max_size=64,keep=0",
    "concat",
]
PROMPT = "Explain what a KV cache is, and why it matters for serving language models."


def step_intervals(loaded, strategies: list[str], tokens: int, one_by_one: bool) -> tuple[list[float], list[float]]:
    """(wall seconds, CPU seconds) of each decode step."""
    stamps: list[tuple[float, float]] = []
    run_profile(
        loaded, strategies, prompt=PROMPT, max_tokens=tokens, one_by_one=one_by_one,
        on_step=lambda e: stamps.append((time.perf_counter(), time.process_time())),
    )  # fmt: skip
    pairs = list(zip(stamps[1:], stamps[2:]))  # the interval ending at step k >= 2 is step k
    return [b[0] - a[0] for a, b in pairs], [b[1] - a[1] for a, b in pairs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", nargs="+", default=["mlx", "torch"], choices=["mlx", "torch"])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--strategies", type=int, nargs="+", default=[4, 8], choices=range(2, len(STRATEGIES) + 1), metavar="K")
    args = ap.parse_args()
    for backend in args.backend:
        loaded = load("smollm2", backend)
        print(f"\n{backend} ({loaded.info.device}, {loaded.info.dtype}), {args.tokens} tokens x {args.rounds} rounds, teacher-forced")
        print(f"{'k':>3} {'mode':<15} {'median step ms':>15} {'steps/s':>8} {'speed-up':>9} {'CPU ms/step':>12} {'CPU speed-up':>13}")
        for k in args.strategies:
            strategies = STRATEGIES[:k]
            step_intervals(loaded, strategies, 4, False)  # warm-up
            step_intervals(loaded, strategies, 4, True)
            wall: dict[str, list[float]] = {"strategy batch": [], "one by one": []}
            cpu: dict[str, list[float]] = {"strategy batch": [], "one by one": []}
            for _ in range(args.rounds):
                for mode, one_by_one in (("strategy batch", False), ("one by one", True)):
                    w, c = step_intervals(loaded, strategies, args.tokens, one_by_one)
                    wall[mode] += w
                    cpu[mode] += c
            alone, alone_cpu = statistics.median(wall["one by one"]), statistics.median(cpu["one by one"])
            for mode in wall:
                med, med_cpu = statistics.median(wall[mode]), statistics.median(cpu[mode])
                print(
                    f"{k:>3} {mode:<15} {med * 1e3:15.2f} {1 / med:8.2f} {alone / med:8.2f}x "
                    f"{med_cpu * 1e3:12.2f} {alone_cpu / med_cpu if med_cpu else float('nan'):12.2f}x"
                )


if __name__ == "__main__":
    main()
