"""What checking a prompt-cache file before any array is made costs (issue #33).

``cachelib.mlx.load_prompt_cache`` reads safetensors in Python (``cachelib.mlx.safetensors``:
file type, header, every tensor's dtype, shape and offsets, then one buffer filled in place)
instead of handing the file to MLX's native ``mx.load``. This writes a prompt cache of
``--layers`` KVCache layers of (1, ``--heads``, ``--tokens``, 64) float32 keys and values
(SmolLM2-135M's 30 layers and 3 KV heads by default: 189 MB at 4,000 tokens) and times, interleaved,
``mx.load`` (the reference), :func:`read_safetensors` and the whole ``load_prompt_cache``,
arrays evaluated. Prints the medians and the ratios against ``mx.load`` measured in the same run,
and the process's peak resident memory over the file size.

    source scripts/env.sh && python bench/bench_prompt_cache_load.py [--layers 30] [--tokens 4000] [--runs 7]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

import cachelib.mlx as ours  # noqa: E402
from cachelib.mlx.safetensors import read_safetensors  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "cache.safetensors")
        caches = []
        for _ in range(args.layers):
            cache = ours.KVCache()
            k = mx.random.normal((1, args.heads, args.tokens, 64))
            cache.update_and_fetch(k, k)
            caches.append(cache)
        ours.save_prompt_cache(path, caches)
        del caches
        size = os.path.getsize(path)
        ways = {
            "mx.load (reference)": lambda: list(mx.load(path, return_metadata=True)[0].values()),
            "read_safetensors": lambda: list(read_safetensors(path)[0].values()),
            "load_prompt_cache": lambda: [
                a for c in ours.load_prompt_cache(path) for a in c.state if isinstance(a, mx.array)
            ],
        }
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.runs):  # interleaved, so a busy moment hits every way alike
            for name, load in ways.items():
                t0 = time.perf_counter()
                arrays = load()
                mx.eval(arrays)
                times[name].append(time.perf_counter() - t0)
                del arrays
        reference = statistics.median(times["mx.load (reference)"])
        print(
            f"prompt cache: {args.layers} layers x (1, {args.heads}, {args.tokens}, 64) float32 K and V, "
            f"{size / 1e6:.1f} MB; median of {args.runs} runs"
        )
        for name, values in times.items():
            median = statistics.median(values)
            print(f"  {name:<22} {median * 1000:8.1f} ms   {median / reference:5.2f}x mx.load")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        print(f"  peak resident memory of this process: {peak / 1e6:.0f} MB ({peak / size:.1f}x the file)")


if __name__ == "__main__":
    main()
