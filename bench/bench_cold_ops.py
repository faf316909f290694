"""What a stream of memory does to the small ops that follow it: the torch quantization error of
one decode step (``resolve_errors`` over ``--layers`` layers x ``--rows`` quantized rows, each a
(1, 3, 1, 64) key and value and their reconstructions, SmolLM2's shapes), timed warm and right
after reading an array of N MB, as a forward's weights are read just before the probes run.

The LM head of SmolLM2-135M in float32 is 113 MB (49,152 x 576 x 4 bytes), a decoder layer's
weights ~10 MB: why the torch runner has the probe compute the error as the last layer's rows
have updated, before the LM head (``Runner.step_rows``), not after it.

    python bench/bench_cold_ops.py [--rows 2] [--layers 30] [--mb 4 10 32 64 128 512] [--repeats 100]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from cachelib.torch.base import Decoded, resolve_errors


class _Layer:
    """A quantizing layer's error state, as ``resolve_errors`` reads and writes it."""

    _pending_error = None
    _last_error = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2, help="quantized rows in the batch")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--mb", type=int, nargs="+", default=[4, 10, 32, 64, 128, 512], help="MB read first")
    ap.add_argument("--repeats", type=int, default=100)
    args = ap.parse_args()
    for name in ("rows", "layers", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if min(args.mb) < 1:
        ap.error(f"--mb takes sizes >= 1, got {min(args.mb)}")
    g = torch.Generator().manual_seed(0)
    states = [torch.randn(1, 3, 1, 64, generator=g) for _ in range(2 * args.layers * args.rows)]
    pending = [
        Decoded(k, k + 0.01 * torch.randn(k.shape, generator=g), v, v + 0.01 * torch.randn(v.shape, generator=g))
        for k, v in zip(states[0::2], states[1::2])
    ]
    layers = [_Layer() for _ in pending]

    def once() -> float:
        for layer, p in zip(layers, pending):
            layer._pending_error = p
        start = time.perf_counter()
        resolve_errors(layers)
        return time.perf_counter() - start

    once()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); {len(layers)} layer errors a step")
    print(f"{'MB read first':>14} {'median us':>10} {'x warm':>7}")
    warm = statistics.median(once() for _ in range(args.repeats))
    print(f"{'none (warm)':>14} {warm * 1e6:>10.0f} {1:>7.2f}")
    for mb in args.mb:
        stream = np.ones((mb << 20) // 8)
        times = []
        for _ in range(args.repeats):
            stream.sum()  # reads every byte once
            times.append(once())
        median = statistics.median(times)
        print(f"{mb:>14} {median * 1e6:>10.0f} {median / warm:>7.2f}")


if __name__ == "__main__":
    main()
