"""Predicted against measured whole-process peak memory: the planner's weights + cache peak +
activation peak (:mod:`cachelib.plan.device`, runtime ``cachelib``) against MLX's
``mx.get_peak_memory()`` over a real run of cachelib's own loop (prompt in chunks, logits of every
chunk evaluated as cachelib's profiler does, then decode steps; mlx-lm's own ``generate_step`` is
``bench/bench_runtime_peak.py``'s), for 3 strategies x 2 contexts on the bundled SmolLM2 (MLX on
the CPU, float32, weights dequantized) and the tiny presets. Target: within 10% of the measured
peak; the error of the part beyond the weights (cache + activations) is printed too, since the
weights dominate the total.

Where CUDA exists, the same runs on torch are measured with ``torch.cuda.max_memory_allocated()``;
elsewhere that path is skipped with the reason.

    .venv/bin/python bench/bench_peak.py                       # smollm2, contexts 512 and 1024
    .venv/bin/python bench/bench_peak.py --models smollm2,tiny-llama,tiny-mamba --contexts 256,1024
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

from cachelib.plan import PlanRequest, arch_from_model_info, plan, preset
from cachelib.spec import parse_spec

STRATEGIES = ("standard", "quantized:bits=4", "rotating:max_size=256,keep=4")
TARGET = 0.10


def _request(spec: str, context: int, prompt: int, chunk: int, weights: int, backend: str, device: str) -> PlanRequest:
    # cachelib's own loop (every position's logits); bench/bench_runtime_peak.py checks mlx-lm's generate_step
    return PlanRequest(
        [spec],
        context=context,
        prefill=prompt,
        prefill_chunk=chunk,
        dtype="float32",
        weights_bytes=weights,
        backend=backend,
        device=device,
        runtime="cachelib",
    )


def predicted(arch, spec: str, context: int, prompt: int, chunk: int, weights: int, backend="mlx", device="cpu"):
    """(total, cache peak, activations) the planner predicts for the run."""
    fit = plan(arch, _request(spec, context, prompt, chunk, weights, backend, device))[0]
    return fit.budget_needed, fit.cache.peak_bytes, fit.activation_bytes


def measure_mlx(loaded, spec: str, prompt: int, chunk: int, decode: int, seed: int = 0) -> int:
    """MLX's peak memory over one run, weights included (they are live arrays)."""
    import mlx.core as mx

    from cachelib.mlx.factory import make_cache

    model = loaded.model
    ids = np.random.default_rng(seed).integers(0, loaded.info.vocab_size, size=prompt + decode)
    mx.synchronize()
    mx.clear_cache()
    cache = make_cache(model, parse_spec(spec))
    mx.reset_peak_memory()
    for start in range(0, prompt, chunk):
        out = model(mx.array(ids[None, start : start + chunk]), cache=cache)
        mx.eval(out)  # every position's logits, as the profiler's Runner computes them
        del out
    for i in range(prompt, prompt + decode):
        out = model(mx.array(ids[None, i : i + 1]), cache=cache)
        mx.eval(out)
        del out
    mx.synchronize()
    peak = int(mx.get_peak_memory())
    del cache
    return peak


def measure_torch_cuda(loaded, spec: str, prompt: int, chunk: int, decode: int, seed: int = 0) -> int:
    """``torch.cuda.max_memory_allocated()`` over the same run on torch (logits of every position)."""
    import torch

    from cachelib.torch.factory import make_cache

    model = loaded.model
    ids = np.random.default_rng(seed).integers(0, loaded.info.vocab_size, size=prompt + decode)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    cache = make_cache(model, parse_spec(spec))
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        steps = [(s, min(s + chunk, prompt)) for s in range(0, prompt, chunk)] + [
            (i, i + 1) for i in range(prompt, prompt + decode)
        ]
        for start, end in steps:
            x = torch.tensor(ids[None, start:end], device=loaded.info.device)
            out = model(input_ids=x, past_key_values=cache, use_cache=True).logits
            del out
    torch.cuda.synchronize()
    peak = int(torch.cuda.max_memory_allocated())
    del cache
    return peak


