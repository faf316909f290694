"""A profile in memory and on disk.

:class:`Profile` holds the rows of the five tables (see :mod:`.schema`) and the run's metadata.
While a run goes, :class:`ProfileWriter` appends every row to ``.NAME.partial`` next to the
target and flushes each step; when the run ends, for whatever reason, the metadata (with the
status and reason) is appended and the file is renamed into place in one step, so a profile
file is either absent or readable. :func:`load_profile` reads CSV or Parquet back and refuses a
file with a missing column or another schema version, naming it; :func:`read_meta` reads
just the metadata the same way, and :func:`list_profiles` lists a folder's profiles.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import pandas as pd

from .schema import COLUMNS, DTYPES, META_REQUIRED, SCHEMA_VERSION, TABLES

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


def _typed(df: pd.DataFrame, table: str) -> pd.DataFrame:
    out = {}
    for col, kind in TABLES[table].items():
        s = df[col] if col in df else pd.Series([None] * len(df), dtype=object)
        if kind == "int":
            s = pd.to_numeric(s, errors="raise").astype("Int64")
        elif kind == "bool":
            s = s.map(lambda v: pd.NA if v is None or (isinstance(v, float) and math.isnan(v)) else bool(int(v)))
            s = s.astype("boolean")
        elif kind == "float":
            s = pd.to_numeric(s, errors="raise").astype("float64")
        else:
            s = s.astype("string")
        out[col] = s.reset_index(drop=True)
    return pd.DataFrame(out)


# --- writing --------------------------------------------------------------------------------


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float):
        return "" if math.isnan(value) else repr(value)
    return value


class ProfileWriter:
    """Streams a profile's rows to ``path`` as CSV; ``close`` makes the file appear atomically."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if self.path.suffix.lower() != ".csv":
            raise ValueError(f"profiles stream as CSV; got {str(self.path)!r} (use a .csv name)")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.partial = self.path.with_name(f".{self.path.name}.partial")
        self._file = open(self.partial, "w", newline="", encoding="utf-8")
        self._csv = csv.writer(self._file)
        self._csv.writerow(COLUMNS)

    def write(self, table: str, rows: Iterable[dict]) -> None:
        cols = COLUMNS
        for row in rows:
            self._csv.writerow([table if c == "table" else _cell(row.get(c)) for c in cols])

    def write_meta(self, meta: dict[str, Any]) -> None:
        self.write("meta", ({"key": k, "value": _meta_text(v)} for k, v in meta.items()))

    def flush(self) -> None:
        self._file.flush()

    def close(self, meta: dict[str, Any]) -> Path:
        """Append the final metadata and move the file into place."""
        self.write_meta(meta)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.partial, self.path)
        return self.path


