"""``python -m cachelib sweep GRID.toml``: run a grid of profiles on a local Dask cluster or a scheduler.

Exit codes: 0 when every point is done (or stopped early by design, e.g. the memory guard),
1 when some point failed (see the index; re-run to retry them), 2 for bad input (one line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..sweep.progress import Progress
from ..sweep.run import plan_sweep, run_sweep
from .args import positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("grid", type=Path, help="the sweep file (TOML): models, backends, strategies, prompts or texts, ...")
    p.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        default=None,
        help="a Dask scheduler, e.g. tcp://host:8786 (default: a local cluster)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="the sweep folder (default: profiles/NAME/, the grid's name)",
    )
    p.add_argument(
        "--workers",
        type=positive_int,
        default=None,
        metavar="N",
        help="local CPU worker processes (default: sized to this machine)",
    )
    p.add_argument("--dry-run", action="store_true", help="list the points and what would run; run nothing")
    p.add_argument(
        "--one-by-one",
        action="store_true",
        help="each point advances its strategies by a forward each (default: one strategy batch per point)",
    )


def run(args: argparse.Namespace) -> int:
    if args.scheduler is not None and args.workers is not None:
        raise ValueError("--workers sizes the local cluster; with --scheduler the cluster's own workers run the sweep")
    if args.dry_run:
        plan = plan_sweep(args.grid, args.out, local=args.scheduler is None)
        todo = {p.id for p in plan.todo}
        for p in plan.points:
            state = "run " if p.id in todo else "skip"
            need = ",".join(f"{k}={v}" for k, v in p.resources.items()) or "-"
            print(f"{state} {p.id}  [{need}]  {' '.join(str(s) for s in p.strategies)}")
        print(f"{len(plan.points)} points, {len(todo)} to run -> {plan.folder}")
        return 0
    if args.scheduler is None:  # the local cluster's workers share this machine: refuse first what cannot fit
        from ..profile.guard import check_point_fits

        for point in plan_sweep(args.grid, args.out).todo:
            check_point_fits(point, one_by_one=args.one_by_one)
    progress = Progress()
    try:
        result = run_sweep(
            args.grid,
            args.out,
            scheduler=args.scheduler,
            workers=args.workers,
            on_event=progress,
            one_by_one=args.one_by_one,
        )
    finally:
        progress.close()
    counts = ", ".join(f"{result.count(s)} {s}" for s in ("done", "stopped", "failed"))
    print(f"sweep: {len(result.rows)} points: {counts} -> {result.folder / 'index.csv'}")
    if not result.ok:
        print("re-run the same command to retry the failed points", file=sys.stderr)
    return 0 if result.ok else 1
