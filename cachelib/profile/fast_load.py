"""The fast way to read a CSV profile: one typed parse and the checks done on whole columns.

pyarrow's CSV reader parses the file block by block, each column straight into its schema type
(:data:`.schema.DTYPES`); the checks of :mod:`.checks` then run on typed columns (ranges by
min/max, flags and grammars by set and RE2 match, NUL bytes, required cells), and each block's
rows go at once to their table's columns, so the file's text never lives whole. This reader only
ever says yes: at the first thing it cannot vouch for (a cell that does not parse as its type, a
value out of range, a non-finite number, a row of another length, an unknown table or column, a
metadata fault) it returns None, and :func:`~cachelib.profile.store.load_profile` reads the file
the exact way (:mod:`.checks`), which words the error (file, line and column). What it accepts,
the exact reader accepts too, into the same tables and dtypes (``tests/profile/test_fast_load.py``).
"""

from __future__ import annotations

import io
import itertools
import os
import re
from pathlib import Path
from typing import Iterator

import numpy as np
import pandas as pd

from ..core.reader import check_regular
from .checks import META_COLUMNS, _checked_meta, is_partial
from .frames import TABLE_NAMES, Profile
from .schema import ADDED_IN_V1, COLUMNS, DTYPES, LIMITS, PATTERNS, REQUIRED, TABLES

_BLANK = re.compile(rb"[\r\n]*")
BLOCK_BYTES = 4 << 20  # text parsed per block: what of the file's text is in memory at once
FLAG_TEXT = ("0", "1", "True", "False")  # the flags the exact reader accepts (:data:`.frames._FLAGS`)


def load_fast(source, label: str) -> Profile | None:
    """The profile in ``source`` (a CSV path or bytes), every cell checked, or None when the file
    needs the exact reader: pyarrow is missing, or anything is not as a cachelib writer writes it."""
    if not isinstance(source, (str, os.PathLike, bytes)) or is_partial(source):
        return None
    if isinstance(source, (str, os.PathLike)) and str(source).lower().endswith(".parquet"):
        return None
    try:
        import pyarrow  # noqa: F401
    except ImportError:  # pragma: no cover - pyarrow is a core dependency
        return None
    try:
        return _load(source, label)
    except Exception:  # a parse error, a bad cell, memory: the exact reader says what (or reads it)
        return None


def _load(source, label: str) -> Profile | None:
    if not isinstance(source, bytes):
        check_regular(source, "profile")  # a named pipe would hang the reader, a device never end
    scan = _counts(source)  # each table's rows, so its columns are made once at their full length
    if scan is None:
        return None
    counts, sizes = scan
    with _open(source) as file:
        return _read((file.read(size) for size in sizes), counts, source, label)


def _open(source):
    return io.BytesIO(source) if isinstance(source, bytes) else open(source, "rb")


def _pieces(file) -> Iterator[tuple[bytes, np.ndarray]]:
    """The file's bytes in pieces of about :data:`BLOCK_BYTES`, each ending at the end of a record
    (a newline outside quotes: a quoted cell may hold newlines), so each parses alone, with the
    offsets where its records start."""
    carry = b""
    while block := file.read(BLOCK_BYTES):
        data = carry + block
        raw = np.frombuffer(data, dtype=np.uint8)
        newlines = np.flatnonzero(raw == ord("\n"))
        outside = np.searchsorted(np.flatnonzero(raw == ord('"')), newlines) % 2 == 0  # each piece starts outside
        ends = newlines[outside]
        if not len(ends):
            carry = data
            continue
        cut = int(ends[-1]) + 1
        yield data[:cut], np.concatenate(([0], ends[:-1] + 1))
        carry = data[cut:]
    if carry:
        yield carry, np.zeros(1, dtype=np.int64)


def _counts(source) -> tuple[dict[str, int], list[int]] | None:
    """Rows of each table, from the first cell of each record (a byte scan), and the sizes of the
    pieces the file parses in; None when a record starts otherwise (a quoted or unknown table: the
    exact reader reads or names it)."""
    counts, header, sizes = dict.fromkeys(TABLES, 0), True, []
    with _open(source) as file:
        for piece, starts in _pieces(file):
            sizes.append(len(piece))
            raw = np.frombuffer(piece, dtype=np.uint8)
            if header:
                starts, header = starts[1:], False
            last = len(raw) - 1
            found = np.isin(raw[starts], (ord("\n"), ord("\r")))  # blank lines hold no record
            for table in TABLES:
                match = np.ones(len(starts), dtype=bool)
                for i, byte in enumerate(f"{table},".encode()):
                    match &= raw[np.minimum(starts + i, last)] == byte
                match &= starts + len(table) <= last
                counts[table] += int(match.sum())
                found |= match
            if not found.all():
                return None
    return counts, sizes


