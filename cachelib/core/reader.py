"""One bounded reader for every file cachelib is handed: texts, grids, evidence, profiles, configs.

:func:`read_bytes` opens without blocking, refuses by file type what is no regular file (a
device like ``/dev/zero``, a named pipe, a socket, a folder; a symlink is judged by what it
points at) before reading a byte, and reads at most ``max_bytes`` (counting what it reads, not
what ``stat`` says, which is 0 for ``/proc`` files and devices). :func:`read_text` adds UTF-8;
:func:`read_toml` and :func:`read_json` add a cap on nesting, checked before the parser recurses.
Every refusal is a ``ValueError`` naming the file (``OSError`` for a path the file system
refuses); an input is quoted to at most 100 characters.
"""

from __future__ import annotations

import json
import os
import re
import stat
from typing import Any

from .units import clip_input

MAX_TEXT_BYTES = 50_000_000  # 50 MB: far more text than a run decodes, far less than memory
MAX_CONFIG_BYTES = 10_000_000  # a grid or a config.json: kilobytes in practice
MAX_NESTING = 64  # arrays and tables inside each other; real grids and configs use 3 or 4

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
)


def label(path: str | os.PathLike, what: str = "file") -> str:
    """``what 'PATH'``, the path cut to 100 characters."""
    return f"{what} {clip_input(str(path))!r}"


def file_kind(mode: int) -> str | None:
    """What a file of ``mode`` is when it is not a regular file; None for a regular file."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return None if stat.S_ISREG(mode) else "not a regular file"


def kind_at(path: str | os.PathLike) -> str | None:
    """What ``path`` is when it exists and is no regular file (symlinks followed); else None."""
    try:
        return file_kind(os.stat(path).st_mode)
    except (OSError, ValueError):
        return None


def check_regular(path: str | os.PathLike, what: str = "file") -> os.stat_result:
    """``path``'s stat when it is a regular file (symlinks followed); a ``ValueError`` naming
    what it is otherwise (``OSError`` when it cannot be looked at)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise type(e)(e.errno, f"cannot read {label(path, what)} ({e.strerror})") from None
    kind = file_kind(st.st_mode)
    if kind:
        raise ValueError(f"{label(path, what)} is {kind}, not a file; cachelib reads regular files only")
    return st


def read_bytes(path: str | os.PathLike, what: str = "file", max_bytes: int = MAX_TEXT_BYTES) -> bytes:
    """At most ``max_bytes`` bytes of the regular file ``path``; a ``ValueError`` naming it when
    it holds more or is no regular file. Opened with ``O_NONBLOCK`` so a named pipe never hangs."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except IsADirectoryError:
        raise ValueError(f"{label(path, what)} is a folder, not a file") from None
    except OSError as e:
        kind = kind_at(path)  # a socket cannot be opened at all (ENXIO): say what it is
        if kind:
            raise ValueError(f"{label(path, what)} is {kind}, not a file; cachelib reads regular files only") from None
        raise type(e)(e.errno, f"cannot read {label(path, what)} ({e.strerror})") from None
    with os.fdopen(fd, "rb", buffering=0) as f:
        kind = file_kind(os.fstat(fd).st_mode)  # the file opened, not the name: no race with a swap
        if kind:
            raise ValueError(f"{label(path, what)} is {kind}, not a file; cachelib reads regular files only")
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = f.read(min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    if size > max_bytes:
        raise ValueError(f"{label(path, what)} is larger than the {_mb(max_bytes)} it may have")
    return b"".join(chunks)


def _mb(n: int) -> str:
    return f"{n / 1e6:g} MB" if n >= 10**6 else f"{n:,} bytes"


def decode_text(data: bytes, name: str) -> str:
    """``data`` as UTF-8 text; a ``ValueError`` naming ``name`` (and the first bad byte) otherwise."""
    if b"\x00" in data:
        raise ValueError(f"{name} holds NUL bytes: a binary file, not UTF-8 text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{name} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); save it as UTF-8"
        ) from None


def read_text(path: str | os.PathLike, what: str = "text file", max_bytes: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of the regular file ``path``, at most ``max_bytes`` bytes of it."""
    return decode_text(read_bytes(path, what, max_bytes), label(path, what))


_TOKENS = re.compile(r"""["'\[\]{}#\\\n]""")


def nesting(text: str) -> int:
    """The deepest nesting of ``[`` and ``{`` in TOML or JSON ``text``, outside strings and
    comments (a scan, not a parse: it never recurses)."""
    depth = most = 0
    quote = None  # the quote character of the string we are in
    comment = escaped = False
    for m in _TOKENS.finditer(text):
        c = m.group()
        if comment:
            comment = c != "\n"
        elif quote:
            if escaped:
                escaped = False
            elif c == "\\" and quote == '"':
                escaped = m.end() < len(text) and text[m.end()] in '"\\'
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c == "#":
            comment = True
        elif c in "[{":
            depth += 1
            most = max(most, depth)
        elif c in "]}":
            depth = max(0, depth - 1)
    return most


def check_nesting(text: str, name: str, max_depth: int = MAX_NESTING) -> None:
    """A ``ValueError`` naming ``name`` when ``text`` nests deeper than ``max_depth``."""
    depth = nesting(text)
    if depth > max_depth:
        raise ValueError(f"{name} nests arrays or tables {depth:,} deep; at most {max_depth} are allowed")


def parse_toml(text: str, name: str, max_depth: int = MAX_NESTING) -> dict[str, Any]:
    """TOML ``text`` parsed, its nesting capped first (``tomllib`` would recurse into a
    ``RecursionError``); a ``tomllib.TOMLDecodeError`` for bad TOML, as ``tomllib`` raises it."""
    import tomllib

    check_nesting(text, name, max_depth)
    try:
        return tomllib.loads(text)
    except RecursionError:  # a nesting the scan could not see (inside a multi-line string's edge case)
        raise ValueError(f"{name} nests too deep to read; at most {max_depth} levels are allowed") from None


def read_json(
    path: str | os.PathLike, what: str = "JSON file", max_bytes: int = MAX_CONFIG_BYTES, max_depth: int = MAX_NESTING
) -> Any:
    """The JSON value of the regular file ``path``: bounded bytes, UTF-8, nesting capped; a
    ``ValueError`` naming the file otherwise."""
    name = label(path, what)
    text = decode_text(read_bytes(path, what, max_bytes), name)
    check_nesting(text, name, max_depth)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} is not valid JSON ({clip_input(str(e))})") from None
    except RecursionError:
        raise ValueError(f"{name} nests too deep to read; at most {max_depth} levels are allowed") from None


def is_regular(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a regular file (symlinks followed), without opening it."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_NESTING",
    "MAX_TEXT_BYTES",
    "check_nesting",
    "check_regular",
    "decode_text",
    "file_kind",
    "is_regular",
    "kind_at",
    "label",
    "nesting",
    "parse_toml",
    "read_bytes",
    "read_json",
    "read_text",
]
