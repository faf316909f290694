"""Reading a profile's text exactly and checking every cell: the reference path of
:func:`~cachelib.profile.store.load_profile`, and the one that words every error.

:func:`read_long` gives the file's one long table as text; :func:`check_tables` checks each
column's type and range (:data:`.schema.LIMITS`) and each table's required cells, raising one
``ValueError`` that names the file, line and column of the first bad value; :func:`checked_meta`
checks the metadata rows. The writer's spreadsheet escaping (a leading apostrophe) is undone here.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from ..core.reader import check_regular
from .frames import TABLE_NAMES, _typed
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
from .writer import _PARTIAL, partial_running


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
