"""A profile in memory: :class:`Profile` holds the rows of the five tables (see :mod:`.schema`)
and the run's metadata, and gives each table as a typed DataFrame (:func:`typed`: the one place
a table's cells become its columns' dtypes)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from .schema import COLUMNS, TABLES

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
