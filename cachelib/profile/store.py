"""A profile in memory and on disk.

:class:`Profile` holds the rows of the five tables (see :mod:`.schema`) and the run's metadata.
While a run goes, :class:`ProfileWriter` appends every row to a hidden partial file of its own,
``.NAME.csv.RUNID.partial`` next to the target, holding a lock on it, and flushes each step; when
the run ends, for whatever reason, the metadata (with the status and reason) is appended and the
file is renamed into place in one step, so a profile file is either absent or readable. A run
never replaces what it did not write: an incomplete run leaves an existing ``NAME.csv`` alone and
closes into ``NAME.incomplete.csv`` instead, and a run whose target another run wrote while it
went closes into ``NAME.RUNID.csv`` (:meth:`ProfileWriter.close` returns where it went).

:func:`load_profile` reads CSV or Parquet back and checks every column's type and range, raising
one ``ValueError`` that names the file, line and column of the first bad value (or a missing
column, another schema version); :func:`read_meta` reads and checks just the metadata, and
:func:`list_profiles` lists a folder's profiles, partial files whose run ended without closing
them included.

Text cells a spreadsheet would run as a formula are written with a leading apostrophe and read
back without it (:mod:`cachelib.core.cells`), so a CSV profile is safe to open in a spreadsheet
and every value round-trips exactly. Parquet files keep text as is.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import pandas as pd

from ..core.cells import escape_cell
from ..core.reader import check_regular
from .outputs import a_or_an, check_out_path, name_max, os_error_at
from .schema import (
    ADDED_IN_V1,
    COLUMNS,
    DTYPES,
    LIMITS,
    META_REQUIRED,
    NONFINITE,
    PATTERNS,
    REQUIRED,
    SCHEMA_VERSION,
    STATUSES,
    TABLES,
)

try:  # POSIX: a running writer holds a lock on its partial file, so a listing can tell it from an orphan
    import fcntl
except ImportError:  # pragma: no cover - Windows: partial files read as "running or ended without closing"
    fcntl = None

TABLE_NAMES = tuple(t for t in TABLES if t != "meta")


class Profile:
    """Tables of one run. ``frame(name)`` gives a table as a typed DataFrame."""

    def __init__(self, meta: dict[str, Any] | None = None):
        self.meta: dict[str, Any] = dict(meta or {})
        self.path: Path | None = None  # the file it was written to or read from
        self._rows: dict[str, list[dict]] = {t: [] for t in TABLE_NAMES}
        self._frames: dict[str, pd.DataFrame] = {}

    # --- building -------------------------------------------------------------------------

    def add(self, table: str, rows: Iterable[dict]) -> list[dict]:
        rows = list(rows)
        self._rows[table].extend(rows)
        self._frames.pop(table, None)
        return rows

    def rows(self, table: str) -> list[dict]:
        return self._rows[table]

    # --- reading --------------------------------------------------------------------------

    def frame(self, table: str) -> pd.DataFrame:
        if table == "meta":
            return pd.DataFrame({"key": list(self.meta), "value": [_meta_text(v) for v in self.meta.values()]})
        if table not in self._frames:
            self._frames[table] = _typed(pd.DataFrame(self._rows[table], columns=list(TABLES[table])), table)
        return self._frames[table]

    @property
    def status(self) -> str:
        return str(self.meta.get("status", ""))

    @property
    def complete(self) -> bool:
        return self.status == "complete"

    @property
    def strategies(self) -> list[str]:
        value = self.meta.get("strategies", [])
        return json.loads(value) if isinstance(value, str) else list(value)

    @property
    def baseline(self) -> str:
        return str(self.meta.get("baseline", ""))

    @property
    def name(self) -> str:
        return str(self.meta.get("name", ""))

    def long_frame(self) -> pd.DataFrame:
        """All tables in the one long layout of the file format."""
        parts = [self.frame("meta").assign(table="meta")]
        parts += [self.frame(t).assign(table=t) for t in TABLE_NAMES]
        parts = [p for p in parts if len(p)]
        out = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=COLUMNS)
        return out.reindex(columns=COLUMNS)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Profile):
            return NotImplemented
        if {k: _meta_text(v) for k, v in self.meta.items()} != {k: _meta_text(v) for k, v in other.meta.items()}:
            return False
        return all(_frames_equal(self.frame(t), other.frame(t)) for t in TABLE_NAMES)


def _frames_equal(a: pd.DataFrame, b: pd.DataFrame) -> bool:
    if len(a) != len(b):
        return False
    if len(a) == 0:
        return True
    try:
        pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True), check_dtype=False)
    except AssertionError:
        return False
    return True


def _meta_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, dict, tuple, bool)) or value is None:
        return json.dumps(value)
    return str(value)


_FLAGS = {"0": False, "1": True, "False": False, "True": True}  # how a file writes a flag (CSV, Parquet)


def _typed(df: pd.DataFrame, table: str, parsed: dict | None = None, index=None) -> pd.DataFrame:
    """``df``'s cells as the table's typed columns; ``parsed``: number columns parsed already (by
    the rows of ``index``, the rows of ``df`` in the file)."""
    out = {}
    for col, kind in TABLES[table].items():
        if parsed is not None and col in parsed:
            out[col] = parsed[col].astype("Int64" if kind == "int" else "float64").reindex(index).reset_index(drop=True)
            continue
        s = df[col] if col in df else pd.Series([None] * len(df), dtype=object)
        if kind == "int":
            s = pd.to_numeric(s, errors="raise").astype("Int64")
        elif kind == "bool":
            s = s.map(
                lambda v: (
                    pd.NA
                    if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v))
                    else _FLAGS.get(v, v)
                    if isinstance(v, str)
                    else bool(v)
                )
            )
            s = s.astype("boolean")
        elif kind == "float":
            s = pd.to_numeric(s, errors="raise").astype("float64")
        else:
            s = s.astype("string")
        out[col] = s.reset_index(drop=True)
    return pd.DataFrame(out)


# --- writing --------------------------------------------------------------------------------


def _cell(value: Any) -> Any:
    if value is None or value is pd.NA:
        return ""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float):
        return "" if math.isnan(value) else repr(value)
    return escape_cell(value)


PARTIAL_SUFFIX = ".partial"
_PARTIAL = re.compile(r"^\.(?P<target>.+)\.(?P<run_id>[0-9a-f]{12})\.partial$")  # .NAME.csv.RUNID.partial
_name_max = name_max


def _fitted(folder: Path, stem: str, suffix: str) -> str:
    """``stem + suffix``, the stem shortened until the name fits the folder's name limit."""
    limit = _name_max(folder)
    while stem and len(os.fsencode(stem + suffix)) > limit:
        stem = stem[:-1]
    return stem + suffix


