"""One table of a profile file at a time, for large profiles: the app reads the metadata and the
steps table first and each other table when a figure needs it.

A profile's five tables share one long CSV whose first cell says a row's table. :func:`read_table`
finds that table's records with a byte scan (records end at the newlines outside quoted cells),
parses only them and checks them as :func:`~cachelib.profile.load_profile` does, with errors
naming the file's own line. What it does not look at, it does not check: a bad cell of another
table shows when that table is read. Bytes, file objects and Parquet files are read whole.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pandas as pd

from .schema import COLUMNS, TABLES
from .store import TABLE_NAMES, _check_tables, _label, _read_long, _typed, is_partial


def read_table(source: str | os.PathLike | bytes | io.IOBase, table: str, name: str | None = None) -> pd.DataFrame:
    """The typed ``table`` of a profile (steps, layers, slots or masks), checked; a
    ``ValueError`` names the file, line and column of the first bad value."""
    if table not in TABLE_NAMES:
        raise ValueError(f"no profile table {table!r}; tables: {', '.join(TABLE_NAMES)}")
    label = _label(source, name)
    columns = ["table", *TABLES[table]]
    long = None
    if isinstance(source, (str, os.PathLike)) and not str(source).lower().endswith(".parquet"):
        long = _scanned(Path(source), table, label, columns)
    if long is None:  # read whole: the general reader, and its messages
        long = _read_long(source, label, columns)
        long = long[long["table"] == table]
    long = long.reindex(columns=COLUMNS)
    _check_tables(long, label, source)
    try:
        return _typed(long.reset_index(drop=True), table)
    except (ValueError, TypeError, OverflowError) as e:  # _check_tables let nothing through: a bug
        raise ValueError(f"{label}: table {table!r} has a value of the wrong type ({e})") from None


def _scanned(path: Path, table: str, label: str, columns: list[str]) -> pd.DataFrame | None:
    """The rows of ``table`` in the file, indexed by their data-row number in it; None where
    the scan cannot be trusted (NUL bytes, quoted table cells, rows it cannot parse), so the
    general reader reads the whole file and says what is wrong."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{label}: no such profile file") from None
    except OSError as e:
        raise ValueError(f"{label}: cannot read the file ({e.strerror})") from None
    if is_partial(path):  # a run may be cut off in the middle of a row: drop that row
        raw = raw[: raw.rfind(b"\n") + 1]
    if not raw or b"\x00" in raw:
        return None
    data = np.frombuffer(raw, dtype=np.uint8)
    newlines = np.flatnonzero(data == ord("\n"))
    quotes = np.flatnonzero(data == ord('"'))
    ends = newlines[np.searchsorted(quotes, newlines) % 2 == 0] + 1  # a quoted cell may hold newlines
    if not len(ends) or ends[-1] < len(raw):
        ends = np.append(ends, len(raw))
    starts = np.concatenate(([0], ends[:-1]))
    body_starts, body_ends = starts[1:], ends[1:]  # record 0 is the header
    first = data[np.minimum(body_starts, len(data) - 1)]
    if (first == ord('"')).any():
        return None
    wanted = np.ones(len(body_starts), dtype=bool)
    for i, byte in enumerate(f"{table},".encode()):
        at = body_starts + i
        wanted &= (at < len(data)) & (data[np.minimum(at, len(data) - 1)] == byte)
    rows = np.flatnonzero(wanted)
    text = raw[: ends[0]] + b"".join(raw[s:e] for s, e in zip(body_starts[rows], body_ends[rows]))
    try:
        long = _read_long(io.BytesIO(text), label, columns)
    except ValueError:
        return None
    if len(long) != len(rows):
        return None
    long.index = rows
    return long
