"""The speed model's calibration (:mod:`cachelib.plan.speed`): the fractions of a device's peaks and
the per-step costs a runtime reaches (:class:`~cachelib.plan.speed_step.Efficiency`), fitted on
published measurements (:data:`~cachelib.plan.hardware.CALIBRATION`: :func:`published_efficiency`)
or on this machine's measured steps (:func:`fit_pairs`, which ``bench/bench_speed.py --save``
keeps beside the CPU probe: :func:`saved_cpu_efficiency`), and the step a published measurement
times (:func:`measurement_cost`). The measurements the model is checked against live in the
tests, apart from these."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import lru_cache

from ..spec import parse_spec
from . import cpu_probe
from .arch import Arch, arch_from_config
from .device import scores_materialised
from .hardware import CALIBRATION, LLAMA_2_7B, QWEN2_5_72B, QWEN3_4B, Hardware, Measurement, hardware
from .presets import preset
from .speed_step import (
    BORROWED_SPREAD,
    MIN_SPREAD,
    PUBLISHED_SPREAD,
    Efficiency,
    StepCost,
    _held,
    _prompt_held,
    runtime_key,
    step_cost,
    step_time,
)


def measurement_arch(m: Measurement) -> Arch:
    if m.model == "llama-2-7b":
        return arch_from_config(LLAMA_2_7B, "Llama-2-7B", num_params=6_738_415_616, params_note="llama-bench: 6.74 B")
    if m.model in ("qwen3-4b", "qwen2.5-72b"):  # parameters counted from the config: 4.02 B and 72.7 B
        return arch_from_config(QWEN3_4B if m.model == "qwen3-4b" else QWEN2_5_72B, m.model)
    return preset(m.model)


def measurement_weights(m: Measurement, arch: Arch) -> int:
    """The bytes of weights the measured runtime holds: ``weight_bits`` per parameter where given
    (MLX's codes + scales + biases, bf16's 16), else the size the runtime printed (``weights_gib``)."""
    if m.weight_bits is not None:
        return int(arch.num_params * m.weight_bits / 8)
    return int(m.weights_gib * 2**30)


def measurement_cost(m: Measurement, *, prefill: bool = False) -> tuple[Arch, StepCost]:
    """The step a published measurement times: tg128 decodes 128 tokens after ``depth`` (the
    middle step stands for them); pp512 prefills 512 tokens after ``depth`` in one forward."""
    arch = measurement_arch(m)
    d = _deployment(m.runtime, m.kv_format, tp=m.tp)
    spec = parse_spec("standard")
    weights = measurement_weights(m, arch) // m.tp  # one device's share
    mat = scores_materialised(d.backend, m.runtime, spec)[0] if m.runtime != "llama.cpp" else not m.flash_attn
    if prefill:  # the prompt in one forward
        n = forward_tokens = int(m.test.removeprefix("pp"))
        held = _prompt_held(arch, spec, d.backend, "float16", d, n, m.depth + n)
    else:  # the middle decode step
        n, forward_tokens = int(m.test.removeprefix("tg")), 1
        held = _held(arch, spec, d.backend, "float16", d, None, m.depth + n // 2)
    return arch, step_cost(
        arch,
        spec,
        rows=m.batch,
        tokens=forward_tokens,
        held=held,
        weights_bytes=weights,
        quantized=False,
        materialised=mat,
        all_logits=False,
        tp=m.tp,
    )


def measurement_tokens_per_s(m: Measurement, eff: Efficiency | None = None) -> float:
    """The decode tokens/s per session the model predicts for a published measurement, at the
    fractions its runtime reaches on its device (``eff`` overrides them)."""
    hw = hardware(m.hardware)
    eff = eff or efficiency(m.runtime, "torch", hw)
    return 1 / step_time(measurement_cost(m)[1], hw, eff, "float16", m.tp)


def _deployment(runtime: str | None, kv_format: str | None = None, backend: str = "mlx", tp: int = 1):
    from .runtimes import Deployment

    return Deployment.make(runtime, None if runtime else backend, kv_format=kv_format, tp=tp)


def fit_pairs(decode: list[tuple[float, float, float, float]], source: str, *, probed: bool = False) -> Efficiency:
    """Bandwidth fraction, seconds per attention pair, per session row and per step from measured
    decode steps given as (bytes / peak bandwidth, attention pairs, rows, measured seconds): least
    squares on ``seconds = x / f_bw + pairs x pair_s + rows x row_s + overhead``, terms that fit
    below 0 dropped. Needs steps at two contexts and two batch sizes (a row's cost from the step's).
    On one strategy a K/V byte goes with an attention pair, so the split between ``f_bw``, pairs and
    the overhead is not unique; the steps it predicts are.

    ``probed``: the second column is the attention probe's seconds for the step
    (:attr:`StepCost.probed_attention_s`, ``x`` then the bytes besides attention), and its
    coefficient is :attr:`Efficiency.attention_scale`: how much longer the step's attention takes
    than the bare kernel, one constant for every length."""
    import numpy as np

    x = np.array([[d[0], d[1], 1.0, d[2]] for d in decode])
    y = np.array([d[3] for d in decode])
    varied = len({d[2] for d in decode}) > 1  # one batch size cannot tell a row's cost from the step's
    # Probed, the bytes left are the weights': the same every step, so the per-step constant is theirs.
    first = ([0, 1, 3], [0, 1, 2, 3]) if probed else ([0, 1, 2, 3], [0, 1, 3])
    for cols in (*first, [0, 1, 2], [0, 1], [0, 2], [0]):
        if 3 in cols and not varied:
            continue
        coef = np.linalg.lstsq(x[:, cols], y, rcond=None)[0]
        if (coef >= 0).all() and coef[0] > 0:
            break
    got = dict(zip(cols, coef))
    attn = float(got.get(1, 0.0))
    eff = Efficiency(
        1 / got[0],
        1.0,
        float(got.get(2, 0.0)),
        MIN_SPREAD,
        source,
        0.0 if probed else attn,
        float(got.get(3, 0.0)),
        attn if probed else 0.0,
    )
    res = [
        abs((a / eff.bandwidth_fraction + p * attn + r * eff.row_s + eff.overhead_s) / t - 1) for a, p, r, t in decode
    ]
    return replace(eff, spread=max([MIN_SPREAD, *res]))


def fit(decode: list[tuple[float, float]], prefill: list[tuple[float, float, float]], source: str) -> Efficiency:
    """Fractions and overhead from measured steps: ``decode`` as (bytes / peak bandwidth,
    measured seconds), fitted by least squares to ``seconds = x / f_bw + overhead`` (overhead
    >= 0); ``prefill`` as (FLOPs / peak compute, measured seconds, overhead-free bytes time),
    giving ``f_c``. The spread is the largest relative residual, at least :data:`MIN_SPREAD`."""
    xs, ys = [d[0] for d in decode], [d[1] for d in decode]
    if len(decode) >= 2 and max(xs) > min(xs) * 1.05:
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        over = my - slope * mx
        if over < 0 or slope <= 0:
            slope, over = sum(ys) / sum(xs), 0.0
    else:
        slope, over = sum(ys) / sum(xs), 0.0
    f_bw = 1 / slope
    f_c = 1.0
    if prefill:
        f_c = min(1.0, sum(p[0] for p in prefill) / sum(max(p[1] - over, 1e-9) for p in prefill))
    res = [abs((x / f_bw + over) / y - 1) for x, y in decode]
    return Efficiency(f_bw, f_c, over, max([MIN_SPREAD, *res]), source)


@lru_cache(maxsize=None)
def published_efficiency(runtime: str, kind: str) -> Efficiency | None:
    """The fit on :data:`~cachelib.plan.hardware.CALIBRATION` for ``runtime`` on ``kind``."""
    dec, pre = [], []
    for m in CALIBRATION:
        if m.runtime != runtime or hardware(m.hardware).kind != kind:
            continue
        hw = hardware(m.hardware)
        if m.test.startswith("tg"):
            dec.append((measurement_cost(m)[1].bytes / hw.bandwidth, 1 / m.tokens_per_s))
    for m in CALIBRATION:
        hw = hardware(m.hardware)
        if m.runtime == runtime and hw.kind == kind and m.test.startswith("pp") and hw.compute("float16"):
            cost = measurement_cost(m, prefill=True)[1]
            pre.append((cost.flops / hw.compute("float16"), int(m.test[2:]) / m.tokens_per_s, 0.0))
    if not dec:
        return None
    srcs = sorted({m.source for m in CALIBRATION if m.runtime == runtime and hardware(m.hardware).kind == kind})
    eff = fit(dec, pre, f"fitted on {len(dec) + len(pre)} published measurements ({', '.join(srcs)})")
    return replace(eff, spread=max(eff.spread, PUBLISHED_SPREAD))


# Runtimes without published measurements fitted here borrow another's fit, said so, with a wider
# interval: on CUDA from vLLM (PyTorch modules, cuBLAS GEMMs and a Python step loop, as transformers'
# and cachelib's torch loops have; MLX's CUDA backend is closer to that than to ggml's kernels), on
# Apple silicon from mlx-lm (cachelib's MLX loop runs the same MLX kernels: quantized_matmul, SDPA).
BORROW = {
    ("transformers", "cuda"): ("vllm", "cuda"),
    ("cachelib-torch", "cuda"): ("vllm", "cuda"),
    ("cachelib-mlx", "cuda"): ("vllm", "cuda"),
    ("cachelib-mlx", "apple"): ("mlx-lm", "apple"),
}


def saved_cpu_efficiency(key: str, compute_probe: str | None = None) -> Efficiency | None:
    """This machine's fit for ``key`` as ``bench/bench_speed.py --save`` left it, if any: only a fit
    whose compute fraction is of the same matmul probe (``compute_probe``: the backend's own; an
    older fit, of numpy's, is not used), and none from an unreadable file."""
    try:
        got = dict(json.loads(cpu_probe.PROBE_CACHE.read_text())["calibration"][key])
        if got.pop("compute_probe", None) != compute_probe:
            return None
        return Efficiency(**got)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def efficiency(runtime: str | None, backend: str, hw: Hardware) -> Efficiency:
    """The fractions ``runtime`` (None: cachelib's own loop on ``backend``) reaches on ``hw``."""
    key = runtime_key(runtime, backend)
    if hw.kind == "cpu":
        saved = saved_cpu_efficiency(key, backend)
        if saved is not None:
            return saved
        return Efficiency(
            1.0,
            1.0,
            0.0,
            0.5,
            "not calibrated on this CPU: peaks taken whole, +-50% (python bench/bench_speed.py --save calibrates it)",
        )
    own = published_efficiency(key, hw.kind)
    if own is not None:
        return own
    other = BORROW.get((key, hw.kind))
    if other is not None:
        base = published_efficiency(*other)
        return replace(
            base,
            spread=max(base.spread, BORROWED_SPREAD),
            source=f"borrowed from {other[0]} on {other[1]} ({base.source}); no {key} measurement fitted",
        )
    raise ValueError(
        f"no calibration of {key} on {hw.kind} devices; calibrated: "
        + ", ".join(f"{r} on {k}" for r, k in sorted({*BORROW, *BORROW.values()}))
    )