def _torch_rows(models: list[str], contexts: list[int], chunk: int, decode: int) -> list[float]:
    from cachelib.models import load

    errors = []
    for name in models:
        loaded = load(name, "torch", device="cuda", dtype="float32")
        arch = arch_from_model_info(loaded.info) if name == "smollm2" else preset(name)
        weights = int(loaded.info.weight_bytes)
        for spec in STRATEGIES:
            for prompt in contexts:
                total, cache, act = predicted(arch, spec, prompt + decode, prompt, chunk, weights, "torch", "gpu")
                measured = measure_torch_cuda(loaded, spec, prompt, chunk, decode)
                err = (total - measured) / measured
                errors.append(abs(err))
                print(
                    f"{loaded.info.name + ' (cuda)':<22} {spec:<30} {prompt:>6} {total:>12,} {measured:>12,} "
                    f"{err:>+7.1%}"
                )
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2", help="comma-separated: smollm2 and/or tiny presets")
    parser.add_argument("--contexts", default="512,1024", help="two (or more) prompt lengths")
    parser.add_argument("--chunk", type=int, default=256, help="prompt chunk (default 256)")
    parser.add_argument("--decode", type=int, default=4, help="decode steps after the prompt (default 4)")
    args = parser.parse_args(argv)

    import mlx.core as mx

    from cachelib.models import load

    mx.set_default_device(mx.cpu)
    contexts = [int(c) for c in args.contexts.split(",")]
    print(
        f"MLX {mx.__version__} on the CPU, float32; prompt in {args.chunk}-token chunks, then {args.decode} decode "
        "steps; predicted = weights + cache peak + activations (cachelib.plan.device)"
    )
    print(
        f"{'model':<22} {'strategy':<30} {'prompt':>6} {'predicted':>12} {'measured':>12} {'error':>7} "
        f"{'beyond weights: pred':>21} {'meas':>11} {'error':>7}"
    )
    errors, beyond_errors = [], []
    for name in args.models.split(","):
        loaded = load(
            name, "mlx", device="cpu", dtype="float32", weights="dequantized" if name == "smollm2" else "auto"
        )
        arch = arch_from_model_info(loaded.info) if name == "smollm2" else preset(name)
        weights = int(loaded.info.weight_bytes)  # the loaded arrays' bytes; smollm2's count equals params x 4
        for spec in STRATEGIES:
            for prompt in contexts:
                context = prompt + args.decode
                total, cache, act = predicted(arch, spec, context, prompt, args.chunk, weights)
                measured = measure_mlx(loaded, spec, prompt, args.chunk, args.decode)
                err = (total - measured) / measured
                beyond_err = (cache + act - (measured - weights)) / (measured - weights)
                errors.append(abs(err))
                beyond_errors.append(abs(beyond_err))
                print(
                    f"{loaded.info.name:<22} {spec:<30} {prompt:>6} {total:>12,} {measured:>12,} {err:>+7.1%} "
                    f"{cache + act:>21,} {measured - weights:>11,} {beyond_err:>+7.1%}"
                )
        del loaded
    print(
        f"whole-process peak: median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%} "
        f"(target {TARGET:.0%}); beyond the weights: median {statistics.median(beyond_errors):.1%}, "
        f"worst {max(beyond_errors):.1%}"
    )
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        print("torch.cuda.max_memory_allocated(): skipped, torch sees no CUDA device on this machine")
    else:
        cuda_errors = _torch_rows(args.models.split(","), contexts, args.chunk, args.decode)
        print(f"torch on CUDA: median |error| {statistics.median(cuda_errors):.1%}, worst {max(cuda_errors):.1%}")
        errors += cuda_errors
    return 0 if max(errors) <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
