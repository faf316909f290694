"""``python -m cachelib plan``: exact cache bytes per strategy and what fits in a budget, as a
table (and a CSV with ``--csv``).

``add_arguments(parser)`` declares the flags; ``run(args)`` prints the table and returns the exit
code: 0, or 2 with one line on stderr for bad input. Memory is read and printed in GiB (2^30
bytes; ``--budget 24`` is 24 GiB, ``24GB`` is 24 x 10^9 bytes); the CSV holds raw byte counts.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from pathlib import Path

from ..core.cells import escape_cell
from ..core.formats import FORMATS
from ..core.units import DTYPE_BYTES, clip_message, human_gib
from ..plan.answer import RUNTIME_SET, build_answer, default_strategies
from ..plan.device import WEIGHT_FORMATS
from ..plan.presets import preset_names, resolve_model
from ..plan.quality import describe
from ..plan.request import DEVICES, SOLVE, PlanRequest, PlanResult, plan_request, request_defaults
from ..plan.runtimes import describe_layout, resolve_runtime, runtime_names
from ..plan.solver import Fit
from ..plan.speed import SpeedReport, speed_report
from ..plan.vllm import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, KV_CACHE_DTYPES, VLLM_FLAGS, kv_format_of
from ..profile.evidence import DEFAULT_EVIDENCE, load_evidence
from .args import SIZE_HELP, finite_float, memory_size, non_negative_int, positive_int

CSV_COLUMNS = (
    "model",
    "backend",
    "dtype",
    "batch",
    "context",
    "prefill",
    "prefill_chunk",
    "strategy",
    "bytes_allocated",
    "bytes_used",
    "peak_bytes",
    "max_resident_bytes",
    "device_bytes",
    "host_bytes",
    "bytes_per_token",
    "weights_bytes",
    "activation_bytes",
    "overhead_bytes",
    "reserve_bytes",
    "budget_bytes",
    "budget_needed",
    "headroom_bytes",
    "fits",
    "max_context",
    "context_limit",
    "max_batch",
    "sessions",
    "mean_kl",
    "top1_agreement",
    "quality_model",
    "quality_source",
    "quality_context",
    "quality_kept_fraction",
    "mean_kl_ci95",
    "quality_note",
)


DEFAULTS = request_defaults()  # the one source of defaults, shared with the Planner page


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help=f"a preset ({', '.join(preset_names())}) or a path to a config.json (or its folder)",
    )
    parser.add_argument(
        "--context", type=positive_int, required=True, help="tokens the cache holds at the end of a run"
    )
    parser.add_argument("--batch", type=positive_int, default=DEFAULTS["batch"], help="sequences per run (default 1)")
    parser.add_argument(
        "--strategy",
        action="append",
        metavar="SPEC",
        help="strategy spec, e.g. rotating:max_size=4096,keep=4 (repeat to compare; default: the runtime's "
        "standard set: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in RUNTIME_SET.items()) + ")",
    )
    parser.add_argument(
        "--backend",
        choices=("mlx", "torch"),
        default=DEFAULTS["backend"],
        help="the library (default mlx); with no --runtime, plans its deployed runtime: mlx-lm on mlx, "
        "transformers on torch",
    )
    parser.add_argument(
        "--runtime",
        choices=runtime_names(),
        help="plan as this runtime allocates and runs (its layouts, blocks, prompt chunks, logits, "
        "defaults); cachelib: cachelib's own profiler loop (default: mlx-lm on mlx, transformers on "
        "torch)",
    )
    parser.add_argument(
        "--tp",
        "-tp",
        "--tensor-parallel-size",
        dest="tp",
        type=positive_int,
        default=DEFAULTS["tp"],
        help="tensor-parallel devices (default 1)",
    )
    parser.add_argument(
        "--pp",
        "-pp",
        "--pipeline-parallel-size",
        dest="pp",
        type=positive_int,
        default=DEFAULTS["pp"],
        help="pipeline-parallel stages (default 1)",
    )
    parser.add_argument(
        "--kv-format",
        choices=tuple(FORMATS),
        help="the runtime's KV storage: " + ", ".join(f"{f.name} ({f.runtime} {f.flag})" for f in FORMATS.values()),
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default=DEFAULTS["device"],
        help="where the forward runs (default gpu); on the cpu MLX materialises attention scores",
    )
    parser.add_argument(
        "--dtype", choices=tuple(DTYPE_BYTES), default=DEFAULTS["dtype"], help="K/V dtype (default float16)"
    )
    parser.add_argument(
        "--prefill", type=non_negative_int, help="prompt tokens (default: the whole context); the rest is decoded"
    )
    parser.add_argument(
        "--prefill-chunk",
        type=positive_int,
        help="feed the prompt in chunks of this many tokens (default: the runtime's; mlx-lm 2048, else one update)",
    )
    parser.add_argument(
        "--budget",
        type=memory_size,
        metavar="SIZE",
        help=f"memory of one device: weights + cache + activations + overhead + reserve; {SIZE_HELP}",
    )
    parser.add_argument(
        "--weights-memory",
        type=memory_size,
        metavar="SIZE",
        help=f"the weights one device holds, as measured (default: counted); {SIZE_HELP}",
    )
    parser.add_argument(
        "--weights-dtype",
        metavar="DTYPE",
        help=f"precision to count the weights at: {', '.join(WEIGHT_FORMATS)}, or bits per parameter "
        "(e.g. 4.5); default: the model's published dtype",
    )
    parser.add_argument(
        "--reserve",
        type=memory_size,
        default=DEFAULTS["reserve_bytes"],
        metavar="SIZE",
        help=f"kept free on each device beyond what is counted (default 0); {SIZE_HELP}",
    )
    parser.add_argument(
        "--sessions", type=positive_int, help="concurrent sessions of --context tokens --solve must fit"
    )
    parser.add_argument(
        "--solve",
        choices=SOLVE,
        help="search for the largest max_kv_size (mlx-lm's --max-kv-size ring) or the most KV bits "
        "that fit --sessions sessions of --context tokens in --budget",
    )
    parser.add_argument("--layers", action="store_true", help="also print each strategy's per-layer caches")
    parser.add_argument(
        "--evidence",
        type=Path,
        action="append",
        metavar="PATH",
        help="evaluation or profile CSVs (files or folders) whose measured quality judges each strategy, in "
        "addition to the committed evidence (assets/evidence/); repeat for several",
    )
    parser.add_argument(
        "--no-default-evidence",
        action="store_true",
        help="judge by the --evidence paths alone, without the committed evidence",
    )
    parser.add_argument(
        "--max-kl", type=finite_float(0.0), help="recommend the cheapest strategy with mean KL at most this (nats)"
    )
    parser.add_argument(
        "--min-agreement",
        type=finite_float(0.0, 1.0),
        help="recommend the cheapest strategy with top-1 agreement at least this (0..1)",
    )
    parser.add_argument(
        "--most-sessions",
        action="store_true",
        help="recommend the strategy serving the most sessions that meets the thresholds, lossy or not "
        "(default: a lossless one whenever it serves the request)",
    )
    parser.add_argument(
        "--suggest",
        action="store_true",
        help="also plan the strategies the evidence measured, and its rings and windows scaled to "
        "--context at their measured kept fraction (rounded up to a size you would type)",
    )
    parser.add_argument("--explain", action="store_true", help="print the steps of the rules that led to the answer")
    parser.add_argument(
        "--commands",
        action="store_true",
        help="print the evaluations that would measure what the evidence does not cover, one per line",
    )
    parser.add_argument("--csv", type=Path, metavar="FILE", help="also write the table as CSV (raw bytes)")
    vllm = parser.add_argument_group("vLLM's flags (--runtime vllm), by vLLM's names and with its defaults")
    vllm.add_argument(
        "--gpu-memory-utilization",
        type=float,
        metavar="FRACTION",
        help="share of the device vLLM may take, in (0, 1] (default 0.9)",
    )
    vllm.add_argument(
        "--max-model-len",
        type=positive_int,
        metavar="N",
        help="longest request vLLM serves (default, as vLLM's: the model's max_position_embeddings); "
        "its concurrency is per this",
    )
    vllm.add_argument(
        "--max-num-seqs",
        type=positive_int,
        metavar="N",
        help=f"sequences per step (default {DEFAULT_MAX_NUM_SEQS}); the profile run samples so many",
    )
    vllm.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        metavar="N",
        help=f"tokens per step (default {DEFAULT_MAX_NUM_BATCHED_TOKENS}; vllm serve on H100/H200: "
        "8192): "
        "the profile run's forward and the prompt chunk",
    )
    vllm.add_argument(
        "--kv-cache-dtype",
        choices=tuple(KV_CACHE_DTYPES),
        help="auto (the model's dtype), fp8, fp8_e4m3, fp8_e5m2 (1 byte per element: --kv-format fp8)",
    )
    vllm.add_argument("--block-size", type=positive_int, metavar="TOKENS", help="tokens per KV block (default 16)")
    vllm.add_argument(
        "--non-torch-memory",
        type=memory_size,
        metavar="SIZE",
        help="memory vLLM holds outside torch per device (CUDA context, NCCL), as its log prints it "
        f"(default: calibrated, 1.79 GiB on one GPU, 3.58 GiB with tp x pp > 1); {SIZE_HELP}",
    )
    vllm.add_argument(
        "--cuda-graph-memory",
        type=memory_size,
        metavar="SIZE",
        help="CUDA graph memory vLLM >= 0.21 subtracts from the pool (its log: 'Estimated CUDA graph "
        "memory'; default 0: earlier builds capture the graphs after sizing the pool)",
    )
    add_llama_cpp_arguments(parser)
    add_speed_arguments(parser)


def add_speed_arguments(parser: argparse.ArgumentParser) -> None:
    from ..plan.hardware import hardware_names

    parser.add_argument(
        "--hardware",
        metavar="NAME",
        help=f"plan decode tokens/s and time to first token on this device: {', '.join(hardware_names())} "
        "(cpu: this machine, probed)",
    )
    parser.add_argument(
        "--min-tokens-per-s",
        type=float,
        metavar="X",
        help="also answer: the most sessions that each decode at >= X tokens/s, judged by the low end of the "
        "speed interval (needs --hardware)",
    )
    parser.add_argument(
        "--reprobe",
        action="store_true",
        help="with --hardware cpu: measure this CPU's bandwidth, matmul and attention again instead of reading "
        "them from the cache (~/.cache/cachelib/cpu_probe.json), and keep the new figures",
    )


def run(args: argparse.Namespace) -> int:
    try:
        _run(args)
    except (ValueError, OSError) as e:
        from . import os_error_text

        text = os_error_text(e) if isinstance(e, OSError) else str(e)
        print(f"error: {clip_message(text)}", file=sys.stderr)  # an input quoted to ~100 characters
        return 2
    return 0


def _kv_format(args: argparse.Namespace) -> str | None:
    """--kv-format, or vLLM's --kv-cache-dtype by its own name (the two must agree)."""
    if args.kv_cache_dtype is None:
        return args.kv_format
    if args.runtime != "vllm":
        raise ValueError(
            f"--kv-cache-dtype is a flag of runtime vllm; --runtime {args.runtime} does not have it "
            f"(vllm's flags: {', '.join(VLLM_FLAGS)})"
        )
    fmt = kv_format_of(args.kv_cache_dtype)
    if args.kv_format is not None and args.kv_format != fmt:
        raise ValueError(
            f"--kv-cache-dtype {args.kv_cache_dtype} stores {fmt or 'the dtype'}, not --kv-format "
            f"{args.kv_format}; give one of them"
        )
    return fmt


