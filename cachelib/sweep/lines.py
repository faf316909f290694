"""Where keys and list entries sit in a TOML text: ``tomllib`` reports no positions for values,
so the grid's error messages find their line here. It reads the text as lines and table
headers; it does not parse TOML values.
"""

from __future__ import annotations

import re


class Locator:
    """Line numbers of keys and list entries in the TOML text (tomllib reports none for values)."""

    _HEADER = re.compile(r"^\s*\[\[?\s*([A-Za-z0-9_.\"' -]+?)\s*\]\]?\s*(#.*)?$")

    def __init__(self, text: str):
        self.text = text
        self.lines = text.splitlines()
        # Each line's table header (None: the top level), so a key is looked up in its own table.
        self.section: list[tuple[str | None, int]] = []
        current, counts = None, {}
        for line in self.lines:
            m = self._HEADER.match(line)
            if m and not line.lstrip().startswith("#"):
                current = m.group(1).strip().strip("\"'")
                counts[current] = counts.get(current, -1) + 1
            self.section.append((current, counts.get(current, 0)))

    def key_line(self, key: str) -> int | None:
        """1-based line of a top-level key (``devices.mlx``: key mlx in table devices, or dotted)."""
        table, _, leaf = key.rpartition(".")
        pattern = re.compile(rf"^\s*(?:{re.escape(leaf)}|\"{re.escape(leaf)}\"|'{re.escape(leaf)}')\s*=")
        dotted = re.compile(rf"^\s*{re.escape(key)}\s*=") if table else None
        for i, line in enumerate(self.lines):
            sect = self.section[i][0]
            if sect == (table or None) and pattern.match(line):
                return i + 1
            if dotted and sect is None and dotted.match(line):
                return i + 1
        if table:  # inline table: devices = {mlx = [...]}
            return self.key_line(table)
        for i, line in enumerate(self.lines):  # [key] / [[key]] table header
            if self.section[i] == (key, 0) and self._HEADER.match(line):
                return i + 1
        return None

    def line_within(self, key: str, start: int | None, end: int | None) -> int | None:
        """Line of ``key = `` between lines ``start`` and ``end`` (exclusive); else ``start``."""
        if start is None:
            return None
        pattern = re.compile(rf"(^|[{{,\s]){re.escape(key)}\s*=")
        for n in range(start, (end or len(self.lines) + 1)):
            if pattern.search(self.lines[n - 1]):
                return n
        return start

    def entry_lines(self, key: str, entries: list) -> list[int | None]:
        """1-based line of each entry of the list ``key`` (array of tables or inline array)."""
        headers = [i + 1 for i, line in enumerate(self.lines) if self._HEADER.match(line) and self.section[i][0] == key]
        if headers and len(headers) == len(entries):
            return headers
        start = self.key_line(key)
        if start is None:
            return [None] * len(entries)
        offset = sum(len(line) for line in self.text.splitlines(keepends=True)[: start - 1])
        offset = self.text.index("=", offset) + 1
        out = []
        for entry in entries:
            if isinstance(entry, str):
                pattern = re.escape(entry).join(["[\"']", "[\"']"])
            elif isinstance(entry, dict) and isinstance(entry.get("name"), str):
                pattern = rf"name\s*=\s*[\"']{re.escape(entry['name'])}[\"']"
            else:
                pattern = r"[{\[\"']"
            m = re.compile(pattern).search(self.text, offset)
            if m is None:
                out.append(start)
                continue
            out.append(self.text.count("\n", 0, m.start()) + 1)
            offset = m.end()
        return out
