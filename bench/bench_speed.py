"""Predicted against measured decode step time and prefill time on this machine's CPU: the
planner's speed model (:mod:`cachelib.plan.speed`) with this machine's probed bandwidth and
compute (:func:`cachelib.plan.hardware.measure_cpu`: the compute through each backend's own
matmul) against real decodes of the bundled
SmolLM2-135M on both backends (float32 on the CPU, weights dequantized).

For each backend, strategy and batch, a cache is built at every context: up to
``--max-prefill`` tokens (batch 1, the ``--prefill-strategies``) the prompt goes through the
model in ``--chunk``-token chunks (timed: the prefill, ``--prefill-repeats`` times, interleaved
over the contexts); longer or other caches are filled through their own update with random K/V
(a decode step reads and computes the same whatever the values). Then ``--steps`` rounds each
time one decode step of every context in turn, right after an untimed step of the same cache (as
a runtime's loop runs it; the machine's load hits every context alike), with a bandwidth/compute
probe per round; medians are quoted.
The runtime's fractions of the probed peaks and its per-step overhead are fitted on the
calibration contexts only (``--calibrate``), per backend and strategy, and every other context is
predicted from them: the check. Targets (issue 31): every checked decode step within 15%, the
slowdown from the smallest to the largest context within 15%, prefill within 25%.

    PYTHONPATH=. python bench/bench_speed.py                 # both backends, 4 strategies, batch 1 and 4
    PYTHONPATH=. python bench/bench_speed.py --backend mlx --strategies standard --batches 1 --steps 16
    PYTHONPATH=. python bench/bench_speed.py --save          # keep the fit for `plan --hardware cpu`
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import numpy as np

from cachelib.models import load
from cachelib.plan import PlanRequest, arch_from_model_info
from cachelib.plan.hardware import PROBE_CACHE, AttentionProbe, cpu_hardware, measure_cpu, probe_cpu
from cachelib.plan.speed import Efficiency, SpeedModel, _held, fit_pairs, runtime_key
from cachelib.spec import parse_spec

STRATEGIES = ("standard", "rotating:max_size=512,keep=4", "quantized:bits=8", "quantized:bits=4")
DECODE_TARGET, SLOWDOWN_TARGET, PREFILL_TARGET = 0.15, 0.15, 0.25


def _forward(loaded, backend: str, cache):
    """A function feeding ``ids`` (batch, n) to the model over ``cache``, evaluated."""
    model = loaded.model
    if backend == "mlx":
        import mlx.core as mx

        def forward(ids):
            out = model(mx.array(ids), cache=cache)
            mx.eval(out, [c.state for c in cache])
    else:
        import torch

        def forward(ids):
            with torch.inference_mode():
                model(input_ids=torch.from_numpy(ids), past_key_values=cache, use_cache=True)

    return forward


def _fill_direct(backend: str, cache, arch, batch: int, context: int, chunk: int, seed: int) -> None:
    """Bring every layer's cache to ``context`` tokens through its own update, chunk by chunk, with
    random K/V: what a decode step then reads and computes does not depend on the values."""
    rng = np.random.default_rng(seed)
    shape = lambda n: (batch, arch.num_kv_heads, n, arch.head_dim)  # noqa: E731  # (B, H_kv, T, D)
    if backend == "mlx":
        import mlx.core as mx

        for a in range(0, context, chunk):
            n = min(chunk, context - a)
            k = mx.array(rng.standard_normal(shape(n), dtype=np.float32))
            v = mx.array(rng.standard_normal(shape(n), dtype=np.float32))
            for c in cache:
                c.update_and_fetch(k, v)
            mx.eval([c.state for c in cache])
    else:
        import torch

        for a in range(0, context, chunk):
            n = min(chunk, context - a)
            k = torch.from_numpy(rng.standard_normal(shape(n), dtype=np.float32))
            v = torch.from_numpy(rng.standard_normal(shape(n), dtype=np.float32))
            for i in range(arch.num_layers):
                cache.update(k, v, i)


def _with_params(loaded, backend: str, arch):
    """``arch`` with the loaded model's parameter count and embedding tying (the FLOPs need them)."""
    model = loaded.model
    if backend == "mlx":
        from mlx.utils import tree_flatten

        count = sum(v.size for _, v in tree_flatten(model.parameters()))
        tied = bool(getattr(model.args, "tie_word_embeddings", False))
    else:
        count = sum(p.numel() for p in model.parameters())  # a tied matrix is counted once
        tied = bool(model.config.tie_word_embeddings)
    return replace(arch, num_params=int(count), config={**arch.config, "tie_word_embeddings": tied})