def request_from_args(args: argparse.Namespace, arch=None) -> PlanRequest:
    """The planning request the flags make (memory already read into bytes by the flags); with
    no --strategy, the runtime's standard set (less what ``arch`` refuses)."""
    runtime, backend = resolve_runtime(args.runtime, args.backend)  # as PlanRequest resolves them
    return PlanRequest(
        args.strategy or list(default_strategies(runtime, arch, backend)),
        context=args.context,
        batch=args.batch,
        backend=args.backend,
        dtype=args.dtype,
        prefill=args.prefill,
        prefill_chunk=args.prefill_chunk,
        weights_bytes=args.weights_memory,
        budget_bytes=args.budget,
        reserve_bytes=args.reserve,
        weights_dtype=args.weights_dtype,
        runtime=args.runtime,
        tp=args.tp,
        pp=args.pp,
        kv_format=_kv_format(args),
        device=args.device,
        sessions=args.sessions,
        solve=args.solve,
        max_kl=args.max_kl,
        min_agreement=args.min_agreement,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        non_torch_bytes=args.non_torch_memory,
        cuda_graph_bytes=args.cuda_graph_memory,
        **llama_cpp_fields(args),
        suggest=args.suggest,
        most_sessions=args.most_sessions,
        hardware=args.hardware,
        min_tokens_per_s=args.min_tokens_per_s,
    )


