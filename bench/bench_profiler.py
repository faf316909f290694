"""What the profiler's probes cost: decode tokens/s with no probes, with the per-step memory and
ring probes, and with every probe every step, on the bundled model, both backends.

Targets (issue #5): memory+ring at most 3% slower than no probes; every probe every step at most
15% slower. The three configurations run interleaved (A B C A B C ...) in one process so drift
hits them alike; a step's time is the interval between consecutive step callbacks, so it
includes all probe work and row building. Medians are quoted.

    python bench/bench_profiler.py [--backend mlx torch] [--tokens 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from cachelib.models import load
from cachelib.profile import Probes, run_profile

CONFIGS = {
    "no probes": Probes.none(),
    "memory+ring": Probes(memory=1, ring=1, quant_error=0, quality=0, masks=0, system=0),
    "every probe, every step": Probes.every_step(),
}
STRATEGIES = ["standard", "rotating:max_size=64,keep=4", "quantized:bits=4"]
PROMPT = "Explain what a KV cache is, and why it matters for serving language models."


def step_intervals(loaded, probes: Probes, tokens: int) -> list[float]:
    stamps: list[float] = []
    run_profile(loaded, STRATEGIES, prompt=PROMPT, max_tokens=tokens, probes=probes, on_step=lambda e: stamps.append(time.perf_counter()))
    # Decode steps only: the interval ending at step k (k >= 2) covers step k alone.
    return [b - a for a, b in zip(stamps[1:], stamps[2:])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", nargs="+", default=["mlx", "torch"], choices=["mlx", "torch"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    for backend in args.backend:
        loaded = load("smollm2", backend)
        step_intervals(loaded, Probes.none(), 8)  # warm-up
        times: dict[str, list[float]] = {k: [] for k in CONFIGS}
        for _ in range(args.rounds):
            for name, probes in CONFIGS.items():
                times[name] += step_intervals(loaded, probes, args.tokens)
        base = statistics.median(times["no probes"])
        print(f"\n{backend} ({loaded.info.device}), {len(STRATEGIES)} strategies per step, {args.tokens} tokens x {args.rounds} rounds")
        print(f"{'configuration':<26} {'median step ms':>15} {'tok/s':>8} {'slowdown':>9}")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"{name:<26} {med * 1e3:15.2f} {len(STRATEGIES) / med:8.2f} {med / base - 1:9.1%}")


if __name__ == "__main__":
    main()