def _read(pieces: Iterator[bytes], counts: dict[str, int], source, label: str) -> Profile | None:
    import pyarrow as pa
    import pyarrow.csv as pacsv

    first = next(pieces, b"")
    end = first.find(b"\n") + 1
    header, first = first[:end], first[end:]
    if not end or b'"' in header:
        return None
    names = pacsv.read_csv(pa.BufferReader(header)).schema.names
    if len(set(names)) != len(names) or "table" not in names:
        return None
    if set(names) - set(COLUMNS) or set(COLUMNS) - set(names) - set(ADDED_IN_V1):
        return None  # another column set: the exact reader names what is missing or reads the extra ones
    # text as large_string: what pandas' "string" columns hold, so they take the chunks as they are
    kinds = {"int": pa.int64(), "float": pa.float64(), "bool": pa.string()}
    types = {c: kinds.get(k, pa.large_string()) for c, k in DTYPES.items()}
    types["table"] = pa.string()
    convert = pacsv.ConvertOptions(
        column_types=types, null_values=[""], strings_can_be_null=True, quoted_strings_can_be_null=True
    )
    # A piece without quotes has no newline inside a cell: the parser may skip that care (2x faster).
    parse = {q: pacsv.ParseOptions(newlines_in_values=q) for q in (False, True)}

    def batches():
        for piece in itertools.chain((first,), pieces):
            if not _BLANK.fullmatch(piece):  # blank lines hold no record (the exact reader skips them too)
                read = pacsv.ReadOptions(column_names=names, block_size=len(piece) + 1, use_threads=False)
                table = pacsv.read_csv(
                    pa.BufferReader(piece),
                    read_options=read,
                    parse_options=parse[b'"' in piece],
                    convert_options=convert,
                )
                yield from table.to_batches()

    columns = {t: {c: _Column(DTYPES[c], counts[t]) for c in TABLES[t] if c in names} for t in TABLE_NAMES}
    filled = dict.fromkeys(TABLE_NAMES, 0)
    metas, start = [], 0
    for batch in batches():
        cols = _checked_block(batch, names)
        if cols is None:
            return None
        tables, n = cols.pop("\0masks"), batch.num_rows
        rows = tables["meta"]
        if rows is not None:
            index = np.flatnonzero(rows.to_numpy(zero_copy_only=False)) + start
            metas.append(pd.DataFrame({c: cols[c].filter(rows).to_pylist() for c in META_COLUMNS}, index=index))
        picks = {
            t: np.flatnonzero(tables[t].to_numpy(zero_copy_only=False)) for t in TABLE_NAMES if tables[t] is not None
        }
        taken = {t: len(pick) for t, pick in picks.items()}
        if any(filled[t] + k > counts[t] for t, k in taken.items()):
            return None  # the byte scan and the parse disagree: the exact reader decides
        for c in {c for t in picks for c in columns[t]}:
            whole = _numpy_parts(cols.pop(c), DTYPES[c])
            for table, pick in picks.items():
                if c in columns[table]:
                    columns[table][c].put(whole, pick, filled[table], taken[table])
        for table, k in taken.items():
            filled[table] += k
        start += n
    if any(filled[t] != counts[t] for t in TABLE_NAMES):
        return None
    long_meta = pd.concat(metas) if metas else pd.DataFrame(columns=list(META_COLUMNS))
    meta = _checked_meta(long_meta, label, source)
    if "schema_version" not in meta:
        return None
    profile = Profile(meta)
    if not isinstance(source, bytes):
        profile.path = Path(source)
    for table, where in columns.items():
        profile._frames[table] = _frame(table, where, counts[table])
        profile._rows[table] = []
    return profile


