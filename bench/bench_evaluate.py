"""What chunked prefill buys the long-context evaluation: the time of one evaluation of 4
strategies on the bundled model with mlx-lm's chunked prefill (2048 tokens per forward pass)
against the same evaluation with the context fed token by token, on the same tokens.

Target (issue 11): chunked at least 5x faster at a 4,096-token context. Both variants run
interleaved (chunked, token-by-token, chunked, ...) in one process, so drift hits them alike;
medians of ``--runs`` are quoted. Scoring is the same in both (``--score-tokens`` teacher-forced
steps per strategy); only the prefill differs. The token-by-token variant is slow: at 4,096
tokens it is ~4 x 4,096 forward passes per run; ``--context 1024`` is a quick run.

    python bench/bench_evaluate.py [--backend mlx] [--context 4096] [--score-tokens 128] [--runs 1]

With ``--bound`` (torch; issue #34) it times instead one ``evaluate`` of ``--bound-strategies``
(one strategy batch: one forward per prefill chunk or scored token for all rows) against the
compute bound of those forwards: their FLOPs (every linear layer, causal attention over the keys
each token sees, the LM head for the one position kept) over the float32 matmul rate measured in
the same run on a prefill-shaped product (chunk x hidden @ hidden x intermediate; the best rate
this machine gives, so the bound is a lower bound). It also prints the time in the prefill
chunks and in the scored steps, each against its share of the bound, and a roofline where a scored
step (memory-bound: a few rows) costs at least one read of every weight at the parameter-read rate
measured in the same run. Beside it, taking turns with ``evaluate`` run by run, transformers' own
``DynamicCache`` batch of k identical rows doing the same forwards (the runtime's floor for them)
against the same bound. Where the batch forwards its first chunk once for rows that take it
alike (``RowsCache.advance_once``: bit for bit the batch's own caches), the forwards it runs are
fewer than the k-row forwards: both bounds are printed, and the target is read against the k-row
one (the work an evaluation of k strategies stands for), never the smaller:

    python bench/bench_evaluate.py --backend torch --bound --context 1024 --score-tokens 32 --runs 2
"""

from __future__ import annotations

import argparse
import statistics
import time

from cachelib.models import load
from cachelib.profile import evaluate
from cachelib.profile.evaluate import CORPUS, encode_text

STRATEGIES = ["standard", "rotating:max_size=1024,keep=4", "quantized:bits=4,group_size=64", "kivi"]
TEXT = CORPUS / "pride-and-prejudice.txt"


def seconds(loaded, context: int, score_tokens: int, prefill_chunk: int, name: str) -> tuple[float, object]:
    start = time.perf_counter()

    def progress(step) -> None:  # each strategy as it finishes: a run stopped early still tells something
        print(
            f"    {name} {step.done}/{step.total} {step.row['strategy']}: {step.row['seconds']:.1f} s "
            f"(elapsed {time.perf_counter() - start:.0f} s)",
            flush=True,
        )

    ev = evaluate(
        loaded,
        STRATEGIES,
        texts=[TEXT],
        context=context,
        score_tokens=score_tokens,
        windows=1,
        prefill_chunk=prefill_chunk,
        on_progress=progress,
    )
    return time.perf_counter() - start, ev


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="mlx", choices=["mlx", "torch"])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--score-tokens", type=int, default=128)
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--bound", action="store_true", help="torch: evaluate against its forwards' compute bound")
    ap.add_argument("--bound-strategies", nargs="+", default=["standard", "kivi:bits=4"])
    args = ap.parse_args()
    if args.bound:
        compute_bound(args)
        return
    loaded = load("smollm2", args.backend)
    evaluate(loaded, ["standard"], texts=[TEXT], context=64, score_tokens=4, windows=1)  # warm-up
    times: dict[str, list[float]] = {"chunked": [], "token-by-token": []}
    results = {}
    for _ in range(args.runs):
        for name, chunk in (("chunked", args.prefill_chunk), ("token-by-token", 1)):
            t, results[name] = seconds(loaded, args.context, args.score_tokens, chunk, name)
            times[name].append(t)
            print(f"  {name}: {t:.1f} s", flush=True)
    chunked, single = (statistics.median(times[k]) for k in ("chunked", "token-by-token"))
    print(
        f"\n{args.backend} ({loaded.info.device}): evaluation of {len(STRATEGIES)} strategies at "
        f"{args.context} tokens, {args.score_tokens} scored, 1 window, median of {args.runs}"
    )
    print(f"{'prefill':<26} {'seconds':>9}")
    print(f"{f'chunked ({args.prefill_chunk} per pass)':<26} {chunked:9.1f}")
    print(f"{'token by token':<26} {single:9.1f}")
    print(f"speed-up: {single / chunked:.1f}x (target >= 5x)")
    frames = {k: results[k].samples.set_index("strategy") for k in ("chunked", "token-by-token")}
    print(f"\n{'strategy (last run)':<34} {'chunked s':>10} {'token s':>9} {'KL chunked':>11} {'KL token':>9}")
    for s in STRATEGIES:
        c, t = frames["chunked"].loc[s], frames["token-by-token"].loc[s]
        print(f"{s:<34} {c['seconds']:10.1f} {t['seconds']:9.1f} {c['mean_kl']:11.4f} {t['mean_kl']:9.4f}")