def run_group(
    loaded,
    backend: str,
    arch,
    spec: str,
    batch: int,
    contexts: list[int],
    chunk: int,
    steps: int,
    direct: dict[int, bool],
    seed: int = 0,
    prefill_repeats: int = 1,
    attention: tuple[AttentionProbe, list[tuple]] | None = None,
):
    """Real runs of one strategy and batch at each context, their decode steps interleaved.

    Each context's cache is prefilled through the model (timed, a probe just before; ``prefill_repeats``
    times, interleaved over the contexts, median) or filled directly; then ``steps`` rounds each time one
    decode step of every context in turn (after an untimed step of the same cache), with a probe per
    round, so the machine's load hits every context alike. ``attention``: an attention probe and the
    (bits, group size, length[, 1, rows]) it measures each round beside the bandwidth/compute probe. Returns,
    per context, (prefill seconds or None, its probe, median decode step seconds), the rounds'
    median probe (bytes/s, FLOP/s) and each attention length's seconds, one a round."""
    if backend == "mlx":
        from cachelib.mlx.factory import make_cache
    else:
        from cachelib.torch.factory import make_cache
    ids = np.random.default_rng(seed).integers(0, loaded.info.vocab_size, size=(batch, max(contexts) + 2 * steps))
    # Prefills: ``prefill_repeats`` rounds, each prefilling every context's prompt into a fresh cache
    # (the last round's caches are kept for the decode steps), a probe before each; medians quoted.
    prefills: dict[int, list[tuple[float, tuple[float, float]]]] = {c: [] for c in contexts if not direct[c]}
    caches = {}
    for r in range(max(1, prefill_repeats) if prefills else 1):
        for c in contexts if r % 2 == 0 else contexts[::-1]:
            if direct[c] and r > 0:
                continue
            cache = make_cache(loaded.model, parse_spec(spec))
            forward = _forward(loaded, backend, cache)
            if direct[c]:
                _fill_direct(backend, cache, arch, batch, c, chunk, seed)
            else:
                probe = measure_cpu(0.3, backend)
                start = time.perf_counter()
                for a in range(0, c, chunk):
                    forward(ids[:, a : min(a + chunk, c)])
                prefills[c].append((time.perf_counter() - start, probe))
            caches[c] = (cache, forward)
    runs = {}
    for c in contexts:
        prefill, probe = None, measure_cpu(0.3, backend)
        if prefills.get(c):
            prefill = statistics.median(t for t, _ in prefills[c])
            probe = tuple(statistics.median(p[k] for _, p in prefills[c]) for k in (0, 1))
        runs[c] = (*caches[c], prefill, probe, [])
    del caches
    # The probe between rounds leaves the next forward slower (measured: whichever context came
    # first after it, 128 or 1,024 tokens, took 1.3-1.9x its neighbours), so one untimed forward of
    # a small cache of its own follows each probe.
    settle = make_cache(loaded.model, parse_spec("standard"))
    settle_forward = _forward(loaded, backend, settle)
    settle_forward(ids[:, :8])
    probes, attn = [], {k: [] for k in (attention[1] if attention else [])}
    for i in range(steps):
        # The attention probe first, after the last round's steps in the same runtime (numpy's probe
        # runs its own OpenBLAS: no evidence either way at load 8, where A/B runs differed 1.6x both ways).
        for key in attn:  # (bits, group, length), or (bits, group, length, 1, rows) of a batch
            bits, group, n, *batch = key
            attn[key].append(attention[0].measure(n, bits, group, 1, batch[1] if batch else 1))
        probes.append(measure_cpu(0.2, backend))
        settle_forward(ids[:, 8 + i : 9 + i])
        for c in contexts if i % 2 == 0 else contexts[::-1]:
            forward, times = runs[c][1], runs[c][4]
            # A runtime steps the same cache again and again: one untimed step of this cache first, so
            # the timed one does not start in the state another context's step left the CPU's caches in.
            forward(ids[:, c + 2 * i : c + 2 * i + 1])
            t = time.perf_counter()
            forward(ids[:, c + 2 * i + 1 : c + 2 * i + 2])
            times.append(time.perf_counter() - t)
    probe = tuple(statistics.median(p[k] for p in probes) for k in (0, 1))
    out = {c: (r[2], r[3], statistics.median(r[4])) for c, r in runs.items()}
    del runs
    return out, probe, attn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", nargs="+", default=["mlx", "torch"], choices=["mlx", "torch"])
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    ap.add_argument("--contexts", default="256,512,1024,2048,8192")
    ap.add_argument("--calibrate", default="256,2048", help="contexts the fit uses (the rest are checked)")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--max-batch-context", type=int, default=2048, help="batch > 1 only up to this context (RAM, time)")
    ap.add_argument(
        "--max-prefill",
        type=int,
        default=1024,
        help="prefill through the model up to this context; longer caches are filled through their own "
        "update with random K/V (the decode step is timed the same; its prefill is not)",
    )
    ap.add_argument("--prefill-batches", action="store_true", help="prefill batch > 1 through the model too")
    ap.add_argument(
        "--prefill-strategies",
        nargs="+",
        default=["standard"],
        help="strategies whose prompt goes through the model (the others' caches are filled directly)",
    )
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument(
        "--prefill-repeats", type=int, default=3, help="times each prefill is run (fresh caches, interleaved)"
    )
    ap.add_argument(
        "--attention-seconds", type=float, default=0.05, help="time each attention probe length takes a round"
    )
    ap.add_argument("--save", action="store_true", help=f"keep each backend's standard fit in {PROBE_CACHE}")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    calib = {int(c) for c in args.calibrate.split(",")}
    batches = [int(b) for b in args.batches.split(",")]
    hw = probe_cpu(refresh=True)
    own = {b: probe_cpu(backend=b).flops["float32"] for b in args.backend}
    print(
        f"this CPU: {hw.note}; probed {hw.bandwidth / 1e9:.2f} GB/s copy bandwidth, "
        f"{hw.flops['float32'] / 1e9:.2f} GFLOP/s float32 matmul through numpy, "
        + ", ".join(f"{fl / 1e9:.2f} through {b}" for b, fl in own.items())
        + "; a prefill is predicted with the median of the backend's own probes taken just before each of its "
        "repeats, decode steps with the median of one probe per round"
    )
    print("the machine is shared with other jobs: timings are noisy\n")
    saved: dict[str, dict] = {}
    summary, summary_before = [], []
    for backend in args.backend:
        loaded = load("smollm2", backend)
        arch = _with_params(loaded, backend, arch_from_model_info(loaded.info))
        weights = int(arch.config.get("measured_weight_bytes") or 0) or None
        run_group(loaded, backend, arch, "standard", 1, [64], 64, 2, {64: False})  # warm-up
        for spec in args.strategies:

            def model_for(b, c, probe, eff, attention=None):
                r = PlanRequest(
                    [spec],
                    context=c,
                    batch=b,
                    backend=backend,
                    dtype="float32",
                    prefill_chunk=args.chunk,
                    weights_bytes=weights,
                    device="cpu",
                )
                hw = cpu_hardware(*probe, "probed before the case")
                return SpeedModel(arch, r, hw, eff=eff, attention=attention)

            # The attention probe: this CPU's attention kernel at every length a context's layers hold,
            # and each batch's at its rows (a batch is probed as the batch: AttentionProbe.seconds),
            # measured each round beside the decode steps (a kernel timed bare, not a step).
            m0 = model_for(1, contexts[0], (1e9, 1e9), Efficiency(1.0, 1.0, 0.0, 0.0, "-"))
            bits, group = m0._probe_bits(parse_spec(spec))
            lengths = sorted(
                {
                    (b, n)
                    for b in batches
                    for c in contexts
                    if b == 1 or c <= args.max_batch_context
                    for n in _held(arch, parse_spec(spec), backend, "float32", m0.deployment, args.chunk, c)[1]
                    if n
                }
            )
            points_at = [(bits, group, n) if b == 1 else (bits, group, n, 1, b) for b, n in lengths]
            layers = sum(1 for k in arch.layer_kinds if k != "recurrent")
            probe_at = AttentionProbe(
                backend,
                arch.num_heads,
                arch.kv_heads,
                arch.head_dim,
                layers,
                seconds=args.attention_seconds,
                run_seconds=1.0,
            )
            samples: dict = {}
            measured = {}
            for b in batches:
                cs = [c for c in contexts if b == 1 or c <= args.max_batch_context]
                direct = {
                    c: c > args.max_prefill or b > 1 and not args.prefill_batches or spec not in args.prefill_strategies
                    for c in cs
                }
                got, probe, attn = run_group(
                    loaded,
                    backend,
                    arch,
                    spec,
                    b,
                    cs,
                    args.chunk,
                    args.steps,
                    direct,
                    prefill_repeats=args.prefill_repeats,
                    attention=(probe_at, points_at),
                )
                for k, v in attn.items():
                    samples.setdefault(k, []).extend(v)
                for c, (pre, p_pre, step) in got.items():
                    measured[(b, c)] = (pre, step, p_pre, probe)

            attention = AttentionProbe(
                backend,
                arch.num_heads,
                arch.kv_heads,
                arch.head_dim,
                layers,
                points={k: statistics.median(v) for k, v in samples.items()},
            )
            print(
                f"{backend} {spec}: attention probe, one layer (median of {args.steps} rounds): "
                + ", ".join(
                    f"{n}{f' x{b}' if b > 1 else ''}: {attention.points[key] * 1e6:.0f} us "
                    f"({attention.points[key] / (n * b) * 1e9:.1f} ns a key)"
                    for (b, n), key in zip(lengths, points_at)
                )
            )
            # Fit on the calibration contexts against the whole peaks probed at the time, then predict every case.
            one = Efficiency(1.0, 1.0, 0.0, 0.0, "whole peaks")

            def fitted(probed: bool) -> Efficiency:
                """The decode terms fitted on the calibration contexts (attention charged by the probe,
                or a constant per pair), then f_c: the fraction of the probe's matmul rate at which the
                predicted calibration prefills take as long as measured, the decode terms kept (a
                bisection: the prefill time falls as f_c grows; relative to numpy's matmul it may pass 1)."""
                att = attention if probed else None
                dec = []
                for (b, c), (p, s, p_pre, p_dec) in measured.items():
                    if c in calib:
                        cost = model_for(b, c, p_dec, one, att).decode(spec, b)[1]
                        x = cost.bytes_besides_attention if probed else cost.bytes
                        dec.append((x / p_dec[0], cost.probed_attention_s if probed else cost.pairs, cost.rows, s))
                eff = fit_pairs(dec, f"{backend} {spec} on this CPU, contexts {sorted(calib)}", probed=probed)
                pre_cases = [(b, c, p, pp) for (b, c), (p, s, pp, _) in measured.items() if c in calib and p]
                lo, hi = 1e-3, 1e3
                for _ in range(40 if pre_cases else 0):
                    mid = (lo * hi) ** 0.5
                    e = replace(eff, compute_fraction=mid)
                    t = sum(model_for(b, c, pp, e, att).prefill(spec, rows=b) for b, c, _, pp in pre_cases)
                    lo, hi = (mid, hi) if t > sum(p for _, _, p, _ in pre_cases) else (lo, mid)
                return replace(eff, compute_fraction=(lo * hi) ** 0.5 if pre_cases else 1.0)

            eff, before = fitted(True), fitted(False)
            if spec == "standard":
                saved[runtime_key(None, backend)] = {**eff.__dict__, "compute_probe": backend}
            print(
                f"{backend} {spec}: fitted f_bw {eff.bandwidth_fraction:.2f}, f_c {eff.compute_fraction:.2f}, "
                f"overhead {eff.overhead_s * 1e3:.2f} ms, attention x{eff.attention_scale:.2f} the probe's, "
                f"{eff.row_s * 1e3:.2f} ms per session row (before, a constant per pair: "
                f"{before.pair_s * 1e9:.2f} ns per attention pair, f_bw {before.bandwidth_fraction:.2f})"
            )
            print(
                f"  {'batch':>5} {'context':>7} {'set':>5} {'GB/s':>5} {'GF/s':>5} {'step ms pred':>12} {'meas':>8} "
                f"{'err':>7} {'before':>7} {'prefill s pred':>14} {'meas':>8} {'err':>7} {'before':>7} {'its GF/s':>8}"
            )
            preds, preds_before = {}, {}
            for (b, c), (p, s, p_pre, p_dec) in measured.items():
                t = model_for(b, c, p_dec, eff, attention).decode(spec, b)[0]
                t0 = model_for(b, c, p_dec, before).decode(spec, b)[0]
                tp = model_for(b, c, p_pre, eff, attention).prefill(spec, rows=b) if p is not None else None
                preds[(b, c)], preds_before[(b, c)] = t, t0
                which = "calib" if c in calib else "check"
                e_s = t / s - 1
                e_p = None if p is None else tp / p - 1
                pcol = f"{'(filled directly)':>31}"
                if p is not None:  # and the prefill of the fit whose attention is a constant per pair (FLOPs)
                    tp0 = model_for(b, c, p_pre, before).prefill(spec, rows=b)
                    pcol = f"{tp:>14.3f} {p:>8.3f} {e_p:>+7.1%} {tp0 / p - 1:>+7.1%} {p_pre[1] / 1e9:>8.1f}"
                print(
                    f"  {b:>5} {c:>7} {which:>5} {p_dec[0] / 1e9:>5.2f} {p_dec[1] / 1e9:>5.1f} {t * 1e3:>12.2f} "
                    f"{s * 1e3:>8.2f} {e_s:>+7.1%} {t0 / s - 1:>+7.1%} {pcol}",
                    flush=True,
                )
                if which == "check":
                    summary.append((backend, spec, b, c, e_s, e_p))
                    summary_before.append((backend, spec, b, c, t0 / s - 1, None if p is None else tp0 / p - 1))
            for b in batches:
                cs = sorted(c for bb, c in measured if bb == b)
                if len(cs) >= 2 and cs[-1] not in calib:
                    lo, hi = cs[0], cs[-1]
                    ms = measured[(b, hi)][1] / measured[(b, lo)][1]
                    ps = preds[(b, hi)] / preds[(b, lo)]
                    ps0 = preds_before[(b, hi)] / preds_before[(b, lo)]
                    print(
                        f"  batch {b}: slowdown {lo}->{hi}: predicted x{ps:.2f}, measured x{ms:.2f} "
                        f"({ps / ms - 1:+.1%}; before x{ps0:.2f}, {ps0 / ms - 1:+.1%})"
                    )
                    summary.append((backend, spec, b, f"slowdown {lo}->{hi}", ps / ms - 1, None))
                    summary_before.append((backend, spec, b, f"slowdown {lo}->{hi}", ps0 / ms - 1, None))
            print(flush=True)
        del loaded
    for name, cases in (("a constant cost per pair, before", summary_before), ("attention probed", summary)):
        print(f"checked cases (not in the fit), {name}:")
        ok = {"decode": [0, 0], "slowdown": [0, 0], "prefill": [0, 0]}
        for backend, spec, b, c, e_s, e_p in cases:
            if isinstance(c, str):
                ok["slowdown"][0] += abs(e_s) <= SLOWDOWN_TARGET
                ok["slowdown"][1] += 1
                continue
            ok["decode"][0] += abs(e_s) <= DECODE_TARGET
            ok["decode"][1] += 1
            if e_p is not None:
                ok["prefill"][0] += abs(e_p) <= PREFILL_TARGET
                ok["prefill"][1] += 1
        for k, (n, of) in ok.items():
            if of:
                print(f"  {k}: {n}/{of} within target")
    if args.save:
        got = json.loads(PROBE_CACHE.read_text()) if PROBE_CACHE.exists() else {}
        got.setdefault("calibration", {}).update(saved)
        PROBE_CACHE.write_text(json.dumps(got, indent=1))
        print(f"saved the standard fits to {PROBE_CACHE}")


if __name__ == "__main__":
    main()