def evidence_sources(args: argparse.Namespace) -> list[Path]:
    """The evidence paths the flags name: the committed set unless left out, then each --evidence."""
    sources = [] if args.no_default_evidence else [DEFAULT_EVIDENCE]
    return sources + list(args.evidence or [])


def _run(args: argparse.Namespace) -> None:
    if args.csv:  # checked before any work: never a folder, never a file of another kind (a profile)
        check_plan_csv(args.csv)
    arch = resolve_model(args.model)
    request = request_from_args(args, arch)
    if getattr(args, "reprobe", False):
        from ..plan.cpu_probe import reprobe

        reprobe()
    sources = evidence_sources(args)
    evidence = load_evidence(sources) if sources else None
    for warning in evidence.warnings if evidence else ():
        print(f"warning: {warning}", file=sys.stderr)
    result = plan_request(arch, request, evidence.points if evidence else ())
    fits = result.fits
    too_long = arch.context_warning(request.context)
    if too_long:
        print(f"warning: {too_long}", file=sys.stderr)
    speed = None
    if request.hardware is not None:
        speed = speed_report(arch, request, fits, flash_attn=request.flash_attn != "off")
    answer = build_answer(result, args.model, speed)
    print(answer.text())  # the answer first: the runtime's command, sessions, memory, quality
    if args.explain:
        print("how: " + "\n     ".join(answer.steps))
    if args.runtime is None:
        print(
            f"runtime: {request.runtime}, the default on backend {request.backend} (what users deploy there; "
            "--runtime names another, --runtime cachelib plans cachelib's own profiler loop)"
        )
    print()
    print(_header(result))
    for solved in result.solved:
        print(solved.text)
    print(format_table(fits, budgeted=request.budget_bytes is not None))
    if evidence is not None:
        print(
            f"evidence: {len(evidence.points)} measured point(s) from {len(evidence.files)} file(s) "
            f"({', '.join(map(str, sources))}), measured on {', '.join(evidence.models) or 'no model'}"
            + ("" if arch.names & set(evidence.models) else f", not on {arch.name}")
        )
    print()
    for f in fits:
        j = result.judgements.get(f.spec)
        if j is None or j.quality is not None and not j.quality.samples:
            continue  # exact by construction: nothing to say
        print(f"{f.spec}: " + (describe(j.quality) if j.quality is not None else j.reason))
    if result.recommendation is not None:
        print()
        print("recommendation: " + result.recommendation.text)
    if result.skipped:
        print(
            f"measured but not plannable here ({len(result.skipped)}): "
            + "; ".join(f"{spec} ({why})" for spec, why in result.skipped.items())
        )
    if answer.commands:
        if args.commands:
            print("\nto measure what the evidence does not cover:")
            print("\n".join(answer.commands))
        else:
            print(
                f"\n{len(answer.commands)} evaluation(s) would measure what the evidence does not cover: --commands "
                "prints them"
            )
    if request.hardware is not None:
        print()
        print(format_speed(speed, request))
    if args.layers:
        for spec in request.strategies:
            print()
            print(_layer_table(arch, spec, request))
    if args.csv:
        write_csv(args.csv, fits, arch.name)
        print(f"\nwrote {args.csv}")


