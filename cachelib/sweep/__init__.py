"""Sweeps: grids of profiling runs on Dask distributed, locally or on a cluster.

``load_grid(path)`` reads a TOML grid and checks it; ``run_sweep(grid, out, scheduler=...)`` runs
every unfinished point as one Dask task and writes one profile per point plus ``index.csv``;
``load_index(folder)`` reads a sweep folder's index back. The file format and how to run a
sweep on several machines: the README's "Sweeps" section.
"""

from .grid import DEVICE_RESOURCES, GRID_KEYS, Grid, GridError, Input, Point, load_grid, parse_grid
from .index import INDEX_COLUMNS, INDEX_FILE, STATUSES, load_index
from .run import SweepEvent, SweepPlan, SweepResult, plan_sweep, run_point, run_sweep

__all__ = [
    "load_grid",
    "parse_grid",
    "Grid",
    "GridError",
    "Input",
    "Point",
    "GRID_KEYS",
    "DEVICE_RESOURCES",
    "plan_sweep",
    "run_sweep",
    "run_point",
    "SweepEvent",
    "SweepPlan",
    "SweepResult",
    "load_index",
    "INDEX_COLUMNS",
    "INDEX_FILE",
    "STATUSES",
]
