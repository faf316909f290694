"""Output paths checked before any work, and whole files written in one step.

Every command that writes (``profile``, ``evaluate``, ``retrieval``, ``report``, ``plan --csv``,
``sweep``) checks its output path with :func:`check_out_path` before it loads a model or reads a
profile: the name's suffix, a folder or a file standing in the way, a name over the file system's
limit, a folder that cannot be made, and an existing file of another kind (a run never replaces
what it did not write: a profile is never replaced by a plan, an evaluation by a profile). The
writability of the folder is then proved by creating the hidden file the command writes into
(:class:`AtomicFile`, or the streaming writer of :mod:`.store`), so ``/proc`` and read-only
folders fail first too. Every error names the user's path; a hidden file is removed on any error
the process survives.
"""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

from ..core.reader import file_kind

HEAD_BYTES = 65_536  # enough of a file's first line to tell what it is

# The first header cell of each CSV cachelib writes -> what it is.
CSV_KINDS = {"table": "profile", "schema": "evaluation", "point": "sweep index"}


def name_max(folder: Path) -> int:
    """The longest file name (bytes) the file system of ``folder`` (or its nearest existing parent) allows."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        return 255


def existing_kind(path: Path) -> str | None:
    """What the file at ``path`` holds, for deciding whether an output may replace it: None when
    there is none (or it is empty), ``profile``/``evaluation``/``sweep index`` for cachelib's
    CSVs, ``html`` for a page, ``csv:FIRST_CELL`` for another CSV, else ``other``."""
    try:
        st = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    kind = file_kind(st.st_mode)
    if kind:
        return kind
    if st.st_size == 0:
        return None
    try:
        with open(path, "rb") as f:
            head = f.read(HEAD_BYTES)
    except OSError as e:
        raise type(e)(e.errno, f"cannot read the file that is there ({e.strerror})", str(path)) from None
    text = head.decode("utf-8", errors="replace").lstrip("\ufeff")
    lowered = text.lstrip().lower()
    if lowered.startswith(("<!doctype html", "<html")):
        return "html"
    first = text.split("\n", 1)[0].split(",", 1)[0].strip().strip('"')
    if first in CSV_KINDS:
        return CSV_KINDS[first]
    return f"csv:{first}" if "," in text.split("\n", 1)[0] else "other"


def check_out_path(
    path: str | os.PathLike,
    *,
    what: str,
    suffixes: tuple[str, ...],
    replaces: tuple[str, ...] = (),
) -> Path:
    """``path`` as a place to write a ``what`` (e.g. "profile"): a name ending in one of
    ``suffixes`` that is not a folder, fits the file system's name limit, in a folder that exists
    or can be made, and where no file of another kind stands (``replaces``: the kinds of
    :func:`existing_kind` it may replace; an empty file may always be). Raises ValueError (the
    name, what is there) or OSError (the file system says no), both naming the path and what is
    allowed, before any work."""
    path = Path(path)
    shown = str(path)
    if path.suffix.lower() not in suffixes:
        names = " or ".join(suffixes)
        raise ValueError(f"{shown}: {a_or_an(what)} is written as {names}; use a {names} name")
    limit = name_max(path.parent)
    if len(os.fsencode(path.name)) > limit:
        raise OSError(errno.ENAMETOOLONG, f"file name too long (at most {limit} bytes)", shown)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, f"is a folder, not {a_or_an(what)} file; give a file name in it", shown)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a file stands where the folder would go
        raise NotADirectoryError(errno.ENOTDIR, "a file stands where its folder would go", shown) from None
    except OSError as e:
        raise type(e)(e.errno, f"cannot make its folder ({e.strerror})", shown) from None
    kind = existing_kind(path)
    if kind is not None and kind not in replaces:
        allowed = " or ".join(_kind_text(k) for k in replaces) if replaces else "no file"
        raise ValueError(
            f"{shown}: holds {_kind_text(kind)}, which {a_or_an(what)} would replace; give a new name "
            f"(allowed: a path where nothing is, or {allowed})"
        )
    return path


def a_or_an(what: str) -> str:
    return ("an " if what[:1] in "aeiou" else "a ") + what


def _kind_text(kind: str) -> str:
    if kind == "csv:model":
        return "a plan CSV"
    if kind.startswith("csv:"):
        return f"a CSV of another kind (first column {kind[4:][:40]!r})"
    if kind == "other":
        return "a file of another kind"
    if kind.startswith("a "):
        return kind
    return a_or_an(kind) if kind != "html" else "an HTML page"


def os_error_at(e: OSError, path: Path, doing: str) -> OSError:
    """``e`` as an OSError naming the user's ``path`` and what was being done (disk full included)."""
    return type(e)(e.errno, f"{doing} ({e.strerror or e})", str(path))


class AtomicFile:
    """A whole file written in one step: :meth:`open` creates the hidden temporary file next to
    ``path`` at once (so a folder that cannot be written fails before any work), :meth:`commit`
    writes the data and renames it into place, :meth:`discard` removes it. Errors name ``path``;
    the temporary file never outlives an error."""

    def __init__(self, path: str | os.PathLike, what: str):
        self.path = Path(path)
        self.what = what
        self.tmp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex[:12]}.tmp")
        self._fd: int | None = None

    def open(self) -> "AtomicFile":
        try:
            self._fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise os_error_at(e, self.path, f"cannot write {a_or_an(self.what)} here") from None
        return self

    def commit(self, data: bytes | str) -> Path:
        """Write ``data`` and move it into place; on any error the temporary file is gone."""
        if self._fd is None:
            self.open()
        raw = data.encode("utf-8") if isinstance(data, str) else data
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(self._fd, view) :]
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
            os.replace(self.tmp, self.path)
        except OSError as e:
            self.discard()
            raise os_error_at(e, self.path, f"cannot write the {self.what}") from None
        except BaseException:
            self.discard()
            raise
        return self.path

    def discard(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
        try:
            self.tmp.unlink()
        except OSError:
            pass

    def __enter__(self) -> "AtomicFile":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.discard()  # a no-op after commit: the temporary file was renamed


def write_whole(path: str | os.PathLike, data: bytes | str, what: str) -> Path:
    """Write ``data`` to ``path`` in one step (:class:`AtomicFile`)."""
    return AtomicFile(path, what).commit(data)
