"""Writing a profile (or any CSV of rows) so that a file is either absent or readable.

While a run goes, :class:`ProfileWriter` appends every row to a hidden partial file of its own,
``.NAME.csv.RUNID.partial`` next to the target, holding a lock on it, and flushes each step; when
the run ends, for whatever reason, the metadata (with the status and reason) is appended and the
file is renamed into place in one step. A run never replaces what it did not write: an
incomplete run leaves an existing ``NAME.csv`` alone and closes into ``NAME.incomplete.csv``
instead, and a run whose target another run wrote while it went closes into ``NAME.RUNID.csv``
(:meth:`ProfileWriter.close` returns where it went). Text cells a spreadsheet would run as a
formula are written with a leading apostrophe (:mod:`cachelib.core.cells`).
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
import uuid
from contextlib import contextmanager
from functools import lru_cache
from itertools import groupby
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import pandas as pd

from ..core.cells import TRIGGERS, escape_cell
from .frames import _meta_text
from .outputs import a_or_an, check_out_path, name_max, os_error_at
from .schema import COLUMNS

try:  # POSIX: a running writer holds a lock on its partial file, so a listing can tell it from an orphan
    import fcntl
except ImportError:  # pragma: no cover - Windows: partial files read as "running or ended without closing"
    fcntl = None


def _cell(value: Any) -> Any:
    if value is None or value is pd.NA:
        return ""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float):
        return "" if math.isnan(value) else repr(value)
    return escape_cell(value)


# --- a profile's rows as CSV lines, a column at a time -----------------------------------------
# What csv.writer writes for the cells _cell makes, built without a call per cell: a run of rows
# with the same keys (a strategy's layers, a step's slots) is turned into columns; a column with
# one value (the strategy, the step, a layer kind) goes into the run's line format as text, and
# the others are made cells by their type at once (ints as they are). Text that csv would quote
# is quoted by csv itself.

_POSITION = {c: i for i, c in enumerate(COLUMNS) if c != "table"}  # a row's "table" key is not a cell
_SPECIAL = re.compile(r'[,"\r\n]')  # what makes csv quote a field (delimiter, quote, line ends)
_ESCAPED_START = TRIGGERS + ("'",)  # text escape_cell may change
_NONE = type(None)
_CONSTANT_TYPES = (int, str, bool, _NONE)  # equal values of one of these types are one cell text


@lru_cache(maxsize=4096)
def _csv_field(text: str, eol: str) -> str:
    """``text`` as csv.writer writes it, quoted where it must be."""
    out = io.StringIO()
    csv.writer(out, lineterminator=eol).writerow([text, ""])
    return out.getvalue()[: -len(eol) - 1]


def _text_cell(value: str, eol: str) -> str:
    if value.startswith(_ESCAPED_START):
        value = escape_cell(value)
    return _csv_field(value, eol) if _SPECIAL.search(value) else value


def _any_cell(value: Any, eol: str) -> str:
    """What csv writes for ``_cell(value)``, whatever its type."""
    value = _cell(value)
    if value is None:
        return ""
    text = repr(value) if isinstance(value, float) else str(value)
    return _csv_field(text, eol) if _SPECIAL.search(text) else text


def _column_cells(column: tuple, kind: type | None, eol: str) -> Sequence:
    """One column's cells (``kind``: the type of all its values, None: mixed): values that print
    as csv writes them (ints, floats but NaN), or their text."""
    if kind is int or (kind is float and not any(map(math.isnan, column))):
        return column  # str(float) is its repr, what csv writes
    if kind is str:
        texts = {value: _text_cell(value, eol) for value in set(column)}
        return [texts[value] for value in column]
    return [_any_cell(value, eol) for value in column]


def _lines(table: str, keys: tuple, rows: list[dict], eol: str) -> list[str]:
    """The CSV lines of ``rows`` of ``table``, every one with ``keys`` (in that order)."""
    table_text = _csv_field(table, eol) if _SPECIAL.search(table) else table  # as is: the file's own word
    cells = [table_text.replace("%", "%%")] + [""] * (len(COLUMNS) - 1)
    varying = []
    for key, column in zip(keys, zip(*map(dict.values, rows))):
        at = _POSITION.get(key)
        if at is None:
            continue
        types = set(map(type, column))
        kind = types.pop() if len(types) == 1 else None
        if kind in _CONSTANT_TYPES and column.count(column[0]) == len(column):
            cells[at] = _any_cell(column[0], eol).replace("%", "%%")
        else:
            cells[at] = "%s"
            varying.append((at, _column_cells(column, kind, eol)))
    form = ",".join(cells) + eol
    if not varying:
        return [form % ()] * len(rows)
    varying.sort(key=lambda v: v[0])  # the fields in the line's order
    return [form % values for values in zip(*(cells for _, cells in varying))]


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
        self.columns = list(columns)
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
        """``rows`` of ``table`` as lines of the long file (:func:`_lines`: what ``csv`` writes for
        the cells :func:`_cell` makes of them, built a run of rows with the same keys at a time)."""
        if self.columns != COLUMNS:  # another file's columns: cell by cell
            for row in rows:
                self.write_row([table if c == "table" else _cell(row.get(c)) for c in self.columns])
            return
        lines = []
        for keys, run in groupby(rows, tuple):  # tuple(row): its keys, in order
            lines += _lines(table, keys, list(run), self._eol)
        self._io(self._file.write, "".join(lines))

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