# ---------------------------------------------------------------------------------------------
# text


def _header(result: PlanResult) -> str:
    arch, r = result.arch, result.request
    prompt = r.context if r.prefill is None else r.prefill
    chunk = r.chunk
    feed = f"in chunks of {chunk}" if chunk else "in one update"
    d = r.deployment
    lines = [
        describe_layout(arch, d, r.backend),  # the layers as the runtime builds them
        f"{d.describe() if d else r.backend}, K/V {r.dtype}, batch {r.batch}, context {r.context} "
        f"(prompt {prompt} {feed}, then {r.context - prompt} decode steps)",
        f"loop planned: {r.loop}",
    ]
    if result.weights_bytes is not None and result.fits:
        f = result.fits[0]
        lines.append(f"memory per device (GiB = 2^30 bytes), counted for {f.spec}:")
        for name, n, note in f.device.terms():
            lines.append(f"  {name:<17} {human_gib(n):>11}  {note}")
        lines.append(
            f"  {'total':<17} {human_gib(f.device.total):>11}"
            + (f"  of a {human_gib(r.budget_bytes)} budget" if r.budget_bytes is not None else "")
        )
    try:
        pool = r.vllm_pool(arch)
    except ValueError as e:  # a layer kind whose pages are not modelled: the plan above still holds
        pool = None
        lines.append(f"vLLM's KV pool: not planned ({e})")
    if pool is not None:
        lines.append("vLLM's KV pool per device, as vLLM sizes it at startup (Worker.determine_available_memory):")
        for name, n, note in pool.terms():
            lines.append(f"  {name:<17} {human_gib(n):>11}  {note}")
        lines += [f"  vLLM would log: {line}" for line in pool.log_lines()]
        if pool.refused:
            lines.append(f"  {pool.refused}")
    lines.append(SESSIONS_TEXT)
    return "\n".join(lines)


