"""``python -m cachelib retrieval``: the needle-in-a-haystack task per strategy.

``add_arguments(parser)`` declares the flags; ``run(args)`` runs
:func:`cachelib.profile.retrieval` over the grid of contexts x depths and prints the exact-match
accuracy per strategy x context x depth (trials out of trials), and writes the rows as an
evaluation CSV with ``--out`` (the planner reads them as evidence, beside an evaluation's KL).
Bad input, ``--out`` included, raises ValueError before the model loads (one line, exit 2). While
it runs, every finished trial is on disk at once (the profile writer's locked partial file), so
Ctrl-C (exit 130), SIGTERM (143) or a killed process keeps what was measured, in
``NAME.incomplete.csv`` (or the partial file), and the same command resumes it; a finished run
goes to ``NAME.csv``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from ..profile.evaluate import DEFAULT_PREFILL_CHUNK, EvaluationInterrupted
from ..profile.retrieval import QUESTION_MODES, TASKS, retrieval
from .args import add_model_arguments, finite_float, positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument(
        "--strategy",
        action="append",
        default=[],
        metavar="SPEC",
        help="a cache strategy (repeat), e.g. rotating:max_size=256,keep=4",
    )
    p.add_argument(
        "--context",
        action="append",
        type=positive_int,
        required=True,
        metavar="N",
        help="tokens of each trial, prompt, question and key included (repeat)",
    )
    p.add_argument(
        "--depth",
        action="append",
        type=finite_float(0.0, 1.0),
        metavar="D",
        help="where the needle sits, 0 (start) .. 1 (end) (repeat; default 0.1 0.5 0.9)",
    )
    p.add_argument("--trials", type=positive_int, default=4, help="trials per context x depth (default 4)")
    p.add_argument("--task", choices=TASKS, default="passkey", help="passkey (default) or copy")
    p.add_argument("--prefill-chunk", type=positive_int, default=DEFAULT_PREFILL_CHUNK, metavar="K")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, metavar="FILE.csv", help="write the rows here (CSV)")
    p.add_argument(
        "--question",
        choices=QUESTION_MODES,
        default="prompt",
        help="prompt (default): the question is prefilled with the prompt, as a served request is; "
        "decode: it is teacher-forced after the prefill (a compress-once cache chooses before it)",
    )
    p.add_argument(
        "--one-by-one",
        action="store_true",
        help="one strategy's cache at a time (default: a trial's strategies are the rows of one batch)",
    )


def run(args: argparse.Namespace) -> int:
    from . import _sigterm_stops_the_run

    try:
        with _sigterm_stops_the_run():  # SIGTERM stops it as Ctrl-C does: what was measured is kept
            found = retrieval(
                args.model,
                args.strategy or ["standard"],
                contexts=args.context,
                depths=args.depth or [0.1, 0.5, 0.9],
                trials=args.trials,
                seed=args.seed,
                prefill_chunk=args.prefill_chunk,
                backend=args.backend,
                device=args.device,
                task=args.task,
                question=args.question,
                one_by_one=args.one_by_one,
                out=args.out,
            )
    except EvaluationInterrupted as e:
        partial = e.evaluation
        where = f"; what was measured is in {partial.path}" if partial.path else ""
        print(f"{partial.reason}{where}", file=sys.stderr)
        if len(partial.retrieval):
            print(format_accuracy(partial.retrieval))
        return 143 if partial.reason.startswith("interrupted (SIGTERM)") else 130
    print(format_accuracy(found.retrieval))
    for strategy, why in found.notes.items():
        print(f"ran on its own: {strategy}: {why}")
    if found.path is not None:
        line = f"retrieval: {found.path}"
        if not found.complete:
            line += f" (incomplete: {found.reason})"
        elif Path(found.path) != Path(args.out):
            line += f"; {args.out} was kept as it is (another run wrote it while this one ran)"
        print(line)
    return 0


def format_accuracy(rows: pd.DataFrame) -> str:
    """One line per strategy x context x depth: exact matches out of trials."""
    lines = [f"{'context':>7}  {'depth':>5}  {'strategy':<40} {'exact match':>11}  {'key tokens':>10}"]
    keys = ["context", "depth", "strategy"]
    for (context, depth, strategy), g in rows.groupby(keys, sort=True):
        hits = int(g["exact_match"].sum())
        lines.append(
            f"{int(context):>7}  {depth:>5.2f}  {strategy:<40} {hits:>5}/{len(g):<5}  "
            f"{g['key_token_accuracy'].mean():>10.1%}"
        )
    return "\n".join(lines)
