"""``python -m cachelib evaluate``: long-context quality of cache strategies against the full cache.

``add_arguments(parser)`` declares the flags; ``run(args)`` runs :func:`cachelib.profile.evaluate`
and prints one line per strategy x context: mean KL, top-1 agreement and delta-perplexity, each
with its 95% confidence interval over windows and texts, and the kept fraction. Bad input raises
ValueError before the model loads (the CLI prints one line and exits 2); Ctrl-C keeps what was
measured in ``NAME.incomplete.csv`` and exits 130 (SIGTERM: 143); the same command then resumes it.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pandas as pd

from ..profile.evaluate import (
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_SCORE_TOKENS,
    DEFAULT_WINDOWS,
    EvaluationInterrupted,
    EvaluationStep,
    evaluate,
)
from .args import add_model_arguments, positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument(
        "--strategy",
        action="append",
        default=[],
        metavar="SPEC",
        help="a cache strategy, e.g. rotating:max_size=256,keep=4 (repeat; the first is the full-cache "
        "reference when it is lossless, else standard is added in front)",
    )
    p.add_argument(
        "--context",
        action="append",
        type=positive_int,
        required=True,
        metavar="N",
        help="tokens prefilled before scoring (repeat for several contexts, all in one output file)",
    )
    p.add_argument(
        "--score-tokens",
        type=positive_int,
        default=DEFAULT_SCORE_TOKENS,
        metavar="M",
        help=f"tokens scored teacher-forced after the prefill (default {DEFAULT_SCORE_TOKENS})",
    )
    p.add_argument(
        "--windows",
        type=positive_int,
        default=DEFAULT_WINDOWS,
        metavar="W",
        help=f"evenly spaced windows per text (default {DEFAULT_WINDOWS})",
    )
    p.add_argument(
        "--prefill-chunk",
        type=positive_int,
        default=DEFAULT_PREFILL_CHUNK,
        metavar="K",
        help=f"tokens per prefill forward pass (default {DEFAULT_PREFILL_CHUNK}, mlx-lm's)",
    )
    p.add_argument(
        "--text",
        action="append",
        type=Path,
        default=None,
        metavar="FILE",
        help="an evaluation text (repeat; default: every assets/corpus/*.txt)",
    )
    p.add_argument("--out", type=Path, default=None, metavar="FILE.csv", help="write the evaluation here (CSV)")
    p.add_argument(
        "--one-by-one",
        action="store_true",
        help="one strategy's cache at a time (default: a window's strategies are the rows of one batch)",
    )


def run(args: argparse.Namespace) -> int:
    from . import _sigterm_stops_the_run

    bar = _Progress() if sys.stderr.isatty() else None
    try:
        with _sigterm_stops_the_run():  # SIGTERM stops it as Ctrl-C does: what was measured is kept
            evaluation = evaluate(
                args.model,
                args.strategy or ["standard"],
                texts=args.text,
                context=args.context,
                score_tokens=args.score_tokens,
                windows=args.windows,
                prefill_chunk=args.prefill_chunk,
                backend=args.backend,
                device=args.device,
                out=args.out,
                on_progress=bar.update if bar else None,
                one_by_one=args.one_by_one,
            )
    except EvaluationInterrupted as e:
        if bar:
            bar.done()
        partial = e.evaluation
        where = f"; what was measured is in {partial.path}" if partial.path else ""
        print(f"interrupted: {partial.reason}{where}", file=sys.stderr)
        if len(partial.samples):
            print(format_summary(partial.summary()))
        return 143 if str(e).startswith("interrupted (SIGTERM)") else 130
    if bar:
        bar.done()
    print(format_summary(evaluation.summary()))
    for strategy, why in evaluation.notes.items():
        print(f"ran on its own: {strategy}: {why}")
    if evaluation.path is not None:
        line = f"evaluation: {evaluation.path}"
        if not evaluation.complete:
            line += f" (incomplete: {evaluation.reason})"
        elif Path(evaluation.path) != Path(args.out):
            line += f"; {args.out} was kept as it is (another run wrote it while this one ran)"
        print(line)
    return 0


def _pm(value: float, ci: float, fmt: str, sign: str = "") -> str:
    half = "n/a (n=1)" if ci is None or math.isnan(ci) else format(ci, fmt)
    return f"{format(value, sign + fmt)} ± {half}"


def format_summary(summary: pd.DataFrame) -> str:
    """One line per strategy x context: mean KL, top-1, ppl and delta-ppl with their 95% CIs."""
    lines = [
        f"{'context':>7}  {'strategy':<40} {'n':>3} {'kept':>6}  {'mean KL (95% CI)':<22} "
        f"{'top-1 (95% CI)':<20} {'ppl':>8}  {'Δppl (95% CI)':<20}"
    ]
    for _, r in summary.iterrows():
        lines.append(
            f"{int(r['context']):>7}  {r['strategy']:<40} {int(r['n']):>3} {r['kept_fraction']:>6.1%}  "
            f"{_pm(r['mean_kl'], r['mean_kl_ci95'], '.4f'):<22} {_pm(r['top1_agreement'], r['top1_ci95'], '.3f'):<20} "
            f"{r['ppl']:>8.3f}  {_pm(r['delta_ppl'], r['delta_ppl_ci95'], '.3f', '+'):<20}"
        )
    return "\n".join(lines)


class _Progress:
    def update(self, step: EvaluationStep) -> None:
        r = step.row
        sys.stderr.write(
            f"\r[{step.done}/{step.total}] context {r['context']} {r['text']}@{r['window_start']} "
            f"{r['strategy']:<40.40}"
        )
        sys.stderr.flush()

    def done(self) -> None:
        sys.stderr.write("\n")
