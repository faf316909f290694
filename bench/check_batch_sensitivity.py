"""Why a quantized row of a strategy batch does not give its unbatched logits to float tolerance
(issue 15), measured on the bundled model: not a timing.

A strategy batch feeds each row the same teacher-forced tokens as running that strategy alone,
so a row's logits differ from its unbatched logits only by float rounding: a batched matmul
sums in another order than a one-row matmul, and on MLX the batch attends over dequantized keys
where mlx-lm's unbatched path calls ``quantized_matmul`` on the packed ones (the two agree to
~2e-6 per attention call). For a lossless cache that rounding stays at rounding size. A
quantized cache rounds every new key and value to a code; a ~1e-7 difference moves the few
elements that sit on a rounding boundary to the next code, the next layer's keys then differ by
a quantization step rather than an ulp, and so on: the whole model's output is not a continuous
function of the arithmetic order any more.

This script measures that per quantized strategy, each against the same strategy run alone, all
fed the baseline's greedy tokens (``--steps`` steps, the prompt prefill included), and prints the
worst per-step KL (nats) of:

- ``batch``: the strategy as one row of the batch of ``STRATEGIES`` (what ``run_profile`` does);
- ``1 row``: the strategy alone in a batch of one row (the batch path, no batched matmul);
- ``2 rows``: two rows of the same strategy (the batched matmul, nothing else);
- ``1 ulp``: the strategy alone, unbatched, with every weight of layer 0's attention output
  projection moved by at most one float32 ulp (``w * (1 + 2**-23)``): rounding noise inside the
  reference path itself;
- ``vs full``: the strategy alone against the full cache (its own quality loss), and the mean of
  that KL over the steps as the batched row measured it and as the unbatched run measured it.

If ``1 ulp`` is of the order of ``batch``, no batching scheme that does not repeat the unbatched
arithmetic bit for bit can reach a 1e-5 agreement for that strategy.

    python bench/check_batch_sensitivity.py [--backend mlx torch] [--steps 24]
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager

import numpy as np

from cachelib.decode import Runner, encode_prompt
from cachelib.models import load
from cachelib.profile.backends import probe_for
from cachelib.profile.divergence import compare
from cachelib.spec import parse_spec

PROMPT = "Explain what a KV cache is, and why it matters for serving language models."
STRATEGIES = [
    "standard",
    "rotating:max_size=40,keep=4",
    "quantized:bits=8",
    "quantized:bits=4",
    "quantized:bits=4,group_size=32",
    "kivi:bits=4,residual=8",
]
LOSSY = [s for s in STRATEGIES if not s.startswith(("standard", "rotating"))]
ULP = 2.0**-23


@contextmanager
def nudged(loaded):
    """Layer 0's attention output projection, every weight moved by at most one float32 ulp."""
    proj = loaded.model.model.layers[0].self_attn.o_proj
    if loaded.info.backend == "mlx":
        before = proj.weight
        proj.weight = before * (1 + ULP)
        try:
            yield
        finally:
            proj.weight = before
        return
    import torch

    before = proj.weight.detach().clone()
    with torch.no_grad():
        proj.weight.mul_(1 + ULP)
    try:
        yield
    finally:
        with torch.no_grad():
            proj.weight.copy_(before)


def measure(loaded, steps: int) -> dict[str, dict[str, float]]:
    runner, probe = Runner(loaded), probe_for(loaded)
    make = lambda s: probe.make_cache(parse_spec(s))  # noqa: E731
    prompt = encode_prompt(loaded.tokenizer, PROMPT)
    # the baseline's greedy tokens, which every run is fed
    base, feed, feeds, full = make("standard"), prompt, [], []
    for _ in range(steps):
        feeds.append(feed)
        full.append(runner.step(base, feed))
        feed = [int(np.argmax(full[-1]))]
    out: dict[str, dict[str, float]] = {}
    batch = runner.rows_cache([make(s) for s in STRATEGIES])
    batch_logits = [runner.step_rows(batch, [f] * len(STRATEGIES)) for f in feeds]
    for spec in LOSSY:
        row = STRATEGIES.index(spec)
        alone, one, two = make(spec), runner.rows_cache([make(spec)]), runner.rows_cache([make(spec), make(spec)])
        nudge = make(spec)
        worst = {"batch": 0.0, "1 row": 0.0, "2 rows": 0.0, "1 ulp": 0.0}
        own_alone, own_batch = [], []
        for i, f in enumerate(feeds):
            a = runner.step(alone, f)
            with nudged(loaded):
                n = runner.step(nudge, f)
            got = {
                "batch": batch_logits[i][row],
                "1 row": runner.step_rows(one, [f])[0],
                "2 rows": runner.step_rows(two, [f, f])[0],
                "1 ulp": n,
            }
            target = int(np.argmax(a))
            for k, v in got.items():
                worst[k] = max(worst[k], compare(a, v, target)[0])
            own_alone.append(compare(full[i], a, None)[0])
            own_batch.append(compare(full[i], batch_logits[i][row], None)[0])
        out[spec] = {
            **worst,
            "vs full": max(own_alone),
            "mean vs full, batch": float(np.mean(own_batch)),
            "mean vs full, alone": float(np.mean(own_alone)),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", nargs="+", default=["mlx", "torch"], choices=["mlx", "torch"])
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    cols = ["batch", "1 row", "2 rows", "1 ulp", "vs full", "mean vs full, batch", "mean vs full, alone"]
    for backend in args.backend:
        loaded = load("smollm2", backend)
        print(
            f"\n{backend} ({loaded.info.device}, {loaded.info.dtype}), {args.steps} teacher-forced steps; "
            "worst per-step KL (nats) against the strategy run alone"
        )
        print(f"{'strategy':<34}" + "".join(f"{c:>21}" for c in cols))
        for spec, row in measure(loaded, args.steps).items():
            print(f"{spec:<34}" + "".join(f"{row[c]:>21.3g}" for c in cols), flush=True)


if __name__ == "__main__":
    main()
