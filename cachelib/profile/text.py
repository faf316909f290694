"""Reading an evaluation text from a file: UTF-8 text, at most :data:`MAX_TEXT_BYTES`.

:func:`read_text_file` refuses, with a ``ValueError`` naming the file, what is not such a text:
a file (or a device like ``/dev/zero``) larger than the cap, bytes that are not UTF-8, a binary
file (NUL bytes); an unreadable path is an ``OSError`` naming it.
"""

from __future__ import annotations

import os
from pathlib import Path

MAX_TEXT_BYTES = 50_000_000  # 50 MB: far more text than a run decodes, far less than memory


def read_text_file(path: str | os.PathLike, what: str = "text file", max_bytes: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of ``path`` (``what`` names it in errors, e.g. ``"--text-file"``)."""
    path = Path(path)
    label = f"{what} {str(path)!r}"
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except IsADirectoryError:
        raise ValueError(f"{label} is a folder, not a text file") from None
    except OSError as e:
        raise type(e)(e.errno, f"cannot read {label} ({e.strerror})") from None
    if len(data) > max_bytes:
        raise ValueError(f"{label} is larger than the {max_bytes / 1e6:g} MB an evaluation text may have")
    if b"\x00" in data:
        raise ValueError(f"{label} holds NUL bytes: a binary file, not UTF-8 text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{label} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); save it as UTF-8"
        ) from None
