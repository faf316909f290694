"""The sweep's progress in the terminal: points done / failed / left.

On a terminal, one bar redrawn in place, with a line above it for each failure and note; in a
log (not a terminal), one plain line per point that ends. It reads :class:`SweepEvent` only.
"""

from __future__ import annotations

import sys
from typing import TextIO

from .run import SweepEvent

BAR_WIDTH = 30


class Progress:
    def __init__(self, stream: TextIO | None = None, tty: bool | None = None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self._drawn = False

    def __call__(self, event: SweepEvent) -> None:
        if self.tty:
            self._tty(event)
        else:
            self._plain(event)

    def _plain(self, e: SweepEvent) -> None:
        ended = e.done + e.failed
        if e.kind in ("cluster", "note", "skipped"):
            self._line(e.message)
        elif e.kind in ("done", "stopped"):
            took = f" in {e.seconds:.1f} s" if e.seconds is not None else ""
            why = f": {e.message}" if e.kind == "stopped" else ""
            self._line(f"[{ended}/{e.total}] {e.kind} {e.point}{took}{why}")
        elif e.kind == "failed":
            self._line(f"[{ended}/{e.total}] failed {e.point} after {e.attempt} attempt(s): {e.message}")

    def _tty(self, e: SweepEvent) -> None:
        if e.kind in ("cluster", "note", "skipped"):
            self._above(e.message)
        elif e.kind == "failed":
            self._above(f"failed {e.point} after {e.attempt} attempt(s): {e.message}")
        elif e.kind == "stopped":
            self._above(f"stopped early {e.point}: {e.message}")
        self.stream.write("\r" + bar(e) + "\x1b[K")
        self.stream.flush()
        self._drawn = True

    def _above(self, text: str) -> None:
        self.stream.write(("\r\x1b[K" if self._drawn else "") + text + "\n")

    def _line(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


def bar(e: SweepEvent) -> str:
    """``[#####-----     ] 5 done, 2 failed, 9 left (2 running)``: # done, - failed."""
    total = max(e.total, 1)
    n_done = round(BAR_WIDTH * e.done / total)
    n_failed = min(BAR_WIDTH - n_done, round(BAR_WIDTH * e.failed / total))
    fill = "#" * n_done + "-" * n_failed
    running = f" ({e.running} running)" if e.running else ""
    return f"[{fill:<{BAR_WIDTH}}] {e.done} done, {e.failed} failed, {e.left} left{running}"
