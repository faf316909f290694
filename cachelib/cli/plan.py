"""``python -m cachelib plan``: exact cache bytes per strategy and what fits in a budget, as a
table (and a CSV with ``--csv``).

``add_arguments(parser)`` declares the flags; ``run(args)`` prints the table and returns the exit
code: 0, or 2 with one line on stderr for bad input. Bytes are printed in SI units ("GB" =
10^9 bytes, the unit of ``--budget-gb``); the CSV holds raw byte counts.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from ..core.cells import escape_cell
from ..core.units import DTYPE_BYTES, human_bytes
from .args import finite_float, non_negative_int, positive_int
from ..plan.quality import describe
from ..profile.evidence import DEFAULT_EVIDENCE, load_evidence
from ..plan.accounting import account
from ..plan.presets import preset_names, resolve_model
from ..plan.request import PlanRequest, PlanResult, gb_to_bytes, plan_request
from ..plan.solver import Fit

CSV_COLUMNS = (
    "model", "backend", "dtype", "batch", "context", "prefill", "prefill_chunk", "strategy",
    "bytes_allocated", "bytes_used", "peak_bytes", "max_resident_bytes", "device_bytes", "host_bytes",
    "bytes_per_token", "weights_bytes", "reserve_bytes", "budget_bytes", "budget_needed", "headroom_bytes",
    "fits", "max_context", "context_limit", "max_batch", "sessions", "mean_kl", "top1_agreement", "quality_model",
    "quality_source", "quality_context", "quality_kept_fraction", "mean_kl_ci95", "quality_note",
)  # fmt: skip


GB_VALUE = finite_float(0.0, 1e9)  # GB: up to an exabyte, which is more than any machine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True,
        help=f"a preset ({', '.join(preset_names())}) or a path to a config.json (or its folder)",
    )  # fmt: skip
    parser.add_argument("--context", type=positive_int, required=True, help="tokens the cache holds at the end of a run")
    parser.add_argument("--batch", type=positive_int, default=1, help="sequences per run (default 1)")
    parser.add_argument(
        "--strategy", action="append", metavar="SPEC",
        help="strategy spec, e.g. rotating:max_size=4096,keep=4 (repeat to compare; default: standard)",
    )  # fmt: skip
    parser.add_argument("--backend", choices=("mlx", "torch"), default="mlx", help="cache library (default mlx)")
    parser.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="float16", help="K/V dtype (default float16)")
    parser.add_argument("--prefill", type=non_negative_int, help="prompt tokens (default: the whole context); the rest is decoded")
    parser.add_argument(
        "--prefill-chunk", type=positive_int,
        help="feed the prompt in chunks of this many tokens (mlx-lm's generate uses 2048; default: one update)",
    )  # fmt: skip
    parser.add_argument("--budget-gb", type=GB_VALUE, help="device memory budget in GB (10^9 bytes)")
    parser.add_argument(
        "--weights-gb", type=GB_VALUE, help="measured weight bytes in GB (default: params x --weight-bits)"
    )
    parser.add_argument("--weight-bits", type=finite_float(0.0, 64.0, min_open=True), default=16,
                        help="bits per weight when counting (default 16)")  # fmt: skip
    parser.add_argument("--reserve-gb", type=GB_VALUE, default=0.0, help="kept free for activations/runtime (default 0)")
    parser.add_argument("--layers", action="store_true", help="also print each strategy's per-layer caches")
    parser.add_argument(
        "--evidence", type=Path, action="append", metavar="PATH",
        help="evaluation or profile CSVs (files or folders) whose measured quality judges each strategy, in "
        "addition to the committed evidence (assets/evidence/); repeat for several",
    )  # fmt: skip
    parser.add_argument(
        "--no-default-evidence", action="store_true",
        help="judge by the --evidence paths alone, without the committed evidence",
    )  # fmt: skip
    parser.add_argument("--max-kl", type=finite_float(0.0), help="recommend the cheapest strategy with mean KL at most this (nats)")
    parser.add_argument("--min-agreement", type=finite_float(0.0, 1.0),
                        help="recommend the cheapest strategy with top-1 agreement at least this (0..1)")  # fmt: skip
    parser.add_argument("--csv", type=Path, metavar="FILE", help="also write the table as CSV (raw bytes)")


def run(args: argparse.Namespace) -> int:
    try:
        _run(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def request_from_args(args: argparse.Namespace) -> PlanRequest:
    """The planning request the flags make: GB read into bytes here, at the edge."""
    return PlanRequest(
        args.strategy or ["standard"], context=args.context, batch=args.batch, backend=args.backend,
        dtype=args.dtype, prefill=args.prefill, prefill_chunk=args.prefill_chunk,
        weights_bytes=gb_to_bytes("weights-gb", args.weights_gb), budget_bytes=gb_to_bytes("budget-gb", args.budget_gb),
        reserve_bytes=gb_to_bytes("reserve-gb", args.reserve_gb) or 0, weight_bits=args.weight_bits,
        max_kl=args.max_kl, min_agreement=args.min_agreement,
    )  # fmt: skip


def evidence_sources(args: argparse.Namespace) -> list[Path]:
    """The evidence paths the flags name: the committed set unless left out, then each --evidence."""
    sources = [] if args.no_default_evidence else [DEFAULT_EVIDENCE]
    return sources + list(args.evidence or [])


def _run(args: argparse.Namespace) -> None:
    arch = resolve_model(args.model)
    request = request_from_args(args)
    sources = evidence_sources(args)
    evidence = load_evidence(sources) if sources else None
    for warning in evidence.warnings if evidence else ():
        print(f"warning: {warning}", file=sys.stderr)
    result = plan_request(arch, request, evidence.points if evidence else ())
    fits = result.fits
    too_long = arch.context_warning(request.context)
    if too_long:
        print(f"warning: {too_long}", file=sys.stderr)
    print(_header(result))
    print(format_table(fits, budgeted=request.budget_bytes is not None))
    if evidence is not None:
        print(f"evidence: {len(evidence.points)} measured point(s) from {len(evidence.files)} file(s) "
              f"({', '.join(map(str, sources))}), measured on {', '.join(evidence.models) or 'no model'}"
              + ("" if arch.names & set(evidence.models) else f", not on {arch.name}"))  # fmt: skip
    print()
    for f in fits:
        j = result.judgements.get(f.spec)
        if j is None or j.quality is not None and not j.quality.samples:
            continue  # exact by construction: nothing to say
        line = f"{f.spec}: " + (describe(j.quality) if j.quality is not None else j.reason)
        print(line + (f"\n    measure it: {j.command}" if j.command else ""))
    if result.recommendation is not None:
        print()
        print("recommendation: " + result.recommendation.text)
        for spec, why in result.skipped.items():
            print(f"measured but not plannable here: {spec} ({why})")
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
    weights, budget = result.weights_bytes, r.budget_bytes
    prompt = r.context if r.prefill is None else r.prefill
    feed = f"in chunks of {r.prefill_chunk}" if r.prefill_chunk else "in one update"
    lines = [
        arch.describe(),
        f"{r.backend} {r.dtype}, batch {r.batch}, context {r.context} "
        f"(prompt {prompt} {feed}, then {r.context - prompt} decode steps)",
    ]
    if weights is not None:
        how = "given" if r.weights_bytes is not None else f"{arch.num_params:,} params x {r.weight_bits:g} bits"
        lines.append(f"weights {human_bytes(weights)} ({how})")
    if budget is not None:
        lines.append(f"budget {human_bytes(budget)}, reserve {human_bytes(r.reserve_bytes)}")
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
    """The plan as an aligned text table, one row per strategy."""
    head = ["strategy", "allocated", "used", "peak", "per token", "host"]
    measured = any(f.quality is not None for f in fits)
    if measured:
        head += ["mean KL", "top-1"]
    if budgeted:
        head += ["fits", "headroom", "max context", "max batch", "sessions", "budget needed"]
    rows = []
    for f in fits:
        c = f.cache
        row = [f.spec, human_bytes(c.bytes_allocated), human_bytes(c.bytes_used), human_bytes(c.peak_bytes),
               human_bytes(c.bytes_per_token), human_bytes(c.host_bytes) if c.host_bytes else "-"]  # fmt: skip
        if measured:
            q = f.quality
            row += [f"{q.mean_kl:.4g}" if q else "not covered", f"{q.top1_agreement:.1%}" if q else "-"]
        if budgeted:
            row += ["yes" if f.fits else "NO", human_bytes(f.headroom_bytes), _limit_text(f), str(f.max_batch),
                    str(f.sessions), human_bytes(f.budget_needed)]  # fmt: skip
        rows.append(row)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    return "\n".join(lines)


def _layer_table(arch, spec, r: PlanRequest) -> str:
    """Per-layer caches at the end of the run; consecutive identical layers share a row."""
    acc = account(arch, spec, r.backend, context=r.context, prefill=r.prefill, prefill_chunk=r.prefill_chunk,
                  batch=r.batch, dtype=r.dtype)  # fmt: skip
    runs: list[list] = []
    for la in acc.layers:
        key = (la.layer_type, la.kind, la.tokens_held, la.capacity, la.bytes_allocated, la.on_device)
        if runs and runs[-1][0] == key and runs[-1][2] == la.index - 1:
            runs[-1][2] = la.index
        else:
            runs.append([key, la.index, la.index])
    lines = [f"{spec}: per layer",
             f"{'layers':>7}  {'type':<9}  {'cache':<26}  {'held':>8}  {'slots':>8}  {'each':>10}  where"]  # fmt: skip
    for (kind, cls, held, slots, nbytes, on_device), first, last in runs:
        span = str(first) if first == last else f"{first}-{last}"
        lines.append(
            f"{span:>7}  {kind:<9}  {cls:<26}  {held:>8}  {slots:>8}  {human_bytes(nbytes):>10}  "
            + ("device" if on_device else "host")
        )
    return "\n".join(lines)


def write_csv(path: Path, fits: list[Fit], model: str) -> None:
    """The plan as CSV, one row per strategy, raw byte counts (columns: :data:`CSV_COLUMNS`). Text
    that a spreadsheet would run as a formula (a model named ``=HYPERLINK(...)``) gets a leading
    apostrophe (:func:`cachelib.core.cells.escape_cell`); numbers stay numbers."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for f in fits:
            c = f.cache
            w.writerow({k: escape_cell(v) for k, v in {
                "model": model, "backend": c.backend, "dtype": c.dtype, "batch": c.batch, "context": c.context,
                "prefill": c.prefill, "prefill_chunk": c.prefill_chunk or "", "strategy": f.spec,
                "bytes_allocated": c.bytes_allocated, "bytes_used": c.bytes_used, "peak_bytes": c.peak_bytes,
                "max_resident_bytes": c.max_resident_bytes, "device_bytes": c.device_bytes,
                "host_bytes": c.host_bytes, "bytes_per_token": round(c.bytes_per_token, 3),
                "weights_bytes": _blank(f.weights_bytes), "reserve_bytes": f.reserve_bytes,
                "budget_bytes": _blank(f.budget_bytes), "budget_needed": _blank(f.budget_needed),
                "headroom_bytes": _blank(f.headroom_bytes), "fits": _blank(f.fits),
                "max_context": _blank(f.max_context), "context_limit": f.context_limit,
                "max_batch": _blank(f.max_batch), "sessions": _blank(f.sessions),
                "mean_kl": _blank(f.quality and f.quality.mean_kl),
                "top1_agreement": _blank(f.quality and f.quality.top1_agreement),
                "quality_model": _blank(f.quality and f.quality.model),
                "quality_source": _blank(f.quality and f.quality.source),
                "quality_context": _blank(f.quality and f.quality.context),
                "quality_kept_fraction": _blank(f.quality and f.quality.kept_fraction),
                "mean_kl_ci95": _blank(f.quality and f.quality.mean_kl_ci95),
                "quality_note": _blank(f.quality and f.quality.note),
            }.items()})  # fmt: skip


def _blank(v):
    return "" if v is None else v