SESSIONS_TEXT = (
    "max batch: sequences in one batch that fit (each row's cache and activations); sessions: independent "
    "conversations of this context served concurrently (one prefills while the others hold their cache), "
    "so sessions can exceed the max batch"
)


def format_speed(report: SpeedReport, request: PlanRequest) -> str:
    """The speed table (one row per strategy at the sessions it fits), what a step reads, the
    speed-ups and, with a threshold, the most sessions at that speed."""
    hw, eff = report.hardware, report.efficiency
    lines = [
        f"speed on {hw.name}: {hw.bandwidth / 1e9:,.0f} GB/s"
        + (
            f", {hw.compute(request.dtype if request.dtype != 'float32' else 'float32') / 1e12:,.1f} TFLOP/s"
            if hw.compute("float16")
            else ""
        )
        + f" ({'; '.join(hw.sources)})",
        f"  runtime reaches {eff.bandwidth_fraction:.0%} of the bandwidth, {eff.compute_fraction:.0%} of the compute, "
        f"+{eff.overhead_s * 1e3:.2f} ms per step, interval +-{eff.spread:.0%}: {eff.source}",
    ]
    rows = report.rows()
    head = [
        "strategy",
        "sessions",
        "tok/s/session",
        "interval",
        "tok/s all",
        "tok/s/device",
        "TTFT s",
        "step GB",
        "bound",
    ]
    keys = [
        "strategy",
        "sessions",
        "tokens/s per session",
        "interval",
        "tokens/s aggregate",
        "tokens/s per device",
        "time to first token s",
        "step GB read",
        "bound",
    ]
    if report.most_sessions:
        head.append(f">= {request.min_tokens_per_s:g} tok/s")
        keys.append("sessions at min tokens/s")
    table = [[("-" if r.get(k) is None else str(r.get(k))) for k in keys] for r in rows]
    widths = [max(len(x[i]) for x in [head, *table]) for i in range(len(head))]
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(t, widths))) for t in table]
    lines += [s.explain() for s in report.speeds]
    lines += report.speedups
    for spec, (n, fit_n) in report.most_sessions.items():
        cap = "" if fit_n is None else f" (memory fits {fit_n})"
        lines.append(
            f"most sessions at >= {request.min_tokens_per_s:g} tokens/s each (the interval's low end): {spec}: {n}{cap}"
        )
    if hw.note:
        lines.append(f"note: {hw.note}")
    return "\n".join(lines)


