"""Decode-speed cost of the importance caches (knorm, snapkv, pyramidkv, tova, h2o) against the full cache
and a ring of the same size, per backend, on the bundled model (issue 14).

Every cache of a backend decodes the same token stream in lockstep: a prompt of
``--prompt-tokens`` tokens (the corpus text, cut to length) is prefilled in one forward, then
``--tokens`` steps follow, each cache taking every step in turn (the order rotates, so machine
noise hits all alike), fed the greedy tokens of the full cache. Each forward runs inside the
attention-capture hook (``probe.capture``), as the profiler runs it. Reported per cache: the
median decode-step time and its ratio to the full cache (``standard``) measured in the same run,
the same ratio of the process CPU time per step (``CPU x std``, steadier on a busy machine), the
median time the cache spent scoring keys per step (``score_seconds``, summed over layers:
the hook's extra attention and the eviction), and the cache bytes at the end.

    source scripts/env.sh && python bench/bench_importance.py [--backends mlx,torch]
        [--budget 256] [--prompt-tokens 1024] [--tokens 64] [--model smollm2] [--methods tova,h2o,knorm]

Issue #34's target (MLX, scores and selection on the device): tova, h2o and knorm at most 10%
slower per decode step than the full cache, a 300-token prompt and a 256-token budget:
``--backends mlx --prompt-tokens 300 --budget 256 --methods tova,h2o,knorm``. On MLX the
scoring runs inside the step's one evaluation, so ``score ms`` is only the host time spent
queuing it; the step time holds the scoring.

``--layers-only`` (MLX) times the caches alone, no model: ``--layers`` layer caches of SmolLM2-135M's
shapes (3 KV heads, 9 query heads, head dim 64) take a ``--prompt-tokens`` prefill of random keys
and then ``--tokens`` one-token updates, each followed by the layer's attention over what the
cache returns (a random query, through mlx-lm's attention function and, for the importance
caches, the capture hook around the step, as a model runs them), one step of every cache in
turn, evaluated per step; the median process CPU time per step of each importance cache minus
mlx-lm's ``KVCache`` beside it is the cache's own cost per decode step (its attention over its
budget of keys against the full cache's over all), the figure a loaded machine blurs least.

``--retrieval`` measures quality instead: the passkey task of :mod:`cachelib.profile.retrieval`
(needle at ``--depth`` of a ``--context``-token prompt, ``--trials`` trials) with the question
prefilled as part of the prompt, as SnapKV is meant to see it (as ``cachelib retrieval`` does by
default, ``--question prompt``; this script adds the KL over the key tokens). Per
strategy and budget: exact-match accuracy, mean key-token accuracy, mean KL(full || strategy)
over the key tokens, and the cache bytes at the end:

    python bench/bench_importance.py --retrieval [--budgets 256,512] [--context 2048]
        [--depth 0.1] [--trials 2] [--backends mlx]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cachelib.decode import Runner  # noqa: E402
from cachelib.models import load  # noqa: E402
from cachelib.profile.backends import probe_for  # noqa: E402
from cachelib.spec import parse_spec  # noqa: E402


def specs_for(budget: int) -> list[str]:
    return [
        "standard",
        f"rotating:max_size={budget},keep=4",
        f"knorm:budget={budget}",
        f"snapkv:budget={budget},window=16",
        f"snapkv:budget={budget},window=16,adaptive=1",  # Ada-KV's per-head budgets, 20% safeguard
        f"pyramidkv:budget={budget},window=16,beta={max(1, min(20, budget // 16))}",  # top layer >= the window
        f"tova:budget={budget}",
        f"h2o:budget={budget},recent=32",
    ]


def prompt_ids(loaded, n: int) -> list[int]:
    text = " ".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "assets" / "corpus").glob("*.txt")))
    ids = [int(i) for i in loaded.tokenizer.encode(text)]
    if len(ids) < n:
        raise SystemExit(f"the corpus has {len(ids)} tokens; --prompt-tokens {n} is more")
    return ids[:n]


def run_backend(backend: str, model: str, specs: list[str], n_prompt: int, n_tokens: int) -> list[dict]:
    loaded = load(model, backend)
    runner, probe = Runner(loaded), probe_for(loaded)
    ids = prompt_ids(loaded, n_prompt)
    caches = {s: probe.make_cache(parse_spec(s)) for s in specs}
    times: dict[str, list[float]] = {s: [] for s in specs}
    cpu: dict[str, list[float]] = {s: [] for s in specs}  # process CPU seconds: steadier on a busy machine
    scoring: dict[str, list[float]] = {s: [] for s in specs}
    token = None
    for s in specs:  # prefill, untimed
        with probe.capture(caches[s]):
            logits = runner.step(caches[s], ids)
        if token is None:
            token = int(logits.argmax())
    for step in range(n_tokens):
        order = specs[step % len(specs) :] + specs[: step % len(specs)]
        next_token = token
        for s in order:
            start, start_cpu = time.perf_counter(), time.process_time()
            with probe.capture(caches[s]):
                logits = runner.step(caches[s], [token])
            times[s].append(time.perf_counter() - start)
            cpu[s].append(time.process_time() - start_cpu)
            scoring[s].append(sum(v.score_seconds for v in probe.views(caches[s])))
            if s == specs[0]:
                next_token = int(logits.argmax())
        token = next_token
    base = statistics.median(times[specs[0]])
    base_cpu = statistics.median(cpu[specs[0]])
    rows = []
    for s in specs:
        med = statistics.median(times[s])
        views = probe.views(caches[s])
        rows.append(
            {
                "backend": backend,
                "strategy": s,
                "median_step_ms": 1e3 * med,
                "ratio_to_standard": med / base,
                "cpu_ratio_to_standard": statistics.median(cpu[s]) / base_cpu,
                "median_score_ms": 1e3 * statistics.median(scoring[s]),
                "tokens_held": max(v.tokens_held for v in views),
                "cache_bytes": sum(v.bytes_allocated for v in views),
            }
        )
    return rows


def run_layers_only(methods: list[str], budget: int, n_prompt: int, n_tokens: int, layers: int) -> None:
    import contextlib

    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import base
    from mlx_lm.models.cache import KVCache

    from cachelib.core.importance import policy_of
    from cachelib.mlx import hooks
    from cachelib.mlx.importance import ImportanceKVCache
    from cachelib.spec import parse_spec

    h_kv, h_q, d = 3, 9, 64
    knobs = {"h2o": ",recent=32"}
    caches = {"mlx-lm KVCache": [KVCache() for _ in range(layers)]}
    for m in methods:
        caches[m] = [
            ImportanceKVCache(policy_of(parse_spec(f"{m}:budget={budget}{knobs.get(m, '')}"))) for _ in range(layers)
        ]
    # this module stands for a model's: its layers call the attention function by this name, which
    # the capture hook wraps for the importance caches (as cachelib.profile and this bench's model runs do)
    globals()[hooks.NAME] = base.scaled_dot_product_attention

    class Layers(nn.Module):
        pass

    model = Layers()

    def step(name: str, n: int) -> float:
        k, v, q = (mx.random.normal((1, h, n, d)) for h in (h_kv, h_kv, h_q))
        mx.eval(k, v, q)
        capture = contextlib.nullcontext() if name == "mlx-lm KVCache" else hooks.capture(model)
        start = time.process_time()
        out = []
        with capture:
            for c in caches[name]:
                keys, values = c.update_and_fetch(k, v)
                attend = globals()[hooks.NAME]
                out.append(attend(q, keys, values, cache=c, scale=d**-0.5, mask="causal" if n > 1 else None))
        mx.eval(out)
        return time.process_time() - start

    for name in caches:
        step(name, n_prompt)
    cpu = {name: [] for name in caches}
    for i in range(n_tokens):
        for name in list(caches)[i % len(caches) :] + list(caches)[: i % len(caches)]:
            cpu[name].append(step(name, 1))
    base = statistics.median(cpu["mlx-lm KVCache"][2:])
    print(f"MLX caches alone, {layers} layers, {n_prompt}-token prefill, {n_tokens} decode steps, budget {budget}")
    print(f"{'cache':<16} {'CPU ms/step':>12} {'beyond KVCache ms':>18}")
    for name, ts in cpu.items():
        med = statistics.median(ts[2:])
        print(f"{name:<16} {med * 1e3:12.2f} {(med - base) * 1e3:18.2f}")


def passkey_trials(loaded, context: int, depth: float, trials: int, seed: int = 0) -> list:
    """The passkey trials of :func:`cachelib.profile.retrieval.retrieval` (same seeds, same corpus)."""
    import random

    from cachelib.profile.evaluate import resolve_texts
    from cachelib.profile.retrieval import TaskPrompt, make_trial

    prompt, sources = TaskPrompt(loaded.tokenizer, "passkey"), resolve_texts(None)
    out = []
    for t in range(trials):
        name, text = sources[t % len(sources)]
        rng = random.Random(f"{seed}:passkey:{context}:{depth!r}:{t}")
        out.append(make_trial(prompt, prompt.encode(text), context, depth, rng, name))
    return out


def run_retrieval(backend: str, model: str, specs: list[str], context: int, depth: float, trials: int) -> list[dict]:
    """Each spec on each trial, the question prefilled with the prompt, the key teacher-forced."""
    import numpy as np

    from cachelib.profile.divergence import compare
    from cachelib.profile.evaluate import teacher_forced_logits
    from cachelib.profile.retrieval import score_key

    loaded = load(model, backend)
    probe = probe_for(loaded)
    rows = []
    for i, trial in enumerate(passkey_trials(loaded, context, depth, trials)):
        reference = None
        for s in specs:
            cache = probe.make_cache(parse_spec(s))
            with probe.capture(cache):
                logits = teacher_forced_logits(loaded, cache, trial.prefill + trial.cue, trial.key)
            predicted = [int(x) for x in np.argmax(logits, axis=-1)]
            exact, accuracy = score_key(predicted, trial.key)
            reference = logits if reference is None else reference
            kl = float(np.mean([compare(r, q, t)[0] for r, q, t in zip(reference, logits, trial.key)]))
            rows.append(
                {
                    "backend": backend,
                    "strategy": s,
                    "trial": i,
                    "exact": float(exact),
                    "key_accuracy": accuracy,
                    "kl": kl,
                    "cache_bytes": sum(v.bytes_allocated for v in probe.views(cache)),
                    "needle_position": trial.needle_start,
                    "context": trial.context,
                }
            )
            print(f"  trial {i} {s:<34} exact {exact:d} key-token acc {accuracy:.2f} KL {kl:.3f}", flush=True)
    return rows


def retrieval_specs(budget: int) -> list[str]:
    return [s for s in specs_for(budget) if s != "standard"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="mlx,torch")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument(
        "--methods", default="", help="only these importance methods (comma-separated; the full cache always runs)"
    )
    ap.add_argument("--retrieval", action="store_true", help="measure passkey retrieval instead of speed")
    ap.add_argument("--layers-only", action="store_true", help="time the MLX caches alone, without the model")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--budgets", default="256,512")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--depth", type=float, default=0.1)
    ap.add_argument("--trials", type=int, default=2)
    args = ap.parse_args()
    if args.retrieval:
        budgets = [int(b) for b in args.budgets.split(",")]
        specs = ["standard"] + [s for b in budgets for s in retrieval_specs(b)]
        print(
            f"model {args.model}, passkey at depth {args.depth} of {args.context} tokens, question prefilled, "
            f"{args.trials} trial(s)"
        )
        for backend in args.backends.split(","):
            rows = run_retrieval(backend.strip(), args.model, specs, args.context, args.depth, args.trials)
            print(f"{'backend':<7} {'strategy':<34} {'exact':>6} {'key acc':>8} {'KL nats':>8} {'cache bytes':>12}")
            for s in specs:
                mine = [r for r in rows if r["strategy"] == s]
                mean = lambda k: sum(r[k] for r in mine) / len(mine)  # noqa: E731
                print(
                    f"{backend:<7} {s:<34} {mean('exact'):>6.2f} {mean('key_accuracy'):>8.2f} {mean('kl'):>8.3f} "
                    f"{int(mean('cache_bytes')):>12,}"
                )
        return
    if args.layers_only:
        methods = [m.strip() for m in (args.methods or "knorm,tova,h2o").split(",")]
        run_layers_only(methods, args.budget, args.prompt_tokens, args.tokens, args.layers)
        return
    specs = specs_for(args.budget)
    if args.methods:
        methods = {m.strip() for m in args.methods.split(",")}
        specs = [s for s in specs if s == "standard" or s.split(":")[0] in methods]
    print(f"model {args.model}, prompt {args.prompt_tokens} tokens, {args.tokens} decode steps, budget {args.budget}")
    print(
        f"{'backend':<7} {'strategy':<34} {'median step ms':>14} {'x standard':>10} {'CPU x std':>9} "
        f"{'score ms':>9} {'held':>6} {'cache bytes':>12}"
    )
    for backend in args.backends.split(","):
        for r in run_backend(backend.strip(), args.model, specs, args.prompt_tokens, args.tokens):
            print(
                f"{r['backend']:<7} {r['strategy']:<34} {r['median_step_ms']:>14.2f} "
                f"{r['ratio_to_standard']:>10.2f} {r['cpu_ratio_to_standard']:>9.2f} "
                f"{r['median_score_ms']:>9.2f} {r['tokens_held']:>6} {r['cache_bytes']:>12,}"
            )


if __name__ == "__main__":
    main()
