"""Reading an evaluation text from a file: UTF-8 text, at most :data:`MAX_TEXT_BYTES`.

:func:`read_text_file` refuses, with a ``ValueError`` naming the file, what is not such a text:
a device like ``/dev/zero``, a named pipe or a socket (by type, before a byte is read), a file
larger than the cap, bytes that are not UTF-8, a binary file (NUL bytes); an unreadable path is
an ``OSError`` naming it.
"""

from __future__ import annotations

import os

from ..core.reader import MAX_TEXT_BYTES, read_text

__all__ = ["MAX_TEXT_BYTES", "read_text_file"]


def read_text_file(path: str | os.PathLike, what: str = "text file", max_bytes: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of ``path`` (``what`` names it in errors, e.g. ``"--text-file"``), read by
    the bounded reader (:func:`cachelib.core.reader.read_text`)."""
    return read_text(path, what, max_bytes)