def _limit_text(fit: Fit) -> str:
    if fit.context_limit == "unbounded":
        return "unbounded"
    if fit.context_limit == "model":
        return f"{fit.max_context} (model)"
    if fit.context_limit == "max_len":
        return f"{fit.max_context} (max_len)"
    return "-" if fit.max_context is None else str(fit.max_context)


def format_table(fits: list[Fit], budgeted: bool) -> str:
    """The plan as an aligned text table, one row per strategy: one device's bytes (GiB), and
    the cache over every device of the deployment ("all devices") when there are several."""
    head = ["strategy", "allocated", "used", "peak", "per token", "host", "activations"]
    spread = any(f.cache.devices > 1 for f in fits)
    if spread:
        head.insert(2, "all devices")
    measured = any(f.quality is not None for f in fits)
    if measured:
        head += ["mean KL", "top-1"]
    if budgeted:
        head += ["fits", "headroom", "max context", "max batch", "sessions", "budget needed"]
    rows = []
    for f in fits:
        c = f.cache
        row = [
            f.spec,
            human_gib(c.bytes_allocated),
            human_gib(c.bytes_used),
            human_gib(c.peak_bytes),
            human_gib(c.bytes_per_token),
            human_gib(c.host_bytes) if c.host_bytes else "-",
            human_gib(f.activation_bytes),
        ]
        if spread:
            row.insert(2, human_gib(c.total_bytes))
        if measured:
            q = f.quality
            row += [f"{q.mean_kl:.4g}" if q else "not covered", f"{q.top1_agreement:.1%}" if q else "-"]
        if budgeted:
            row += [
                "yes" if f.fits else "NO",
                human_gib(f.headroom_bytes),
                _limit_text(f),
                str(f.max_batch),
                str(f.sessions),
                human_gib(f.budget_needed),
            ]
        rows.append(row)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    return "\n".join(lines)


def _layer_table(arch, spec, r: PlanRequest) -> str:
    """Per-layer caches at the end of the run; consecutive identical layers share a row."""
    acc = r.account(arch, spec)
    runs: list[list] = []
    for la in acc.layers:
        key = (la.layer_type, la.kind, la.tokens_held, la.capacity, la.bytes_allocated, la.on_device)
        if runs and runs[-1][0] == key and runs[-1][2] == la.index - 1:
            runs[-1][2] = la.index
        else:
            runs.append([key, la.index, la.index])
    lines = [
        f"{spec}: per layer",
        f"{'layers':>7}  {'type':<9}  {'cache':<26}  {'held':>8}  {'slots':>8}  {'each':>10}  where",
    ]
    for (kind, cls, held, slots, nbytes, on_device), first, last in runs:
        span = str(first) if first == last else f"{first}-{last}"
        lines.append(
            f"{span:>7}  {kind:<9}  {cls:<26}  {held:>8}  {slots:>8}  {human_gib(nbytes):>10}  "
            + ("device" if on_device else "host")
        )
    return "\n".join(lines)


