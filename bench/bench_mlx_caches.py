"""Decode speed of the bundled SmolLM2 on MLX: our caches against mlx-lm's classes with the same
settings, interleaved in one run.

For each setting both caches are prefilled with the same prompt, then decoded greedily one
token at a time, alternating ours and mlx-lm's every step (so drifting machine load hits both
alike). Prints the median decode tokens/s of each and the ratio ours / mlx-lm (target >= 0.98),
plus the cost of introspecting the whole model's cache once.

    source .venv/bin/activate && source scripts/env.sh
    python bench/bench_mlx_caches.py                 # 512 decoded tokens per cache
    python bench/bench_mlx_caches.py --tokens 128    # quicker
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx_lm.models.cache as ref
import numpy as np

import cachelib.mlx as ours
from cachelib.decode import Runner, encode_prompt
from cachelib.models import load

PROMPT = "Write a long story about a robot who learns to paint, with many characters and places."

SETTINGS = {
    "KVCache": (ours.KVCache, ref.KVCache),
    "RotatingKVCache(256, 4)": (lambda: ours.RotatingKVCache(256, 4), lambda: ref.RotatingKVCache(256, 4)),
    "QuantizedKVCache(bits=4)": (lambda: ours.QuantizedKVCache(bits=4), lambda: ref.QuantizedKVCache(bits=4)),
}


def bench_setting(runner: Runner, prompt: list[int], make_ours, make_theirs, tokens: int, layers: int):
    caches = {"ours": [make_ours() for _ in range(layers)], "mlx-lm": [make_theirs() for _ in range(layers)]}
    last = {name: int(np.argmax(runner.step(cache, prompt))) for name, cache in caches.items()}
    times: dict[str, list[float]] = {name: [] for name in caches}
    order = list(caches)
    for step in range(tokens):
        for name in order if step % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            last[name] = int(np.argmax(runner.step(caches[name], [last[name]])))
            times[name].append(time.perf_counter() - start)
    return times, caches["ours"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="decoded tokens per cache (default 512)")
    parser.add_argument("--settings", nargs="*", choices=list(SETTINGS), default=list(SETTINGS))
    args = parser.parse_args()
    if args.tokens < 1:
        raise SystemExit("--tokens must be >= 1")

    loaded = load("smollm2", "mlx")
    runner = Runner(loaded)
    prompt = encode_prompt(loaded.tokenizer, PROMPT)
    layers = len(loaded.model.layers)
    print(
        f"{loaded.info.name} on {loaded.info.device} ({loaded.info.weight_format}); "
        f"prompt {len(prompt)} tokens, {args.tokens} decoded tokens per cache, interleaved per step\n"
    )
    print(f"{'cache':<28}{'ours tok/s':>12}{'mlx-lm tok/s':>14}{'ratio':>8}")
    for setting in args.settings:
        times, cache = bench_setting(runner, prompt, *SETTINGS[setting], args.tokens, layers)
        mine, theirs = (1.0 / statistics.median(times[name]) for name in ("ours", "mlx-lm"))
        print(f"{setting:<28}{mine:>12.2f}{theirs:>14.2f}{mine / theirs:>8.3f}", flush=True)
        reps = 200
        start = time.perf_counter()
        for _ in range(reps):
            ours.introspect(cache)
        per_call = (time.perf_counter() - start) / reps
        step = statistics.median(times["ours"])
        print(
            f"{'':<28}introspect() of all {layers} layers: {per_call * 1e6:.0f} us "
            f"({100 * per_call / step:.2f}% of a decode step)",
            flush=True,
        )


if __name__ == "__main__":
    main()