def forward_flops(config, rows: int, past: int, n: int) -> float:
    """FLOPs of one forward of ``n`` new tokens per row after ``past`` held, ``rows`` rows, one
    position's logits kept: 2 per multiply-add of the linear layers, causal attention (query i
    of the chunk reads ``past + i + 1`` keys: QK and AV) and the LM head."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or hidden // heads
    linear = 2 * hidden * heads * dim + 2 * hidden * kv * dim + 3 * hidden * config.intermediate_size
    keys_read = n * past + n * (n + 1) / 2
    per_row = layers * (2 * linear * n + 2 * 2 * heads * dim * keys_read) + 2 * hidden * config.vocab_size
    return rows * per_row


def matmul_rate(config, chunk: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a float32 (chunk x hidden) @ (hidden x intermediate) product, median of ``repeats``."""
    import torch

    a, b = torch.randn(chunk, config.hidden_size), torch.randn(config.hidden_size, config.intermediate_size)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * chunk * config.hidden_size * config.intermediate_size / statistics.median(times)


def read_rate(model, repeats: int = 3) -> float:
    """Bytes/s of reading every parameter of ``model`` once (a sum per tensor), median of ``repeats``:
    the rate a decode step's weight reads cannot beat."""
    import torch

    params = list(model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for p in params:
                p.sum()
            times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times[1:])


class PhaseClock:
    """Seconds ``evaluate`` spends in the strategy batch's prefill chunks (``Runner.advance_rows``
    and ``RowsCache.advance_once``, a first chunk forwarded once for its rows) and in its scored
    steps (``Runner.step_rows``), summed: the rest of its time is neither. ``once`` counts the
    first chunks forwarded once."""

    def __init__(self):
        from cachelib.decode import Runner
        from cachelib.torch.rows import RowsCache

        self.seconds, self.once = {"advance_rows": 0.0, "step_rows": 0.0}, 0
        self.originals = {
            (Runner, "advance_rows"): ("advance_rows", Runner.advance_rows),
            (Runner, "step_rows"): ("step_rows", Runner.step_rows),
            (RowsCache, "advance_once"): ("advance_rows", RowsCache.advance_once),
        }

    def __enter__(self):
        for (owner, attr), (bucket, original) in self.originals.items():
            setattr(owner, attr, self._timed(bucket, original, attr == "advance_once"))
        return self

    def __exit__(self, *exc):
        for (owner, attr), (_, original) in self.originals.items():
            setattr(owner, attr, original)

    def _timed(self, bucket, original, count: bool):
        def timed(*a, **kw):
            start = time.perf_counter()
            try:
                out = original(*a, **kw)
                self.once += bool(count and out)
                return out
            finally:
                self.seconds[bucket] += time.perf_counter() - start

        return timed


