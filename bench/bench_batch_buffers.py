"""What the MLX strategy batch's key/value buffers save: the batch's forward step (no probes) with
the buffers (each step writes only what changed into them) against the same batch copying every
row's whole keys and values into a padded batch every layer (``buffer_bytes=0``, what the batch
did before, and does past its byte limit), beside the runtime's own batch of k identical rows
(mlx-lm's ``make_prompt_cache``), on the bundled model.

The three decodes take one step each in turn, fed the same teacher-forced tokens; the medians of
the first and the last ``--window`` decode steps are printed (the copy grows with the tokens
held, the buffered write does not).

    python bench/bench_batch_buffers.py [--tokens 256] [--strategies 8] [--window 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_batched import PROMPT, STRATEGIES, RuntimeDecode, token_stream

from cachelib.decode import Runner, encode_prompt
from cachelib.mlx.rows import make_rows_cache
from cachelib.models import load
from cachelib.profile.backends import probe_for
from cachelib.spec import parse_spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--strategies", type=int, default=8, choices=range(2, len(STRATEGIES) + 1), metavar="K")
    ap.add_argument("--window", type=int, default=30)
    args = ap.parse_args()
    if args.tokens < 2 * args.window + 1:
        ap.error(f"--tokens must be at least 2 x --window + 1 = {2 * args.window + 1}")
    loaded = load("smollm2", "mlx")
    runner, probe = Runner(loaded), probe_for(loaded)
    feeds = token_stream(loaded, encode_prompt(loaded.tokenizer, PROMPT), args.tokens)
    specs = [parse_spec(s) for s in STRATEGIES[: args.strategies]]
    k = len(specs)
    batches = {
        "strategy batch, buffers": make_rows_cache([probe.make_cache(s) for s in specs]),
        "strategy batch, copied": make_rows_cache([probe.make_cache(s) for s in specs], buffer_bytes=0),
    }
    runtime = RuntimeDecode(loaded, k)
    times: dict[str, list[float]] = {n: [] for n in (*batches, f"runtime, batch of {k}")}
    for ids in feeds:
        for name, rows in batches.items():
            t = time.perf_counter()
            runner.step_rows(rows, [ids] * k)
            times[name].append(time.perf_counter() - t)
        t = time.perf_counter()
        runtime.step(ids)
        times[f"runtime, batch of {k}"].append(time.perf_counter() - t)
    w = args.window
    print(f"mlx, {k} strategies, {args.tokens} teacher-forced tokens, median forward step ms (decode steps)")
    print(f"{'mode':<28} {'first ' + str(w):>10} {'last ' + str(w):>10}")
    for name, ts in times.items():
        decode = ts[1:]  # step 0 is the prefill
        print(f"{name:<28} {statistics.median(decode[:w]) * 1e3:10.1f} {statistics.median(decode[-w:]) * 1e3:10.1f}")


if __name__ == "__main__":
    main()
