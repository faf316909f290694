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

The pieces live in their own modules, their names importable from here: :mod:`.frames` (the
profile in memory), :mod:`.writer` (writing), :mod:`.checks` (the exact reader and every check,
which words every error), :mod:`.fast_load` (a typed pyarrow parse with the checks on whole
columns: a CSV cachelib wrote loads there; anything it cannot vouch for goes to the exact reader)
and :mod:`.listing` (a folder's profiles).
"""

from __future__ import annotations

import io
import os
import uuid
from pathlib import Path

import pandas as pd

from ..core.reader import check_regular
from .checks import (  # noqa: F401 - the reader's names, importable from here as before
    ENDED_WITHOUT_CLOSING,
    INT64,
    META_COLUMNS,
    META_INTS,
    _as_text,
    _bad,
    _check_tables,
    _checked_meta,
    _cleaned,
    _label,
    _read_long,
    _short,
    _tables_of,
    _where,
    is_partial,
)
from .fast_load import load_fast
from .frames import TABLE_NAMES, Profile, _frames_equal, _meta_text, _typed  # noqa: F401
from .listing import ProfileFile, list_profiles, meta_list  # noqa: F401
from .schema import COLUMNS, DTYPES, TABLES
from .writer import (  # noqa: F401
    _DISK_REASON,
    _PARTIAL,
    PARTIAL_SUFFIX,
    ProfileWriter,
    _cell,
    _folder_lock,
    check_profile_path,
    partial_running,
)


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
    fast = load_fast(source, label)
    if fast is not None:
        return fast
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
