"""Prefill and decode speed of the bundled model on each backend, and resident memory after load.

Each backend runs in its own process (so resident memory is that backend's alone), loads the
model, warms up once, then decodes the same chat prompt ``--runs`` times with the model's own
cache; prefill tokens/s and decode tokens/s are quoted as medians.

    python bench/bench_models.py [--backend mlx torch] [--runs 5] [--tokens 128] [--weights auto]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", nargs="+", default=["mlx", "torch"], choices=["mlx", "torch"])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--weights", default="auto", choices=["auto", "quantized", "dequantized"])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.backend[0], args.runs, args.tokens, args.weights)))
        return
    print(f"{'backend':<7} {'device':<6} {'prefill tok/s':>14} {'decode tok/s':>13} {'RSS MiB':>8} {'load s':>7}  weights")
    for backend in args.backend:
        if backend == "torch" and args.weights == "quantized":
            continue
        cmd = [sys.executable, __file__, "--child", "--backend", backend, "--runs", str(args.runs),
               "--tokens", str(args.tokens), "--weights", args.weights]  # fmt: skip
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        print(
            f"{r['backend']:<7} {r['device']:<6} {r['prefill_tok_s']:14.1f} {r['decode_tok_s']:13.1f} "
            f"{r['rss_after_load_mb']:8.0f} {r['load_seconds']:7.1f}  {r['weights']} ({r['prompt_tokens']}-token prompt)"
        )


if __name__ == "__main__":
    main()
