"""The planner against mlx-lm's own generation loop: ``mlx_lm.generate.generate_step`` (mlx-lm
0.32.2, not cachelib's profiler loop) with ``make_prompt_cache`` on the bundled SmolLM2 (MLX on the
CPU, float32 weights as cachelib's loader dequantizes them), its peak read with
``mx.reset_peak_memory()`` / ``mx.get_peak_memory()`` (weights included: they are live arrays),
against ``plan --runtime mlx-lm --device cpu`` with the same flags and the measured weight bytes.

Grid: prompts of 1,024 and 3,000 tokens x ``prefill_step_size`` 1,024 and 2,048 x {no flags,
``max_kv_size=512``, ``kv_bits=8`` with ``quantized_kv_start=0`` (mlx-lm's default start, 5,000,
is past both prompts, so 8-bit would never switch on)}, then 4 generated tokens. SmolLM2 is a
``llama`` model, whose mlx-lm class has its own ``make_cache``, so ``make_prompt_cache`` ignores
``max_kv_size`` for it (mlx-lm 0.32.2, ``models/cache.py``); the ``max_kv_size`` case hands
``generate_step`` the cache ``make_prompt_cache`` builds for a model without one (a
``RotatingKVCache(512, keep=4)`` per layer), which is what ``--max-kv-size`` gives such models. Each case runs
in a fresh subprocess, so that one case's buffers and MLX's cache never inflate the next's peak.
Targets: planned within 5% of measured (weights included) and the part beyond the weights
within 10%, every case.

    python bench/bench_runtime_peak.py                      # the 12 cases
    python bench/bench_runtime_peak.py --prompts 1024 --steps 2048 --flags none
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's cachelib, not an installed one

TOTAL_TARGET, BEYOND_TARGET = 0.05, 0.10
DECODE = 4  # tokens generate_step yields (max_tokens)
FLAGS = {  # name -> generate_step keyword arguments (mlx-lm's CLI flags)
    "none": {},
    "max_kv_size=512": {"max_kv_size": 512},
    "kv_bits=8": {"kv_bits": 8, "kv_group_size": 64, "quantized_kv_start": 0},
}


def measure(prompt: int, step: int, flags: dict, seed: int = 0) -> dict:
    """One generate_step run: its MLX peak and the weights' bytes (both in bytes)."""
    import mlx.core as mx

    mx.set_default_device(mx.cpu)
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    from cachelib.models import load

    loaded = load("smollm2", "mlx", device="cpu", dtype="float32", weights="dequantized")
    model = loaded.model
    ids = mx.array(np.random.default_rng(seed).integers(0, loaded.info.vocab_size, size=prompt))
    mx.eval(ids)
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    if flags.get("max_kv_size") is None:
        cache = make_prompt_cache(model)
    else:  # make_prompt_cache's ring for a model without its own make_cache (llama's has one)
        cache = [RotatingKVCache(max_size=flags["max_kv_size"], keep=4) for _ in model.layers]
    rest = {k: v for k, v in flags.items() if k != "max_kv_size"}
    tokens = [
        t for t, _ in generate_step(ids, model, max_tokens=DECODE, prompt_cache=cache, prefill_step_size=step, **rest)
    ]
    mx.synchronize()
    return {
        "peak": int(mx.get_peak_memory()),
        "weights": int(loaded.info.weight_bytes),
        "tokens": len(tokens),
        "cache": sum(int(c.nbytes) for c in cache),
    }


def planned(prompt: int, step: int, flags: dict, weights: int) -> tuple[object, str]:
    """The planner's fit for the same run, and the ``plan`` command that prints it."""
    from cachelib.models import load
    from cachelib.plan import PlanRequest, arch_from_model_info, plan
    from cachelib.plan.runtimes import mlx_lm_spec

    info = load("smollm2", "mlx", device="cpu", dtype="float32", weights="dequantized").info
    arch = arch_from_model_info(info)
    spec = mlx_lm_spec(None, **flags)  # the flags' cache on a model without its own make_cache
    request = PlanRequest(
        [spec],
        context=prompt + DECODE,
        prefill=prompt,
        prefill_chunk=step,
        dtype="float32",
        weights_bytes=weights,
        runtime="mlx-lm",
        device="cpu",
    )
    return plan(arch, request)[0], " ".join(request.to_argv("smollm2"))


def _case(prompt: int, step: int, flag: str) -> dict:
    """Run one case in a fresh interpreter and read its JSON line."""
    cmd = [sys.executable, __file__, "--one", f"{prompt},{step},{flag}"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="1024,3000", help="prompt lengths (default 1024,3000)")
    parser.add_argument("--steps", default="1024,2048", help="prefill_step_size values (default 1024,2048)")
    parser.add_argument("--flags", default=",".join(FLAGS), help=f"flag sets: {', '.join(FLAGS)}")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # prompt,step,flags: one case, JSON out
    args = parser.parse_args(argv)
    if args.one:
        prompt, step, flag = args.one.split(",", 2)
        print(json.dumps(measure(int(prompt), int(step), FLAGS[flag])))
        return 0

    import mlx.core as mx
    import mlx_lm

    print(
        f"mlx-lm {mlx_lm.__version__} generate_step on MLX {mx.__version__} (CPU), bundled SmolLM2 float32, "
        f"{DECODE} generated tokens; peak = mx.get_peak_memory(), weights included; one subprocess per case"
    )
    print(
        f"{'prompt':>6} {'step':>5} {'flags':<16} {'measured':>12} {'planned':>12} {'ratio':>6} "
        f"{'beyond: meas':>13} {'planned':>12} {'ratio':>6}"
    )
    worst_total = worst_beyond = 0.0
    commands = []
    for prompt in map(int, args.prompts.split(",")):
        for step in map(int, args.steps.split(",")):
            for flag in args.flags.split(","):
                m = _case(prompt, step, flag)
                fit, command = planned(prompt, step, FLAGS[flag], m["weights"])
                total = fit.budget_needed
                beyond_m, beyond_p = m["peak"] - m["weights"], total - m["weights"]
                r, rb = total / m["peak"], beyond_p / beyond_m
                worst_total, worst_beyond = max(worst_total, abs(r - 1)), max(worst_beyond, abs(rb - 1))
                commands.append(command)
                print(
                    f"{prompt:>6} {step:>5} {flag:<16} {m['peak']:>12,} {total:>12,} {r:>6.3f} "
                    f"{beyond_m:>13,} {beyond_p:>12,} {rb:>6.3f}"
                )
    print(
        f"worst: whole peak {worst_total:.1%} (target {TOTAL_TARGET:.0%}), beyond the weights {worst_beyond:.1%} "
        f"(target {BEYOND_TARGET:.0%})"
    )
    print("planned with, e.g.: " + commands[-1])
    return 0 if worst_total <= TOTAL_TARGET and worst_beyond <= BEYOND_TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
