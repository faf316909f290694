"""An evaluation's or a retrieval run's ``--out``: checked first, streamed, locked, resumed.

The same machinery as a profile's (:class:`cachelib.profile.store.ProfileWriter`): the path is
checked and a hidden partial file of this run's own (``.NAME.csv.RUNID.partial``, locked while
the run lives) is created before the model loads; every measured row is appended and flushed at
once; a finished run moves the file into ``NAME.csv`` in one step (``NAME.RUNID.csv`` when another
run wrote ``NAME.csv`` meanwhile), an unfinished one into ``NAME.incomplete.csv`` (never replacing
another run's: ``NAME.RUNID.incomplete.csv`` then).

Resuming: once the model is loaded and the run knows every measurement it will take,
:meth:`EvaluationWriter.resume` claims the unfinished files of the same ``--out`` (``NAME.incomplete.csv``,
``NAME.RUNID.incomplete.csv``, and partial files whose run ended without closing them) whose every
row is one this run would take: their rows are copied into this run's file and the claimed files
removed, under the folder's lock, so two runs never claim the same rows. The run then skips what
was measured; the final file holds each measurement once. A file holding other measurements (other
settings) is left alone.
"""

from __future__ import annotations

import csv
import io
import os
import re
from pathlib import Path
from typing import Any, Sequence

from .evaluation_file import SCHEMA, Evaluation, _cell, load_evaluation
from .outputs import check_out_path
from .store import ProfileWriter, _folder_lock, partial_running

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

# What tells one measurement from another, per row kind (the row's own columns).
KEYS = {
    "sample": (
        "model",
        "backend",
        "device",
        "dtype",
        "strategy",
        "reference",
        "context",
        "score_tokens",
        "prefill_chunk",
        "text",
        "window_start",
    ),
    "retrieval": (
        "model",
        "backend",
        "device",
        "dtype",
        "strategy",
        "context",
        "prefill_chunk",
        "task",
        "depth",
        "trial",
        "question",
        "text",
        "needle_position",
        "answer",
    ),
}


def check_evaluation_path(path: str | os.PathLike) -> Path:
    """``path`` as a place an evaluation can be written (see :func:`~cachelib.profile.outputs.check_out_path`):
    a ``.csv`` name, not a folder, no file of another kind there."""
    return check_out_path(path, what="evaluation", suffixes=(".csv",), replaces=("evaluation",))


def row_key(row: dict, kind: str) -> tuple[str, ...]:
    """A row's measurement key, as its cells are written (so a key read from a file compares)."""
    return tuple(_cell(_plain(row.get(c))) for c in KEYS[kind])


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # numpy scalars
        return value.item()
    return value


class EvaluationWriter:
    """Streams one run's rows of ``kind`` (``sample`` or ``retrieval``) with ``columns`` to ``path``."""

    def __init__(self, path: str | os.PathLike, kind: str, columns: Sequence[str]):
        self.kind = kind
        self.columns = tuple(columns)
        self._file = ProfileWriter(
            path, columns=self.columns, what="evaluation", check=check_evaluation_path, incomplete_aside=True
        )
        self.path = self._file.path
        self.rows = 0  # rows in this run's file: resumed and measured
        self.resumed: set[tuple[str, ...]] = set()
        self.claimed: list[Path] = []

    def resume(self, planned: set[tuple[str, ...]]) -> set[tuple[str, ...]]:
        """Claim the unfinished files of this ``--out`` whose every row is in ``planned`` (keys of
        :func:`row_key`); returns the keys measured already, which the run skips."""
        folder = self.path.parent
        with _folder_lock(folder):
            for candidate in self._candidates():
                rows = _rows_of(candidate, self.kind)
                if not rows or any(_disk_key(r, self.kind) not in planned for r in rows):
                    continue  # another run's measurements, or nothing to take: left alone
                lock = _claim_lock(candidate)
                if lock is False:
                    continue  # its run still goes
                try:
                    for row in rows:
                        key = _disk_key(row, self.kind)
                        if key in self.resumed:
                            continue
                        self.resumed.add(key)
                        self._file.write_row([_on_disk(row.get(c)) for c in self.columns])
                        self.rows += 1
                    self._file.flush()
                    os.fsync(self._file._file.fileno())  # on disk before the claimed file goes
                    candidate.unlink()
                    self.claimed.append(candidate)
                finally:
                    if lock is not None and lock is not False:
                        os.close(lock)
        return set(self.resumed)

    def _candidates(self) -> list[Path]:
        folder, name = self.path.parent, self.path.name
        stem = re.escape(name[: -len(self.path.suffix)])
        own = re.compile(
            rf"^(?:{stem}(?:\.[0-9a-f]{{12}})?\.incomplete\.csv|\.{re.escape(name)}\.[0-9a-f]{{12}}\.partial)$"
        )
        try:
            names = sorted(p.name for p in folder.iterdir())
        except OSError:
            return []
        return [folder / n for n in names if own.match(n) and folder / n != self._file.partial]

    def add(self, row: dict) -> None:
        """Append one measured row and flush it: it survives whatever ends the run next."""
        row = {**row, "schema": SCHEMA, "kind": self.kind}
        self._file.write_row([_cell(_plain(row.get(c))) for c in self.columns])
        self._file.flush()
        self.rows += 1

    def close(self, complete: bool) -> Evaluation | None:
        """Move the file into place (``NAME.csv`` when ``complete``, else ``NAME.incomplete.csv``);
        returns it read back (None, and no file, when an unfinished run holds no row). A write
        the file system refuses keeps what was flushed (see :meth:`ProfileWriter.salvage`) and
        raises an ``OSError`` naming the path."""
        if not complete and self.rows == 0:
            self._file.discard()
            return None
        try:
            dest = self._file.finish(complete)
        except OSError as e:
            kept = self._file.salvage()
            if kept is not None:
                e.strerror = f"{e.strerror}; the {self.rows} row(s) measured so far are in {kept}"
            raise
        return load_evaluation(dest)

    def fail(self) -> Path | None:
        """After an error writing: keep the flushed rows where an unfinished run goes (or nothing)."""
        return self._file.salvage() if self.rows else self._file.discard()

    def discard(self) -> None:
        self._file.discard()


def _disk_key(row: dict[str, str], kind: str) -> tuple[str, ...]:
    """A row read from a file as cells on disk: its key as :func:`row_key` gives it."""
    return tuple(row[c] or "" for c in KEYS[kind])


def _on_disk(cell: str | None) -> str:
    return "" if cell is None else cell


def _claim_lock(path: Path):
    """An fd holding ``path``'s lock (None where locks do not exist or it is no partial file);
    False when a live run holds it."""
    if not path.name.endswith(".partial"):
        return None
    if partial_running(path):
        return False
    if fcntl is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    return fd


def _rows_of(path: Path, kind: str) -> list[dict[str, str]]:
    """The rows of an unfinished evaluation file as their cells on disk ([] when it is not one of
    ``kind``: another schema, another kind of row, unreadable). A row cut off by a killed run is
    dropped."""
    try:
        raw = path.read_bytes()
    except OSError:
        return []
    raw = raw[: raw.rfind(b"\n") + 1]
    try:
        rows = list(csv.DictReader(io.StringIO(raw.decode("utf-8"), newline="")))
    except (UnicodeDecodeError, csv.Error):
        return []
    if any(r.get("schema") != SCHEMA or r.get("kind") != kind or None in r for r in rows):
        return []
    if any(not all(c in r for c in KEYS[kind]) for r in rows):
        return []
    return rows