def compute_bound(args) -> None:
    loaded = load("smollm2", "torch")
    config = loaded.model.config.get_text_config(decoder=True)
    k, context, chunk = len(args.bound_strategies), args.context, args.prefill_chunk
    # evaluate's forwards: the context but its last token in chunks, then one token a step
    prefill_flops, past, first_chunk = 0.0, 0, 0.0
    for s in range(0, context - 1, chunk):
        n = min(chunk, context - 1 - s)
        prefill_flops += forward_flops(config, k, past, n)
        first_chunk = first_chunk or forward_flops(config, k, past, n)
        past += n
    step_flops = []
    for _ in range(args.score_tokens):
        step_flops.append(forward_flops(config, k, past, 1))
        past += 1
    flops = prefill_flops + sum(step_flops)
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    evaluate(loaded, ["standard"], texts=[TEXT], context=64, score_tokens=4, windows=1)  # warm-up (and tokenizes)
    window = list(encode_text(loaded.tokenizer, TEXT.read_text(encoding="utf-8")))[: context + args.score_tokens]
    runs, rates, reads, phases, theirs, onces = [], [], [], [], [], []
    for r in range(args.runs):
        rates.append(matmul_rate(config))
        reads.append(read_rate(loaded.model))
        for which in ("ours", "theirs") if r % 2 == 0 else ("theirs", "ours"):
            if which == "theirs":
                theirs.append(runtime_pass(loaded, k, window[:context], window[context:], chunk))
                continue
            with PhaseClock() as clock:
                start = time.perf_counter()
                evaluate(
                    loaded,
                    args.bound_strategies,
                    texts=[TEXT],
                    context=context,
                    score_tokens=args.score_tokens,
                    windows=1,
                )
                runs.append(time.perf_counter() - start)
            phases.append(dict(clock.seconds))
            onces.append(clock.once)
    rate, read, took = statistics.median(rates), statistics.median(reads), statistics.median(runs)
    prefill_s, steps_s = (statistics.median(p[name] for p in phases) for name in ("advance_rows", "step_rows"))
    ref_prefill, ref_steps = (statistics.median(t[i] for t in theirs) for i in (0, 1))
    bound = flops / rate
    # a roofline per forward: a scored step reads every weight once, whatever its FLOPs
    steps_roof = sum(max(f / rate, weight_bytes / read) for f in step_flops)
    roof = prefill_flops / rate + steps_roof
    print(
        f"torch ({loaded.info.device}, {loaded.info.dtype}): evaluate of {k} strategies "
        f"({', '.join(args.bound_strategies)}) at {context} tokens, {args.score_tokens} scored, 1 window, "
        f"median of {args.runs} (a shared, busy machine)"
    )
    print(
        f"forwards: {flops / 1e9:.1f} GFLOP; matmul rate measured {rate / 1e9:.1f} GFLOP/s (float32, {chunk} rows); "
        f"weights {weight_bytes / 1e6:.0f} MB read at {read / 1e9:.1f} GB/s"
    )
    print(f"{'phase':<26} {'measured s':>10} {'compute bound s':>16} {'roofline s':>11}")
    print(f"{'prefill (advance_rows)':<26} {prefill_s:10.2f} {prefill_flops / rate:16.2f} {prefill_flops / rate:11.2f}")
    print(f"{'scored steps (step_rows)':<26} {steps_s:10.2f} {sum(step_flops) / rate:16.2f} {steps_roof:11.2f}")
    print(f"{'the rest':<26} {took - prefill_s - steps_s:10.2f}")
    print(f"evaluate {took:.2f} s, compute bound {bound:.2f} s: {took / bound:.2f}x the bound (target <= 2x)")
    if any(onces):
        # the first chunk ran once for the k rows (advance_once): fewer forwards than the k-row bound's
        run_flops = flops - first_chunk * (k - 1) / k
        print(
            f"  the batch forwarded its first chunk once for its {k} rows (in {sum(map(bool, onces))} of {len(onces)} "
            f"runs; the same caches bit for bit): the forwards it ran are {run_flops / 1e9:.1f} GFLOP, bound "
            f"{run_flops / rate:.2f} s, {took / (run_flops / rate):.2f}x that; the target is read against the "
            f"{k}-row bound above"
        )
    print(f"against the roofline (weights read once per scored step): {roof:.2f} s, {took / roof:.2f}x")
    ref = ref_prefill + ref_steps
    print(
        f"transformers' own batch of {k} identical rows, the same forwards (taking turns with evaluate): prefill "
        f"{ref_prefill:.2f} s, scored steps {ref_steps:.2f} s, {ref:.2f} s = {ref / bound:.2f}x the bound; "
        f"evaluate {took / ref:.3f}x it (prefill {prefill_s / ref_prefill:.3f}x, steps {steps_s / ref_steps:.3f}x)"
    )


def runtime_pass(loaded, k: int, prefix: list[int], scored: list[int], chunk: int) -> tuple[float, float]:
    """Seconds of transformers' own ``DynamicCache`` batch of ``k`` identical rows doing
    ``evaluate``'s forwards (all but the last prefix token in chunks, then one token a step, each
    step's last logits to numpy): (prefill, scored steps)."""
    import torch

    from cachelib.decode import Runner

    cache, model = Runner(loaded).default_cache(), loaded.model
    with torch.inference_mode():
        start = time.perf_counter()
        for s in range(0, len(prefix) - 1, chunk):
            x = torch.tensor([prefix[s : min(s + chunk, len(prefix) - 1)]] * k)
            model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        for token in [prefix[-1]] + scored[:-1]:
            out = model(input_ids=torch.tensor([[token]] * k), cache=cache, use_cache=True, logits_to_keep=1)
            out.logits[:, -1].float().cpu().numpy()
        return prefill, time.perf_counter() - start


if __name__ == "__main__":
    main()