def _checked_block(batch, names: list[str]) -> dict | None:
    """The block's columns (text unescaped) and, under ``"\\0masks"``, each table's rows (None
    where it has none); None at the first cell the exact reader might word or read otherwise."""
    import pyarrow as pa
    import pyarrow.compute as pc

    cols = {name: batch.column(i) for i, name in enumerate(names)}
    table = cols["table"]
    if table.null_count:
        return None
    masks, counted = {}, 0
    for t in TABLES:
        rows = pc.equal(table, t)
        k = pc.sum(rows).as_py() or 0
        masks[t] = rows if k else None
        counted += k
    if counted != batch.num_rows:
        return None  # a table the schema does not know: named by the exact reader
    for name, col in cols.items():
        kind = DTYPES.get(name, "str")
        if kind in ("str", "bool") and pc.any(pc.match_substring(col, "\x00")).as_py():
            return None
        if kind == "str" and name != "table":  # undo the writer's spreadsheet escaping
            escaped = pc.starts_with(col, "'")
            if pc.any(escaped).as_py():
                col = cols[name] = pc.if_else(escaped, pc.utf8_slice_codeunits(col, 1), col)
        if name in META_COLUMNS or col.null_count == len(col):
            continue
        if kind == "bool":
            if not pc.all(pc.is_in(pc.drop_null(col), value_set=pa.array(FLAG_TEXT))).as_py():
                return None
        elif kind == "str":
            pattern = PATTERNS.get(name)
            if pattern is not None and not pc.all(pc.match_substring_regex(col, f"^(?:{pattern[0]})$")).as_py():
                return None
        else:
            if kind == "float" and not pc.all(pc.is_finite(col)).as_py():
                return None  # NaN, inf: the exact reader decides (and words it)
            lo, hi = LIMITS.get(name, (None, None))
            span = pc.min_max(col)
            if (lo is not None and span["min"].as_py() < lo) or (hi is not None and span["max"].as_py() > hi):
                return None
    for t, required in REQUIRED.items():
        rows = masks[t]
        if rows is not None and any(pc.any(pc.and_(rows, pc.is_null(cols[c]))).as_py() for c in required):
            return None
    cols["\0masks"] = masks
    return cols


class _Column:
    """One table column filled block by block: numbers and flags into arrays made once at the
    table's length (values, missing), text as Arrow chunks."""

    def __init__(self, kind: str, rows: int):
        self.kind = kind
        self.chunks: list = []
        if kind != "str":
            self.values = np.empty(rows, dtype=np.float64 if kind == "float" else bool if kind == "bool" else np.int64)
            self.missing = np.empty(rows, dtype=bool)

    def put(self, whole, pick: np.ndarray, at: int, k: int) -> None:
        """Rows ``pick`` (indices) of a block's column, at row ``at`` of this one."""
        if self.kind == "str":
            self.chunks.append(whole.take(pick))
            return
        if whole is None:  # the column is empty in this block
            self.values[at : at + k] = 0
            self.missing[at : at + k] = True
            return
        np.take(whole[0], pick, out=self.values[at : at + k])
        np.take(whole[1], pick, out=self.missing[at : at + k])

    def typed(self):
        """The pandas column, with the dtype :func:`~cachelib.profile.frames._typed` gives."""
        import pyarrow as pa

        if self.kind == "str":
            chunks, self.chunks = self.chunks, []
            return pd.StringDtype().__from_arrow__(pa.chunked_array(chunks, pa.large_string()))
        values, missing = self.values, self.missing
        del self.values, self.missing
        if self.kind == "int":
            return pd.arrays.IntegerArray(values, missing)
        if self.kind == "bool":
            return pd.arrays.BooleanArray(values, missing)
        values[missing] = np.nan
        return values


def _numpy_parts(col, kind: str):
    """A block's column as its table columns take it: (values, missing) numpy arrays for numbers
    and flags (None when every cell is empty), Arrow text."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if kind == "str":
        return col
    if col.null_count == len(col):
        return None
    missing = col.is_null().to_numpy(zero_copy_only=False)
    if kind == "bool":
        values = pc.fill_null(pc.is_in(col, value_set=pa.array(["1", "True"])), False)
    else:
        values = pc.fill_null(col, 0 if kind == "int" else np.nan)
    return values.to_numpy(zero_copy_only=False), missing


def _frame(table: str, columns: dict[str, _Column], rows: int) -> pd.DataFrame:
    """``table``'s typed DataFrame; a column added within schema v1 that an older file lacks is empty."""
    out = {}
    for col, kind in TABLES[table].items():
        column = columns.pop(col, None)
        if column is None:
            column = _Column(kind, rows)
            if kind == "str":
                import pyarrow as pa

                column.chunks = [pa.nulls(rows, pa.large_string())]
            else:
                column.values[:] = 0
                column.missing[:] = True
        out[col] = column.typed()
    return pd.DataFrame(out, copy=False)  # the columns are this frame's own: no copy
