"""Prefill and decode speed of the bundled model on each backend, and resident memory after load.

Each backend runs in its own process (so resident memory is that backend's alone), loads the
model, warms up once, then decodes the same chat prompt ``--runs`` times with the model's own
cache; prefill tokens/s and decode tokens/s are quoted as medians.

``--cold-load`` instead times a cold load of the bundled model (a fresh process each, imports
included) three ways per backend: with the on-disk weights cache off, the first load with the
cache on (it parses and dequantizes the GGUF and writes the cache) and the second (it reads the
cache). A temporary cache folder keeps the user's own; the converted tokenizer is shared.

    python bench/bench_models.py [--backend mlx torch] [--runs 5] [--tokens 128] [--weights auto]
    python bench/bench_models.py --cold-load [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def measure(backend: str, runs: int, tokens: int, weights: str) -> dict:
    import time

    import psutil

    from cachelib.decode import greedy_decode
    from cachelib.models import load

    start = time.perf_counter()
    loaded = load("smollm2", backend, weights=weights)
    load_seconds = time.perf_counter() - start
    rss = psutil.Process().memory_info().rss
    greedy_decode(loaded, PROMPT, max_tokens=8, stop_at_eos=False)  # warm-up
    prefill, decode = [], []
    for _ in range(runs):
        out = greedy_decode(loaded, PROMPT, max_tokens=tokens, stop_at_eos=False)
        prefill.append(out.prefill_tokens_per_second)
        decode.append(out.decode_tokens_per_second)
    return {
        "backend": backend,
        "device": loaded.info.device,
        "weights": loaded.info.weight_format,
        "prompt_tokens": len(out.prompt_ids),
        "load_seconds": load_seconds,
        "rss_after_load_mb": rss / 2**20,
        "prefill_tok_s": statistics.median(prefill),
        "decode_tok_s": statistics.median(decode),
    }


def cold_load(backend: str) -> dict:
    """One cold load in this (fresh) process: seconds from before importing cachelib to the model."""
    start = time.perf_counter()
    from cachelib.models import load

    loaded = load("smollm2", backend)
    return {"seconds": time.perf_counter() - start, "weights": loaded.info.weight_format}


def cold_loads(backends: list[str], runs: int) -> None:
    from cachelib.core.home import cache_dir

    print(
        f"cold load of the bundled model, fresh process each (imports included), median of {runs}; "
        f"{os.cpu_count()} CPU cores"
    )
    print(f"{'backend':<7} {'cache off s':>11} {'first s':>8} {'second s':>9}  weights")
    for backend in backends:
        times: dict[str, list[float]] = {"off": [], "first": [], "second": []}
        for _ in range(runs):
            with tempfile.TemporaryDirectory() as home:
                if (cache_dir() / "tokenizers").is_dir():  # the tokenizer conversion is not what is measured
                    shutil.copytree(cache_dir() / "tokenizers", Path(home) / "tokenizers")
                for kind in times:
                    env = {**os.environ, "CACHELIB_HOME": home, "CACHELIB_WEIGHTS_CACHE": "0" if kind == "off" else "1"}
                    cmd = [sys.executable, __file__, "--child-cold", "--backend", backend]
                    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
                    r = json.loads(out.strip().splitlines()[-1])
                    times[kind].append(r["seconds"])
        med = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"{backend:<7} {med['off']:11.2f} {med['first']:8.2f} {med['second']:9.2f}  {r['weights']} "
            f"(second/off = {med['second'] / med['off']:.2f})",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", nargs="+", default=["mlx", "torch"], choices=["mlx", "torch"])
    ap.add_argument("--runs", type=int, default=None, help="decode runs (default 5); cold loads per kind (default 3)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--weights", default="auto", choices=["auto", "quantized", "dequantized"])
    ap.add_argument("--cold-load", action="store_true", help="time cold loads with and without the weights cache")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-cold", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_cold:
        print(json.dumps(cold_load(args.backend[0])))
        return
    if args.cold_load:
        cold_loads(args.backend, args.runs or 3)
        return
    args.runs = args.runs or 5
    if args.child:
        print(json.dumps(measure(args.backend[0], args.runs, args.tokens, args.weights)))
        return
    print(
        f"{'backend':<7} {'device':<6} {'prefill tok/s':>14} {'decode tok/s':>13} {'RSS MiB':>8} {'load s':>7}  weights"
    )
    for backend in args.backend:
        if backend == "torch" and args.weights == "quantized":
            continue
        cmd = [
            sys.executable,
            __file__,
            "--child",
            "--backend",
            backend,
            "--runs",
            str(args.runs),
            "--tokens",
            str(args.tokens),
            "--weights",
            args.weights,
        ]
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        print(
            f"{r['backend']:<7} {r['device']:<6} {r['prefill_tok_s']:14.1f} {r['decode_tok_s']:13.1f} "
            f"{r['rss_after_load_mb']:8.0f} {r['load_seconds']:7.1f}  {r['weights']} "
            f"({r['prompt_tokens']}-token prompt)"
        )


if __name__ == "__main__":
    main()