def check_profile_path(path: str | os.PathLike) -> Path:
    """``path`` as a place a profile can be written: a ``.csv`` name that is not a folder, fits
    the file system's name limit, in a folder that exists or can be made, where no file of
    another kind stands (:func:`~cachelib.profile.outputs.check_out_path`). Raises ValueError
    (the name) or OSError (the file system says no), both naming the path, before any work."""
    return check_out_path(path, what="profile", suffixes=(".csv",), replaces=("profile",))


def partial_running(path: str | os.PathLike) -> bool | None:
    """Whether the run writing the partial file ``path`` is still going (it holds the file's
    lock); False when its run ended without closing it; None where that cannot be told."""
    if fcntl is None:
        return None
    try:
        with open(path, "rb") as fh:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
    except OSError:
        return None
    return False


@contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """Closing writers of one folder take turns, so that two cannot both claim a target."""
    fd = None
    if fcntl is not None:
        try:
            fd = os.open(folder, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _identity(path: Path) -> tuple | None:
    try:
        s = path.stat()
    except FileNotFoundError:
        return None
    return (s.st_dev, s.st_ino, s.st_mtime_ns, s.st_size)


class ProfileWriter:
    """Streams a profile's rows as CSV into a partial file of this run's own; :meth:`close` moves
    it into place in one step. Opening checks the path (:func:`check_profile_path`) and creates
    the partial file, so a path that cannot be written fails here, before any work.

    The same machinery streams any CSV of rows (``columns``, ``what``, ``check``: an evaluation
    file, :mod:`cachelib.profile.evaluate`): :meth:`write_row`, then :meth:`finish`. A write the
    file system refuses (disk full) is an ``OSError`` naming the user's path; :meth:`salvage`
    then keeps the rows flushed so far, in the file an incomplete run closes into."""

    def __init__(
        self,
        path: str | os.PathLike,
        run_id: str | None = None,
        *,
        columns: Sequence[str] = COLUMNS,
        what: str = "profile",
        check=check_profile_path,
        incomplete_aside: bool = False,
    ):
        self.path = check(path)
        self.what = what
        self.incomplete_aside = incomplete_aside  # an incomplete run never closes into NAME.csv, even a new one
        self.run_id = run_id if run_id and re.fullmatch(r"[0-9a-f]{12}", run_id) else uuid.uuid4().hex[:12]
        self._before = _identity(self.path)  # the file a complete run may replace: the one there now
        stem = f".{self.path.name}"
        self.partial = self.path.with_name(_fitted(self.path.parent, stem, f".{self.run_id}{PARTIAL_SUFFIX}"))
        try:
            self._file = open(self.partial, "x", newline="", encoding="utf-8")
        except OSError as e:
            raise type(e)(e.errno, f"cannot write {a_or_an(what)} here ({e.strerror})", str(self.path)) from None
        if fcntl is not None:
            try:
                fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # a file system without locks: listings cannot tell running from ended
                pass
        self._eol = "\n" if what != "profile" else "\r\n"
        self._csv = csv.writer(self._file, lineterminator=self._eol)
        self._good = 0  # bytes on disk up to the last whole row flushed: what survives a full disk
        self.write_row(list(columns))
        self.flush()

    def _io(self, op, *args):
        try:
            return op(*args)
        except OSError as e:  # disk full, a quota, a file size limit: the user's path, not the hidden file
            raise os_error_at(e, self.path, f"cannot write the {self.what}") from None

    def write_row(self, cells: Sequence[Any]) -> None:
        self._io(self._csv.writerow, cells)

    def write(self, table: str, rows: Iterable[dict]) -> None:
        cols = COLUMNS
        for row in rows:
            self.write_row([table if c == "table" else _cell(row.get(c)) for c in cols])

    def write_meta(self, meta: dict[str, Any]) -> None:
        self.write("meta", ({"key": k, "value": _meta_text(v)} for k, v in meta.items()))

    def flush(self) -> None:
        self._io(self._file.flush)
        self._good = self._file.tell()

    def close(self, meta: dict[str, Any]) -> Path:
        """Append the final metadata and move the file into place; returns where it went: the
        target, or next to it when this run must not replace what is there (see the module)."""
        complete = str(meta.get("status", "")) == "complete"
        try:
            self.write_meta(meta)
            return self.finish(complete)
        except OSError:
            self.salvage(lambda: self.write_meta(meta | {"status": "incomplete", "reason": _DISK_REASON}))
            raise

    def finish(self, complete: bool) -> Path:
        """Move the file into place (after flushing it to disk); returns where it went."""
        self.flush()
        self._io(os.fsync, self._file.fileno())
        self._file.close()
        with _folder_lock(self.path.parent):
            dest = self._destination(complete)
            self._io(os.replace, self.partial, dest)
        self.kept = dest
        return dest

    def salvage(self, closing=None) -> Path | None:
        """After a write failed: cut the file back to its last whole row, append ``closing``'s rows
        if they fit, and close it where an incomplete run goes; None (and no file left) when even
        that fails. ``kept`` says where the rows went."""
        self.kept = None
        try:
            _close_quietly(self._file)  # what its buffer still held may land in part: cut below
            _cut(self.partial, self._good)
            if closing is not None:
                self._file = open(self.partial, "a", newline="", encoding="utf-8")
                self._csv = csv.writer(self._file, lineterminator=self._eol)
                try:
                    closing()
                    self.flush()
                except OSError:
                    pass
                _close_quietly(self._file)
                _cut(self.partial, self._good)
            with _folder_lock(self.path.parent):
                dest = self._destination(False)
                os.replace(self.partial, dest)
            self.kept = dest
        except OSError:
            self.discard()
        return self.kept

    def discard(self) -> None:
        """Remove the partial file: the run ended before it recorded anything worth keeping."""
        if not self._file.closed:
            try:
                self._file.close()
            except OSError:  # the buffer could not be written out (disk full): the file goes anyway
                pass
        self.partial.unlink(missing_ok=True)

    def _destination(self, complete: bool) -> Path:
        now = _identity(self.path)
        if (now is None and (complete or not self.incomplete_aside)) or (complete and now == self._before):
            return self.path
        # An incomplete run never replaces a profile; a complete one does not replace a profile
        # another run wrote while it went. Either closes next to the target, under its own name.
        stem, folder = self.path.name[: -len(self.path.suffix)], self.path.parent
        names = [] if complete else [_fitted(folder, stem, ".incomplete.csv")]
        names.append(_fitted(folder, stem, f".{self.run_id}" + ("" if complete else ".incomplete") + ".csv"))
        for name in names:
            if not (folder / name).exists():
                return folder / name
        return folder / names[-1]


_DISK_REASON = "the file system refused a write (disk full?)"


def _close_quietly(file) -> None:
    try:
        file.close()
    except OSError:  # its buffer could not be written out: the file is closed anyway
        pass


def _cut(path: Path, size: int) -> None:
    """Truncate ``path`` to ``size`` bytes (a row cut off by a failed write goes)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def save_profile(profile: Profile, path: str | os.PathLike) -> Path:
    """Write a whole profile as CSV or (``.parquet``, with pyarrow installed) Parquet, atomically;
    returns the path written (for CSV, see :meth:`ProfileWriter.close`)."""
    path = Path(path)
    if path.suffix.lower() == ".parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ValueError("writing Parquet needs pyarrow (pip install pyarrow); use a .csv name") from None
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
        long = profile.long_frame().astype({c: "string" for c in COLUMNS if DTYPES.get(c, "str") == "str"})
        long.to_parquet(tmp, index=False)
        os.replace(tmp, path)
        return path
    if path.suffix.lower() == ".csv":
        writer = ProfileWriter(path)
        for table in TABLE_NAMES:
            writer.write(table, profile.rows(table) or profile.frame(table).to_dict("records"))
        return writer.close(profile.meta)
    raise ValueError(f"unknown profile format {path.suffix!r}; use .csv or .parquet")


def load_profile(source: str | os.PathLike | bytes | io.IOBase, name: str | None = None) -> Profile:
    """Read a profile written by cachelib (CSV or Parquet; a path, bytes or a file object).
    Anything malformed is one ``ValueError`` naming the file, the line and the column."""
    label = _label(source, name)
    if _large_csv(source):
        return _load_large(source, label)
    long = _read_long(source, label)
    meta = _checked_meta(long, label, source)
    if "schema_version" not in meta:  # a partial file whose run recorded nothing yet
        raise ValueError(f"{label}: {meta['status']}: {meta['reason']}; nothing to load")
    unknown = set(long["table"].dropna()) - set(TABLES)
    if unknown:
        raise ValueError(f"{label}: unknown table(s) {', '.join(sorted(unknown))}; known: {', '.join(TABLES)}")
    parsed: dict[str, pd.Series] = {}
    _check_tables(long, label, source, parsed)
    profile = Profile(meta)
    if isinstance(source, (str, os.PathLike)):
        profile.path = Path(source)
    for table, frame in _tables_of(long, parsed, label).items():
        profile._frames[table] = frame
        profile._rows[table] = []
    return profile


def _tables_of(long: pd.DataFrame, parsed: dict, label: str) -> dict[str, pd.DataFrame]:
    """Each table's typed frame: its own rows and columns only, its numbers from the check's parse."""
    out = {}
    tables = long["table"]
    for table in TABLE_NAMES:
        rows = (tables == table).to_numpy()
        text_cols = [c for c in TABLES[table] if c in long.columns and c not in parsed]
        part = long.loc[rows, text_cols]
        try:
            out[table] = _typed(part.reset_index(drop=True), table, parsed, part.index)
        except (ValueError, TypeError, OverflowError) as e:  # _check_tables let nothing through: a bug
            raise ValueError(f"{label}: table {table!r} has a value of the wrong type ({e})") from None
    return out


LARGE_BYTES = 16_000_000  # a CSV profile this large is read in chunks of CHUNK_ROWS rows
CHUNK_ROWS = 100_000


def _large_csv(source) -> bool:
    if not isinstance(source, (str, os.PathLike)) or is_partial(source) or str(source).lower().endswith(".parquet"):
        return False
    try:
        return os.path.getsize(source) >= LARGE_BYTES
    except OSError:
        return False


def _load_large(source, label: str) -> Profile:
    """:func:`load_profile` of a large CSV file in bounded memory: read in chunks, each checked
    and split into its tables' typed rows at once (a chunk's text never outlives it). The same
    checks in the same order (metadata, unknown tables, then the tables' cells)."""
    check_regular(source, "profile")
    metas, parts, seen, error = [], {t: [] for t in TABLE_NAMES}, set(), None
    try:
        chunks = pd.read_csv(source, dtype=str, keep_default_na=False, na_values=[""], chunksize=CHUNK_ROWS)
        for chunk in chunks:
            chunk = _cleaned(chunk, label, source, COLUMNS, False)
            metas.append(chunk.loc[(chunk["table"] == "meta").to_numpy(), list(META_COLUMNS)])
            seen |= set(chunk["table"].dropna())
            if error is None:
                try:
                    parsed: dict[str, pd.Series] = {}
                    _check_tables(chunk, label, source, parsed)
                    for table, frame in _tables_of(chunk, parsed, label).items():
                        parts[table].append(frame)
                except ValueError as e:  # raised once the metadata (read to the end) is checked
                    error, parts = e, {}
    except pd.errors.EmptyDataError:
        raise ValueError(f"{label}: not a cachelib profile (the file is empty)") from None
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{label}: not a cachelib profile (not UTF-8 text: byte {e.object[e.start : e.start + 1]!r} at "
            f"offset {e.start})"
        ) from None
    except (pd.errors.ParserError, OSError) as e:
        raise ValueError(f"{label}: not a cachelib profile (cannot read it as a table: {e})") from None
    meta = _checked_meta(pd.concat(metas), label, source)
    if "schema_version" not in meta:
        raise ValueError(f"{label}: {meta['status']}: {meta['reason']}; nothing to load")
    unknown = seen - set(TABLES)
    if unknown:
        raise ValueError(f"{label}: unknown table(s) {', '.join(sorted(unknown))}; known: {', '.join(TABLES)}")
    if error is not None:
        raise error
    profile = Profile(meta)
    profile.path = Path(source)
    for table in TABLE_NAMES:
        frames = parts[table]
        profile._frames[table] = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
        parts[table] = None  # each table's chunks go as soon as they are joined
        profile._rows[table] = []
    return profile


def read_meta(source: str | os.PathLike | bytes | io.IOBase, name: str | None = None) -> dict[str, str]:
    """A profile's metadata, checked as :func:`load_profile` checks it, without reading its
    tables (for listings). A run that ended without closing its file reads as ``incomplete``;
    the partial file of a run still going reads as ``running``."""
    label = _label(source, name)
    return _checked_meta(_read_long(source, label, META_COLUMNS), label, source)


def _label(source, name: str | None) -> str:
    return name or (str(source) if isinstance(source, (str, os.PathLike)) else "uploaded file")


META_COLUMNS = ("table", "key", "value")  # the columns metadata rows fill


def is_partial(source) -> bool:
    """Whether ``source`` is the path of a run's partial file (``.NAME.csv.RUNID.partial``)."""
    return isinstance(source, (str, os.PathLike)) and _PARTIAL.match(Path(source).name) is not None


def _read_long(source, label: str, only: Sequence[str] | None = None) -> pd.DataFrame:
    """The file's one long table as text, with every column of the schema, or ``only`` those
    (faster: a listing reads the three the metadata rows fill)."""
    columns = COLUMNS if only is None else list(only)
    parquet = isinstance(source, (str, os.PathLike)) and str(source).lower().endswith(".parquet")
    try:
        if isinstance(source, (str, os.PathLike)):
            check_regular(source, "profile")  # a named pipe would hang the reader, a device never end
        if parquet:
            long = _as_text(pd.read_parquet(source, columns=None if only is None else columns))
        else:
            data = io.BytesIO(source) if isinstance(source, bytes) else source
            if is_partial(source):  # a run may be cut off in the middle of a row: drop that row
                raw = Path(source).read_bytes()
                data = io.BytesIO(raw[: raw.rfind(b"\n") + 1])
            wanted = None if only is None else (lambda c: c in columns)
            long = pd.read_csv(data, dtype=str, keep_default_na=False, na_values=[""], usecols=wanted)
    except FileNotFoundError:
        raise ValueError(f"{label}: no such profile file") from None
    except pd.errors.EmptyDataError:
        raise ValueError(f"{label}: not a cachelib profile (the file is empty)") from None
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{label}: not a cachelib profile (not UTF-8 text: byte {e.object[e.start : e.start + 1]!r} at "
            f"offset {e.start})"
        ) from None
    except (pd.errors.ParserError, ValueError, OSError) as e:
        raise ValueError(f"{label}: not a cachelib profile (cannot read it as a table: {e})") from None
    return _cleaned(long, label, source, columns, parquet)


def _cleaned(long: pd.DataFrame, label: str, source, columns: Sequence[str], parquet: bool) -> pd.DataFrame:
    """``long`` (text as read) with the columns of the schema checked, no NUL byte, and the
    writer's spreadsheet escaping undone."""
    for col in ADDED_IN_V1:
        if col in columns and col not in long.columns:
            long[col] = pd.NA
    missing = [c for c in columns if c not in long.columns]
    if "table" not in long.columns:
        raise ValueError(f"{label}: not a cachelib profile (no 'table' column)")
    if missing:
        raise ValueError(f"{label}: profile is missing column(s) {', '.join(missing)} of schema v{SCHEMA_VERSION}")
    for col in long.columns:
        text = long[col]
        nul = text.str.contains("\x00", regex=False, na=False)
        if nul.any():
            raise _bad(label, source, int(nul.idxmax()), col, "holds a NUL byte (a binary file, not a profile)")
        if not parquet and DTYPES.get(col, "str") == "str":  # undo the writer's spreadsheet escaping
            escaped = text.str.startswith("'", na=False)
            if escaped.any():
                long[col] = text.where(~escaped, text.str[1:])
    return long


def _as_text(frame: pd.DataFrame) -> pd.DataFrame:
    """A Parquet file's typed columns as the text a CSV would hold (None where empty)."""
    out = {}
    for col in frame.columns:
        s = frame[col]
        if pd.api.types.is_bool_dtype(s.dtype):
            s = s.map(lambda v: None if v is pd.NA or v is None else str(int(v)), na_action="ignore")
        elif pd.api.types.is_float_dtype(s.dtype):
            s = s.map(lambda v: None if v != v else repr(float(v)))
        out[col] = s.astype(object).where(s.notna(), None).map(lambda v: v if v is None else str(v))
    return pd.DataFrame(out, index=frame.index)


def _bad(label: str, source, index: int, column: str, problem: str) -> ValueError:
    return ValueError(f"{label}, {_where(source, index)}, column {column!r}: {problem}")


def _where(source, index: int) -> str:
    """ "line N" of the ``index``-th data row (quoted cells may span lines), or "row N"."""
    try:
        if isinstance(source, (str, os.PathLike)) and not str(source).lower().endswith(".parquet"):
            text = io.StringIO(Path(source).read_text(encoding="utf-8", errors="replace"), newline="")
        elif isinstance(source, bytes):
            text = io.StringIO(source.decode("utf-8", errors="replace"), newline="")
        else:
            raise TypeError
        reader = csv.reader(text)
        line = 0
        for k, _ in enumerate(reader):
            if k == index + 1:  # record 0 is the header
                return f"line {line + 1}"
            line = reader.line_num
    except Exception:  # the location is a courtesy: a source we cannot reread gives the row
        pass
    return f"row {index + 1}"


INT64 = (-(2**63), 2**63 - 1)


def _ints(s: pd.Series, label: str, source, col: str) -> pd.Series:
    """The integers of text column ``s`` (empty cells left out); ValueError at the first that is not one."""
    vals = s.dropna()
    fast = pd.to_numeric(vals, errors="coerce")
    if fast.dtype == "int64":  # every cell an integer that fits: the common case, without a regex
        return fast
    ok = vals.str.fullmatch(r"[+-]?\d+")
    if not ok.all():
        i = ok.index[~ok.to_numpy()][0]
        raise _bad(label, source, i, col, f"{vals[i]!r} is not an integer")
    for i, v in vals[vals.str.len() > 18].items():
        if not INT64[0] <= int(v) <= INT64[1]:
            raise _bad(label, source, i, col, f"{v} does not fit a 64-bit integer")
    return pd.to_numeric(vals).astype("int64")


def _check_tables(long: pd.DataFrame, label: str, source, parsed: dict | None = None) -> None:
    """Every cell of the tables has its column's type and lies in its range (:data:`.schema.LIMITS`),
    and every row has its table's required cells (:data:`.schema.REQUIRED`). ``parsed`` gets each
    number column's values (the non-empty cells, by row), so the tables are not parsed twice."""
    for col in COLUMNS:  # the meta rows leave these columns empty: checking every row is checking the tables
        kind = DTYPES.get(col, "str")
        if col in META_COLUMNS:
            continue
        s = long[col]
        if not s.notna().any():
            continue
        if kind == "int":
            nums = _ints(s, label, source, col)
        elif kind == "float":
            vals = s.dropna()
            nums = pd.to_numeric(vals, errors="coerce")
            bad = nums.isna()
            if bad.any():
                i = bad.idxmax()
                raise _bad(label, source, i, col, f"{vals[i]!r} is not a number")
            allowed = NONFINITE.get(col, ())
            bad = ~np.isfinite(nums.to_numpy()) & ~nums.isin(allowed).to_numpy()
            if bad.any():
                i = nums.index[bad][0]
                raise _bad(label, source, i, col, f"{vals[i]} is not a finite number")
        elif kind == "bool":
            vals = s.dropna()
            bad = ~vals.isin(("0", "1", "True", "False"))
            if bad.any():
                i = bad.idxmax()
                raise _bad(label, source, i, col, f"{vals[i]!r} is not a flag (0 or 1)")
            continue
        else:
            pattern = PATTERNS.get(col)
            if pattern is not None:
                vals = s.dropna()
                bad = ~vals.str.fullmatch(pattern[0])
                if bad.any():
                    i = bad.idxmax()
                    raise _bad(label, source, i, col, f"{_short(vals[i])} is not {pattern[1]}")
            continue
        if parsed is not None:
            parsed[col] = nums
        lo, hi = LIMITS.get(col, (None, None))
        for out, allowed in (
            (None if lo is None else nums < lo, f">= {lo}"),
            (None if hi is None else nums > hi, f"<= {hi}"),
        ):
            if out is not None and out.any():
                i = out.idxmax()
                raise _bad(label, source, i, col, f"{s[i]} is out of range ({col} must be {allowed})")
    tables = long["table"]
    for table, required in REQUIRED.items():
        rows = tables == table
        for col in required:
            empty = rows & long[col].isna()
            if empty.any():
                raise _bad(label, source, empty.idxmax(), col, f"is empty; every {table} row has one")


def _short(value: str, limit: int = 40) -> str:
    return repr(value if len(value) <= limit else value[:limit] + "…")


def _checked_meta(long: pd.DataFrame, label: str, source=None) -> dict[str, str]:
    meta_rows = long[long["table"] == "meta"]
    # The closing rows come after the opening ones, so the final status and reason win.
    meta = {str(k): ("" if pd.isna(v) else str(v)) for k, v in zip(meta_rows["key"], meta_rows["value"])}
    where = {str(k): i for k, i in zip(meta_rows["key"], meta_rows.index)}  # key -> its last row
    partial = is_partial(source)
    running = partial_running(source) if partial else False
    if not meta and partial:  # a run that has not written its metadata yet, or never did
        if running:
            return {"status": "running", "reason": "starting (loading the model)"}
        return {"status": "incomplete", "reason": f"{ENDED_WITHOUT_CLOSING} before it recorded anything"}
    version = meta.get("schema_version")
    if version is None:
        raise ValueError(f"{label}: profile has no schema_version")
    if str(version) != str(SCHEMA_VERSION):
        raise ValueError(
            f"{label}: profile schema version {version} is not supported; this cachelib reads version {SCHEMA_VERSION}"
        )
    lacking = [k for k in META_REQUIRED if k not in meta]
    if lacking:
        raise ValueError(f"{label}: profile metadata lacks {', '.join(lacking)}")

    def bad(key: str, problem: str) -> ValueError:
        return ValueError(f"{label}, {_where(source, where[key])}, meta {key!r}: {problem}")

    if meta["status"] not in STATUSES:
        raise bad("status", f"{_short(meta['status'])} is not one of {', '.join(STATUSES)}")
    for key in ("strategies", "specs"):
        if key not in meta:
            continue
        try:
            value = json.loads(meta[key])
        except ValueError:
            value = None
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise bad(key, f"{_short(meta[key])} is not a JSON list of strategy names")
        # Strategy names are unique (a run refuses a repeated strategy; files of older versions
        # named a copy "spec#2"); "specs" may repeat a spec text only as such a labelled copy.
        repeated = next((v for v in value if value.count(v) > 1), None)
        if repeated is not None and key == "strategies":
            raise bad(
                key, f"{_short(meta[key])} names the strategy {repeated!r} twice; each strategy needs its own name"
            )
    if "specs" in meta and len(json.loads(meta["specs"])) != len(json.loads(meta["strategies"])):
        raise bad(
            "specs", f"{_short(meta['specs'])} does not give one spec per strategy of {_short(meta['strategies'])}"
        )
    if meta["baseline"] not in json.loads(meta["strategies"]):
        raise bad("baseline", f"{_short(meta['baseline'])} is not one of the run's strategies")
    if meta.get("probes"):
        try:
            probes = json.loads(meta["probes"])
        except ValueError:
            probes = None
        if not isinstance(probes, dict):
            raise bad("probes", f"{_short(meta['probes'])} is not a JSON object of probe periods")
    for key in META_INTS:
        text = meta.get(key, "")
        if text == "":
            continue
        if not re.fullmatch(r"\d+", text) or int(text) > INT64[1]:
            raise bad(key, f"{_short(text)} is not a whole number >= 0")
    if meta["status"] == "running":
        if running:
            meta["reason"] = ""
        else:
            meta["status"] = "incomplete"
            meta["reason"] = meta.get("reason") or (
                f"{ENDED_WITHOUT_CLOSING}"
                if running is False
                else "running, or ended without closing (cannot tell here)"
            )
    return meta


ENDED_WITHOUT_CLOSING = "ended without closing: the run stopped (killed, or the machine went down)"
META_INTS = (
    "schema_version",
    "steps_completed",
    "max_tokens",
    "prompt_tokens",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "memory_limit",
)


# --- a folder of profiles --------------------------------------------------------------------


@dataclass(frozen=True)
class ProfileFile:
    name: str  # "run.csv" or "sweep/run.csv" (a partial file: ".run.csv.RUNID.partial")
    path: Path
    folder: str  # "" or the sweep folder
    partial: bool = False  # a run's partial file: still running, or ended without closing it

    @property
    def label(self) -> str:
        """How charts name this profile: "run" or "sweep/run" ("run.RUNID.partial" for a partial file)."""
        m = _PARTIAL.match(self.path.name)
        if self.partial and m:
            stem = m["target"].removesuffix(".csv") + f".{m['run_id']}.partial"
            return f"{self.folder}/{stem}" if self.folder else stem
        return self.name.removesuffix(".csv")


def meta_list(text: str) -> list[str]:
    """A list-valued metadata cell (``strategies``, ``specs``: JSON lists) as strings; a cell that
    is not JSON is one item."""
    try:
        value = json.loads(text)
    except ValueError:
        return [text] if text else []
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def _sweep_index(path: Path) -> bool:
    """Whether ``path`` is a sweep's ``index.csv`` (by its header), which no listing calls a profile."""
    from .outputs import existing_kind

    try:
        return existing_kind(path) == "sweep index"
    except OSError:
        return False


def list_profiles(folder: str | os.PathLike) -> list[ProfileFile]:
    """``FOLDER/*.csv`` and the runs of sweep folders ``FOLDER/*/*.csv`` (not their index), by
    name, each folder's partial files (``.NAME.csv.RUNID.partial``: a run still going, or one
    that ended without closing its file) after its profiles; other hidden files are left out."""
    folder = Path(folder)
    if not folder.is_dir():
        return []

    def files(where: Path, prefix: str) -> list[ProfileFile]:
        try:
            names = sorted(p.name for p in where.iterdir() if p.is_file())
        except OSError:  # a folder we may not read lists nothing
            return []
        out = [
            ProfileFile(prefix + n, where / n, prefix.rstrip("/"))
            for n in names
            if n.endswith(".csv") and not n.startswith(".") and not (n == "index.csv" and _sweep_index(where / n))
        ]
        out += [
            ProfileFile(prefix + n, where / n, prefix.rstrip("/"), partial=True) for n in names if _PARTIAL.match(n)
        ]
        return out

    out = files(folder, "")
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        out += files(sub, f"{sub.name}/")
    return out
