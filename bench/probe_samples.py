"""Where the default probes' time goes, from CPU samples: a py-spy record of
``bench_profiler.py`` split by configuration (each interleaved configuration decodes in a thread
of its own) and by what the sampled stack was in, per strategy count.

    py-spy record --rate 1000 --format raw --threads --nonblocking -o samples.txt -- \\
        python bench/bench_profiler.py --backend torch --tokens 96 --rounds 2 --strategies 3 8
    python bench/probe_samples.py samples.txt --rounds 2 --strategies 3 8

Samples count a thread's time on a core only (py-spy leaves idle threads out), so on MLX they
hold the main thread's host work, not the forward that MLX's own threads compute. A category
counts every sample whose stack passes through a frame whose name contains it; the difference
default - off is what the default probes added there (the whole-thread totals first). Threads
are matched to configurations by what only the default probes run (the quality probe's
``_StepQuality.results``) and to strategy counts by their order of creation (the warm-up pair,
then one pair a round, per count, as ``bench_profiler.py`` starts them).
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict

CATEGORIES = [
    "Runner.step_rows",  # the forward, with the probes' work inside it (error terms)
    "Module._wrapped_call_impl",  # torch: the model's forward alone
    "Model.__call__",  # MLX: building the forward's graph
    "Probe.pending",  # the quantization error's terms (torch: computed; MLX: staged)
    "_StepQuality.results",  # the quality probe
    "step_rows (cachelib/profile/recording",  # the rows of the profile's tables
    "views_of",  # the caches' views (both configurations take them)
]
DEFAULT_ONLY = "_StepQuality.results"


def threads_of(path: str) -> dict[int, list[tuple[list[str], int]]]:
    """Thread id -> [(stack frames, samples)] of a py-spy raw record (``--threads``)."""
    out: dict[int, list] = defaultdict(list)
    with open(path, errors="replace") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit() or not stack.startswith("thread ("):
                continue
            frames = stack.split(";")
            out[int(frames[0][len("thread (") :].split(")")[0])].append((frames[1:], int(count)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("samples", help="py-spy record --format raw --threads output")
    ap.add_argument("--rounds", type=int, default=1, help="as given to bench_profiler.py")
    ap.add_argument("--strategies", type=int, nargs="+", default=[3, 8], help="as given to bench_profiler.py")
    args = ap.parse_args()
    runs = []
    for tid, rows in sorted(threads_of(args.samples).items()):
        if not any("run_profile" in f for frames, _ in rows for f in frames):
            continue  # the main thread, loading and waiting
        default = any(DEFAULT_ONLY in f for frames, _ in rows for f in frames)
        runs.append(("default" if default else "off", rows))
    per_k = 2 * (args.rounds + 1)
    if len(runs) != per_k * len(args.strategies):
        raise SystemExit(
            f"{len(runs)} decoding threads in the record; --rounds {args.rounds} and --strategies "
            f"{' '.join(map(str, args.strategies))} make {per_k * len(args.strategies)}"
        )
    for i, k in enumerate(args.strategies):
        total, by = Counter(), Counter()
        for config, rows in runs[i * per_k + 2 : (i + 1) * per_k]:  # the warm-up pair left out
            for frames, n in rows:
                total[config] += n
                for cat in CATEGORIES:
                    if any(cat in f for f in frames):
                        by[config, cat] += n
        off = total["off"] or 1
        print(f"k={k}: samples off {total['off']}, default {total['default']}: {(total['default'] - off) / off:+.2%}")
        for cat in CATEGORIES:
            d = by["default", cat] - by["off", cat]
            print(f"  {cat[:40]:40s} off {by['off', cat]:7d}  default {by['default', cat]:7d}  {d / off:+.2%} of off")


if __name__ == "__main__":
    main()