def save_profile(profile: Profile, path: str | os.PathLike) -> Path:
    """Write a whole profile as CSV or (``.parquet``, with pyarrow installed) Parquet, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    if path.suffix.lower() == ".parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ValueError("writing Parquet needs pyarrow (pip install pyarrow); use a .csv name") from None
        long = profile.long_frame().astype({c: "string" for c in COLUMNS if DTYPES.get(c, "str") == "str"})
        long.to_parquet(tmp, index=False)
    elif path.suffix.lower() == ".csv":
        writer = ProfileWriter(path)
        for table in TABLE_NAMES:
            writer.write(table, profile.rows(table) or profile.frame(table).to_dict("records"))
        writer.close(profile.meta)
        return path
    else:
        raise ValueError(f"unknown profile format {path.suffix!r}; use .csv or .parquet")
    os.replace(tmp, path)
    return path


def load_profile(source: str | os.PathLike | bytes | io.IOBase, name: str | None = None) -> Profile:
    """Read a profile written by cachelib (CSV or Parquet; a path, bytes or a file object)."""
    label = _label(source, name)
    long = _read_long(source, label)
    meta = _checked_meta(long, label)
    unknown = set(long["table"].dropna()) - set(TABLES)
    if unknown:
        raise ValueError(f"{label}: unknown table(s) {', '.join(sorted(unknown))}; known: {', '.join(TABLES)}")
    profile = Profile(meta)
    if isinstance(source, (str, os.PathLike)):
        profile.path = Path(source)
    for table in TABLE_NAMES:
        part = long[long["table"] == table]
        try:
            frame = _typed(part.reset_index(drop=True), table)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{label}: table {table!r} has a value of the wrong type ({e})") from None
        profile._frames[table] = frame
        profile._rows[table] = []
    return profile


def read_meta(source: str | os.PathLike | bytes | io.IOBase, name: str | None = None) -> dict[str, str]:
    """A profile's metadata, checked as :func:`load_profile` checks it, without typing its
    tables (for listings). A run that never closed its file reads as ``incomplete``."""
    label = _label(source, name)
    return _checked_meta(_read_long(source, label, META_COLUMNS), label)


def _label(source, name: str | None) -> str:
    return name or (str(source) if isinstance(source, (str, os.PathLike)) else "uploaded file")


META_COLUMNS = ("table", "key", "value")  # the columns metadata rows fill


def _read_long(source, label: str, only: Sequence[str] | None = None) -> pd.DataFrame:
    """The file's one long table as text, with every column of the schema, or ``only`` those
    (faster: a listing reads the three the metadata rows fill)."""
    columns = COLUMNS if only is None else list(only)
    try:
        if isinstance(source, (str, os.PathLike)) and str(source).lower().endswith(".parquet"):
            long = pd.read_parquet(source, columns=None if only is None else columns)
        else:
            data = io.BytesIO(source) if isinstance(source, bytes) else source
            wanted = None if only is None else (lambda c: c in columns)
            long = pd.read_csv(data, dtype=str, keep_default_na=False, na_values=[""], usecols=wanted)
    except FileNotFoundError:
        raise ValueError(f"{label}: no such profile file") from None
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError, OSError) as e:
        raise ValueError(f"{label}: not a cachelib profile (cannot read it as a table: {e})") from None
    missing = [c for c in columns if c not in long.columns]
    if "table" not in long.columns:
        raise ValueError(f"{label}: not a cachelib profile (no 'table' column)")
    if missing:
        raise ValueError(f"{label}: profile is missing column(s) {', '.join(missing)} of schema v{SCHEMA_VERSION}")
    return long


def _checked_meta(long: pd.DataFrame, label: str) -> dict[str, str]:
    meta_rows = long[long["table"] == "meta"]
    # The closing rows come after the opening ones, so the final status and reason win.
    meta = {str(k): ("" if pd.isna(v) else str(v)) for k, v in zip(meta_rows["key"], meta_rows["value"])}
    version = meta.get("schema_version")
    if version is None:
        raise ValueError(f"{label}: profile has no schema_version")
    if str(version) != str(SCHEMA_VERSION):
        raise ValueError(f"{label}: profile schema version {version} is not supported; this cachelib reads version {SCHEMA_VERSION}")
    lacking = [k for k in META_REQUIRED if k not in meta]
    if lacking:
        raise ValueError(f"{label}: profile metadata lacks {', '.join(lacking)}")
    if meta["status"] == "running":
        meta["status"] = "incomplete"
        meta["reason"] = meta.get("reason") or "the run ended before it could close the profile"
    return meta


# --- a folder of profiles --------------------------------------------------------------------


@dataclass(frozen=True)
class ProfileFile:
    name: str  # "run.csv" or "sweep/run.csv"
    path: Path
    folder: str  # "" or the sweep folder

    @property
    def label(self) -> str:
        """How charts name this profile: "run" or "sweep/run"."""
        return self.name.removesuffix(".csv")


def list_profiles(folder: str | os.PathLike) -> list[ProfileFile]:
    """``FOLDER/*.csv`` and the runs of sweep folders ``FOLDER/*/*.csv`` (not their index), by
    name; hidden files (a run's ``.NAME.partial``) are left out."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    out = [ProfileFile(p.name, p, "") for p in sorted(folder.glob("*.csv")) if not p.name.startswith(".")]
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for p in sorted(sub.glob("*.csv")):
            if p.name != "index.csv" and not p.name.startswith("."):
                out.append(ProfileFile(f"{sub.name}/{p.name}", p, sub.name))
    return out
