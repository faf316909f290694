"""Decode speed and memory of cachelib.torch caches vs transformers' own, bundled model, CPU.

Each case decodes the same greedy token stream with every cache of the case in lockstep: at
every step each cache takes the step in turn (the order rotates), so machine noise hits all of
them alike. Reported per cache: decode tokens/s over the whole run, the median step time, the
median step time over the last 10% of steps (the longest context), the ratio of each to the
transformers baseline of the case, and the bytes the cache holds at the end.

Cases (targets from issue 4):
- static:    our StaticCache vs transformers' StaticCache (target >= 1.0x);
- dynamic:   our step-grown KVCache and our DynamicCache vs transformers' DynamicCache, which
             concatenates the whole cache every step (target >= 1.2x at 2,048 decoded tokens);
- quantized: our 4-bit caches (mlx-lm-style QuantizedKVCache, KIVI-style QuantizedCache) vs
             transformers' DynamicCache and its installable quantized backend (fp8): bytes held.
             quanto / HQQ, transformers' 4-bit backends, are not installable here;
- updates:   the cache operations alone (every layer's update for one decode step, the
             model's shapes, no model), which is all a cache can change in a decode step.

    python bench/bench_torch_caches.py [--cases updates,static,dynamic,quantized]
        [--static-tokens 512] [--dynamic-tokens 2048] [--quant-tokens 512] [--model smollm2]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import time

import torch
from transformers import cache_utils as tf

import cachelib.torch as ct
from cachelib.decode import encode_prompt
from cachelib.models import load

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def _bytes(cache) -> int:
    if hasattr(cache, "nbytes"):
        return cache.nbytes
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            x = getattr(layer, name, None)
            for t in x if isinstance(x, tuple) else (x,):
                if isinstance(t, torch.Tensor):
                    total += t.nbytes
    return total


def run_case(model, prompt_ids: list[int], caches: dict, n_tokens: int, introspect: set[str] = frozenset()) -> dict:
    """Decode ``n_tokens`` greedily (the first cache's tokens drive all), caches in lockstep."""
    names = list(caches)
    times = {name: [] for name in names}
    with torch.inference_mode():
        x = torch.tensor([prompt_ids])
        first = None
        for name in names:
            logits = model(input_ids=x, cache=caches[name], use_cache=True).logits[0, -1]
            first = int(logits.argmax()) if first is None else first
        token = first
        for step in range(n_tokens - 1):
            x = torch.tensor([[token]])
            k = step % len(names)
            for name in names[k:] + names[:k]:
                start = time.perf_counter()
                logits = model(input_ids=x, cache=caches[name], use_cache=True).logits[0, -1]
                nxt = int(logits.argmax())
                if name in introspect:
                    caches[name].introspect()
                times[name].append(time.perf_counter() - start)
                if name == names[0]:
                    token_next = nxt
            token = token_next
    tail = max(1, len(times[names[0]]) // 10)
    base = times[names[0]]
    return {
        name: {
            "tok_s": len(t) / sum(t),
            "median_ms": 1e3 * statistics.median(t),
            "tail_ms": 1e3 * statistics.median(t[-tail:]),
            # Same step, same moment: robust to load that drifts during the run.
            "paired": statistics.median(b / x for b, x in zip(base, t)),
            "bytes": _bytes(caches[name]),
        }
        for name, t in times.items()
    }


def run_updates(config, prompt_len: int, n_tokens: int, layers: dict) -> dict:
    """Per decode step, the time of every layer's cache update alone (lockstep, rotating order)."""
    n_layers, heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = config.hidden_size // config.num_attention_heads
    stacks = {name: [make() for _ in range(n_layers)] for name, make in layers.items()}
    prompt = torch.randn(1, heads, prompt_len, head_dim)
    step = torch.randn(1, heads, 1, head_dim)
    for stack in stacks.values():
        for layer in stack:
            layer.update(prompt, prompt)
    names, times = list(stacks), {name: [] for name in stacks}
    for i in range(n_tokens):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            start = time.perf_counter()
            for layer in stacks[name]:
                layer.update(step, step)
            times[name].append(time.perf_counter() - start)
    tail = max(1, n_tokens // 10)
    return {
        name: {"median_ms": 1e3 * statistics.median(t), "tail_ms": 1e3 * statistics.median(t[-tail:])}
        for name, t in times.items()
    }


def report(title: str, results: dict, baseline: str) -> None:
    base = results[baseline]
    print(f"\n== {title}")
    print(
        f"{'cache':44s} {'tok/s':>7s} {'x':>6s} {'median ms':>10s} {'x':>6s} {'last10% ms':>11s} {'x':>6s} "
        f"{'paired x':>9s} {'bytes held':>13s}"
    )
    for name, r in results.items():
        print(
            f"{name:44s} {r['tok_s']:7.2f} {r['tok_s'] / base['tok_s']:6.2f} {r['median_ms']:10.1f} "
            f"{base['median_ms'] / r['median_ms']:6.2f} {r['tail_ms']:11.1f} {base['tail_ms'] / r['tail_ms']:6.2f} "
            f"{r['paired']:9.3f} {r['bytes']:13,d}"
        )
    print("(x: speed relative to the first row, higher is faster; paired x: median over steps of the")
    print(" first row's step time / this row's step time, both taken at the same step)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="updates,static,dynamic,quantized")
    parser.add_argument("--static-tokens", type=int, default=512)
    parser.add_argument("--dynamic-tokens", type=int, default=2048)
    parser.add_argument("--quant-tokens", type=int, default=512)
    parser.add_argument("--model", default="smollm2", help="smollm2 (default), a preset (e.g. tiny-llama) or a folder")
    args = parser.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = set(cases) - {"updates", "static", "dynamic", "quantized"}
    if unknown:
        parser.error(f"unknown case(s) {sorted(unknown)}; choose from updates, static, dynamic, quantized")

    loaded = load(args.model, "torch")
    model, config = loaded.model, loaded.model.config
    prompt_ids = encode_prompt(loaded.tokenizer, PROMPT)
    print(
        f"model {loaded.info.name}, {loaded.info.device}, {loaded.info.dtype}; prompt {len(prompt_ids)} tokens; "
        f"torch threads {torch.get_num_threads()}"
    )

    if "updates" in cases:
        n = args.dynamic_tokens
        size = len(prompt_ids) + n
        results = run_updates(
            config,
            len(prompt_ids),
            n,
            {
                "transformers DynamicLayer": tf.DynamicLayer,
                "cachelib DynamicLayer": ct.DynamicLayer,
                "cachelib KVCacheLayer": ct.KVCacheLayer,
                "transformers StaticLayer": lambda: tf.StaticLayer(size),
                "cachelib StaticLayer": lambda: ct.StaticLayer(size),
            },
        )
        print(f"\n== cache updates alone, all {config.num_hidden_layers} layers, {n} decode steps")
        print(f"{'layers':44s} {'median ms':>10s} {'last10% ms':>11s}")
        for name, r in results.items():
            print(f"{name:44s} {r['median_ms']:10.3f} {r['tail_ms']:11.3f}")

    if "static" in cases:
        size = len(prompt_ids) + args.static_tokens
        caches = {
            "transformers StaticCache": tf.StaticCache(config, max_cache_len=size),
            "cachelib StaticCache": ct.StaticCache(config, max_cache_len=size),
        }
        report(
            f"static, {args.static_tokens} decoded tokens (target >= 1.0x)",
            run_case(model, prompt_ids, caches, args.static_tokens),
            "transformers StaticCache",
        )
        del caches
        gc.collect()

    if "dynamic" in cases:
        caches = {
            "transformers DynamicCache (concatenates)": tf.DynamicCache(config=config),
            "cachelib KVCache (step growth, standard)": ct.KVCache(config=config),
            "cachelib DynamicCache (concatenates)": ct.DynamicCache(config=config),
        }
        report(
            f"dynamic, {args.dynamic_tokens} decoded tokens (target >= 1.2x for the step-grown KVCache)",
            run_case(model, prompt_ids, caches, args.dynamic_tokens),
            "transformers DynamicCache (concatenates)",
        )
        del caches
        gc.collect()

    if "quantized" in cases:
        caches = {
            "transformers DynamicCache (float32)": tf.DynamicCache(config=config),
            "transformers QuantizedCache fp8": tf.QuantizedCache(backend="fp8", config=config),
            "cachelib QuantizedKVCache 4-bit g64": ct.QuantizedKVCache(64, 4, config=config),
            "cachelib QuantizedKVCache 4-bit + introspect": ct.QuantizedKVCache(64, 4, config=config),
            "cachelib QuantizedCache (KIVI) 4-bit g64 r128": ct.QuantizedCache(config, nbits=4, q_group_size=64),
        }
        results = run_case(
            model, prompt_ids, caches, args.quant_tokens, introspect={"cachelib QuantizedKVCache 4-bit + introspect"}
        )
        report(f"quantized, {args.quant_tokens} decoded tokens", results, "transformers DynamicCache (float32)")
        missing = [p for p in ("optimum.quanto", "hqq") if importlib.util.find_spec(p.split(".")[0]) is None]
        if missing:
            print(
                f"transformers' 4-bit backends are not installable here ({', '.join(missing)} missing): "
                "no quanto/HQQ row."
            )
        tokens = len(prompt_ids) + args.quant_tokens - 1
        per_token = (
            2
            * config.num_hidden_layers
            * config.num_key_value_heads
            * (config.hidden_size // config.num_attention_heads)
        )
        print(
            f"reference: float32 K/V of {tokens} tokens = {4 * per_token * tokens:,d} bytes; "
            f"4-bit g64 codes+scales+biases = {per_token * tokens // 2 + per_token * tokens // 64 * 2 * 4:,d} bytes "
            "(+ unused slots of the last 256-token step for QuantizedKVCache)"
        )


if __name__ == "__main__":
    main()
