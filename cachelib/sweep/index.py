"""A sweep folder's ``index.csv``: one row per grid point, what became of it and where its profile is.

Text cells a spreadsheet would run as a formula (a prompt ``=cmd|' /C calc'!A0``) are written
with a leading apostrophe and read back without it (:mod:`cachelib.core.cells`), as in profiles.

The sweep rewrites the index atomically (temporary file, fsync, rename) at the start and after
every point that ends, so a reader (the app's Profiles page, a re-run) always sees a whole file
and nothing finished is lost. This module knows the columns and the file; it does not run anything.
"""

from __future__ import annotations

import csv
import errno
import io
import os
from pathlib import Path
from typing import Iterable

import pandas as pd

from ..core.cells import escape_cell, unescape_cell
from ..profile.outputs import AtomicFile, os_error_at, write_whole
from .grid import Point

INDEX_FILE = "index.csv"
GRID_FILE = "grid.toml"  # the grid file as it was run, for the record

# One name per column; the README's "Sweeps" section documents each.
INDEX_COLUMNS = (
    "point",  # stable id of the grid point; also the profile's file stem and its meta `name`
    "status",  # pending | done | stopped | failed
    "file",  # the profile CSV, relative to the sweep folder (empty unless done / stopped)
    "error",  # failed: why; stopped: why the profile ended early (e.g. the memory guard)
    "attempts",  # tries the point took in the last sweep that ran it
    "started",  # ISO 8601 UTC, the last attempt's start
    "finished",
    "worker",  # the Dask worker that ran the last attempt
    "model",
    "backend",
    "device",
    "input",  # the prompt, or the text file as the grid names it
    "max_tokens",
    "mode",  # teacher-forced | free-running
    "strategies",  # spec texts in run order, space-separated; the first is the baseline
)
STATUSES = ("pending", "done", "stopped", "failed")
FINISHED = ("done", "stopped")  # a re-run skips these


def pending_row(point: Point) -> dict[str, str]:
    """A fresh index row for ``point``."""
    row = dict.fromkeys(INDEX_COLUMNS, "")
    row.update(
        point=point.id,
        status="pending",
        model=point.model,
        backend=point.backend,
        device=point.device,
        input=point.input.source,
        max_tokens=str(point.max_tokens),
        mode=point.mode,
        strategies=" ".join(str(s) for s in point.strategies),
    )
    return row


def read_index(folder: str | os.PathLike) -> dict[str, dict[str, str]]:
    """The rows of ``folder/index.csv`` by point id ({} when there is none)."""
    path = Path(folder) / INDEX_FILE
    if not path.exists():
        return {}
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            missing = [c for c in ("point", "status", "file") if c not in (reader.fieldnames or ())]
            if missing:
                raise ValueError(f"{path}: not a sweep index (no column {', '.join(missing)})")
            rows = {}
            for raw in reader:
                row = {c: unescape_cell(raw.get(c) or "") for c in INDEX_COLUMNS}
                if row["status"] not in STATUSES:
                    raise ValueError(
                        f"{path}: point {row['point']!r} has status {row['status']!r}; statuses: {', '.join(STATUSES)}"
                    )
                rows[row["point"]] = row
            return rows
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ValueError(f"{path}: cannot read the sweep index ({e})") from None


def profile_problem(folder: str | os.PathLike, row: dict[str, str]) -> str:
    """Why a finished row's profile cannot stand for its point ('' when it opens): the file is
    missing, empty or not a profile, or a done row's profile is not complete. Reads the
    metadata only."""
    if not row["file"]:
        return "the index names no profile file"
    path = Path(folder) / row["file"]
    if not path.is_file():
        return f"its profile {row['file']} is missing"
    if path.stat().st_size == 0:
        return f"its profile {row['file']} is empty (0 bytes)"
    from ..profile.store import read_meta

    try:
        meta = read_meta(path, name=row["file"])
    except ValueError as e:
        return f"its profile does not open ({e})"
    if row["status"] == "done" and meta["status"] != "complete":
        return f"its profile {row['file']} is {meta['status']} ({meta.get('reason') or 'no reason given'})"
    return ""


def write_index(folder: str | os.PathLike, rows: Iterable[dict[str, str]]) -> Path:
    """Write ``folder/index.csv`` in one step (readers never see half a file)."""
    return write_atomic(Path(folder) / INDEX_FILE, _csv_text(rows))


def _csv_text(rows: Iterable[dict[str, str]]) -> bytes:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=INDEX_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({c: escape_cell(row.get(c, "")) for c in INDEX_COLUMNS})  # no cell runs as a formula
    return buf.getvalue().encode("utf-8")


def write_atomic(path: Path, data: bytes) -> Path:
    """``data`` into ``path`` in one step; an error names ``path`` and leaves no hidden file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise os_error_at(e, path, "cannot make its folder") from None
    return write_whole(path, data, "sweep file")


def check_sweep_folder(folder: Path) -> Path:
    """``folder`` as a place a sweep can write, checked before any point runs: an ``OSError``
    naming it otherwise (a file in the way, ``/proc``, a read-only place). The folders it makes
    to find out are removed again: the sweep makes them once it has a cluster to run on."""
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "is a file; give a folder for the sweep", str(folder))
    made = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        AtomicFile(folder / INDEX_FILE, "sweep index").open().discard()
    except (FileExistsError, NotADirectoryError):
        raise NotADirectoryError(errno.ENOTDIR, "a file stands where the sweep folder would go", str(folder)) from None
    except OSError as e:
        raise os_error_at(e, folder, "cannot write the sweep folder") from None
    finally:
        for p in made:  # deepest first
            try:
                p.rmdir()
            except OSError:
                pass
    return folder


def load_index(folder: str | os.PathLike) -> pd.DataFrame:
    """A sweep folder's index as a table (what the app's Profiles page lists), with ``path``: the
    profile's full path, empty when the point has no profile."""
    folder = Path(folder)
    if not (folder / INDEX_FILE).exists():
        raise ValueError(f"{folder}: not a sweep folder (no {INDEX_FILE})")
    frame = pd.DataFrame(list(read_index(folder).values()), columns=list(INDEX_COLUMNS))
    for col in ("attempts", "max_tokens"):
        frame[col] = pd.to_numeric(frame[col].replace("", None), errors="coerce").astype("Int64")
    frame["path"] = [str(folder / f) if f else "" for f in frame["file"]]
    return frame