def write_csv(path: Path, fits: list[Fit], model: str) -> None:
    """The plan as CSV, one row per strategy, raw byte counts (columns: :data:`CSV_COLUMNS`). Text
    that a spreadsheet would run as a formula (a model named ``=HYPERLINK(...)``) gets a leading
    apostrophe (:func:`cachelib.core.cells.escape_cell`); numbers stay numbers."""
    from ..profile.outputs import write_whole

    check_plan_csv(path)
    with io.StringIO(newline="") as fh:  # the whole table, then one atomic write (errors name the path)
        w = csv.DictWriter(fh, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for f in fits:
            c = f.cache
            w.writerow(
                {
                    k: escape_cell(v)
                    for k, v in {
                        "model": model,
                        "backend": c.backend,
                        "dtype": c.dtype,
                        "batch": c.batch,
                        "context": c.context,
                        "prefill": c.prefill,
                        "prefill_chunk": c.prefill_chunk or "",
                        "strategy": f.spec,
                        "bytes_allocated": c.bytes_allocated,
                        "bytes_used": c.bytes_used,
                        "peak_bytes": c.peak_bytes,
                        "max_resident_bytes": c.max_resident_bytes,
                        "device_bytes": c.device_bytes,
                        "host_bytes": c.host_bytes,
                        "bytes_per_token": round(c.bytes_per_token, 3),
                        "weights_bytes": _blank(f.weights_bytes),
                        "activation_bytes": f.activation_bytes,
                        "overhead_bytes": f.overhead_bytes,
                        "reserve_bytes": f.reserve_bytes,
                        "budget_bytes": _blank(f.budget_bytes),
                        "budget_needed": _blank(f.budget_needed),
                        "headroom_bytes": _blank(f.headroom_bytes),
                        "fits": _blank(f.fits),
                        "max_context": _blank(f.max_context),
                        "context_limit": f.context_limit,
                        "max_batch": _blank(f.max_batch),
                        "sessions": _blank(f.sessions),
                        "mean_kl": _blank(f.quality and f.quality.mean_kl),
                        "top1_agreement": _blank(f.quality and f.quality.top1_agreement),
                        "quality_model": _blank(f.quality and f.quality.model),
                        "quality_source": _blank(f.quality and f.quality.source),
                        "quality_context": _blank(f.quality and f.quality.context),
                        "quality_kept_fraction": _blank(f.quality and f.quality.kept_fraction),
                        "mean_kl_ci95": _blank(f.quality and f.quality.mean_kl_ci95),
                        "quality_note": _blank(f.quality and f.quality.note),
                    }.items()
                }
            )
        write_whole(path, fh.getvalue(), "plan CSV")


def check_plan_csv(path: Path) -> Path:
    """``path`` as a place for ``plan --csv``, checked before any work
    (:func:`cachelib.profile.outputs.check_out_path`): a ``.csv`` name, no folder there, no file
    of another kind (a profile, an evaluation), and a folder it can be written in."""
    from ..profile.outputs import AtomicFile, check_out_path

    check_out_path(path, what="plan CSV", suffixes=(".csv",), replaces=("csv:model",))
    AtomicFile(path, "plan CSV").open().discard()  # proves the folder takes a file (/proc, read-only)
    return Path(path)


def _blank(v):
    return "" if v is None else v


def _shares(text: str) -> tuple[float, ...]:
    try:
        shares = tuple(float(x) for x in text.replace("/", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"give one share per device, e.g. 3,1; got {text!r}") from None
    return shares


def add_llama_cpp_arguments(parser: argparse.ArgumentParser) -> None:
    """llama.cpp's own flags, by llama.cpp's names, where they change the bytes (runtime llama.cpp)."""
    g = parser.add_argument_group("llama.cpp (--runtime llama.cpp; defaults: llama-server's)")
    g.add_argument(
        "-np",
        "--parallel",
        dest="slots",
        type=positive_int,
        metavar="N",
        help="server slots (sequences) sharing -c (default: llama-server's auto, 4, with a unified KV)",
    )
    g.add_argument(
        "-kvu",
        "--kv-unified",
        dest="kv_unified",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one KV stream for every slot (default: on with auto slots, off with --parallel N)",
    )
    g.add_argument(
        "--swa-full",
        dest="swa_full",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sliding-window layers keep the whole context (default off)",
    )
    g.add_argument(
        "-fa",
        "--flash-attn",
        dest="flash_attn",
        choices=("on", "off", "auto"),
        help="flash attention (default auto); a quantized V cache (--kv-format q8_0|q4_0) needs on or auto",
    )
    g.add_argument(
        "-ub",
        "--ubatch-size",
        dest="ubatch",
        type=positive_int,
        metavar="N",
        help="physical batch, the SWA cache's margin (default 512)",
    )
    g.add_argument(
        "-ts",
        "--tensor-split",
        dest="tensor_split",
        type=_shares,
        metavar="SHARES",
        help="each device's share of the layers, one per --pp device (default: equal), e.g. 3,1",
    )


def llama_cpp_fields(args: argparse.Namespace) -> dict:
    """The llama.cpp flags given, as :class:`PlanRequest` fields."""
    names = ("slots", "kv_unified", "swa_full", "flash_attn", "ubatch", "tensor_split")
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
