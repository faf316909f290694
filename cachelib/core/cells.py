"""CSV cells a spreadsheet will not run: OWASP's rule against formula injection.

A spreadsheet runs a cell that starts with ``=``, ``+``, ``-`` or ``@`` (and some also after a
leading tab or carriage return) as a formula, so a prompt or a folder name like
``=HYPERLINK(...)`` becomes live when someone opens our CSV. :func:`escape_cell` puts an
apostrophe before such text (a spreadsheet shows the text, not the apostrophe); a text that
already starts with an apostrophe gets one more, so :func:`unescape_cell` (drop one leading
apostrophe) gives back exactly what was escaped. Numbers (``-0.5``, ``+3``, ``-inf``) stay as
they are: they are values, not formulas.
"""

from __future__ import annotations

import re

TRIGGERS = ("=", "+", "-", "@", "\t", "\r")
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*([eE][+-]?\d+)?|\.\d+([eE][+-]?\d+)?|inf|nan)", re.IGNORECASE)


def needs_escape(text: str) -> bool:
    """Whether a spreadsheet would read ``text`` as a formula (or it starts with an apostrophe)."""
    if not text or not (text.startswith(TRIGGERS) or text.startswith("'")):
        return False
    return text.startswith("'") or not _NUMBER.fullmatch(text)


def escape_cell(value):
    """``value`` with a leading apostrophe where :func:`needs_escape` says so; non-text as is."""
    return "'" + value if isinstance(value, str) and needs_escape(value) else value


def unescape_cell(value):
    """The inverse of :func:`escape_cell` on text it wrote: one leading apostrophe dropped."""
    return value[1:] if isinstance(value, str) and value.startswith("'") else value
