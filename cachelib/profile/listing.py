"""A folder's profiles: :func:`list_profiles` (sweep folders and unclosed partial files included)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .writer import _PARTIAL


@dataclass(frozen=True)
class ProfileFile:
    name: str  # "run.csv" or "sweep/run.csv" (a partial file: ".run.csv.RUNID.partial")
    path: Path
    folder: str  # "" or the sweep folder
    partial: bool = False  # a run's partial file: still running, or ended without closing it

    @property
    def label(self) -> str:
        """How charts name this profile: "run" or "sweep/run" ("run.RUNID.partial" for a partial file)."""
        m = _PARTIAL.match(self.path.name)
        if self.partial and m:
            stem = m["target"].removesuffix(".csv") + f".{m['run_id']}.partial"
            return f"{self.folder}/{stem}" if self.folder else stem
        return self.name.removesuffix(".csv")


def meta_list(text: str) -> list[str]:
    """A list-valued metadata cell (``strategies``, ``specs``: JSON lists) as strings; a cell that
    is not JSON is one item."""
    try:
        value = json.loads(text)
    except ValueError:
        return [text] if text else []
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def _sweep_index(path: Path) -> bool:
    """Whether ``path`` is a sweep's ``index.csv`` (by its header), which no listing calls a profile."""
    from .outputs import existing_kind

    try:
        return existing_kind(path) == "sweep index"
    except OSError:
        return False


def list_profiles(folder: str | os.PathLike) -> list[ProfileFile]:
    """``FOLDER/*.csv`` and the runs of sweep folders ``FOLDER/*/*.csv`` (not their index), by
    name, each folder's partial files (``.NAME.csv.RUNID.partial``: a run still going, or one
    that ended without closing its file) after its profiles; other hidden files are left out."""
    folder = Path(folder)
    if not folder.is_dir():
        return []

    def files(where: Path, prefix: str) -> list[ProfileFile]:
        try:
            names = sorted(p.name for p in where.iterdir() if p.is_file())
        except OSError:  # a folder we may not read lists nothing
            return []
        out = [
            ProfileFile(prefix + n, where / n, prefix.rstrip("/"))
            for n in names
            if n.endswith(".csv") and not n.startswith(".") and not (n == "index.csv" and _sweep_index(where / n))
        ]
        out += [
            ProfileFile(prefix + n, where / n, prefix.rstrip("/"), partial=True) for n in names if _PARTIAL.match(n)
        ]
        return out

    out = files(folder, "")
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        out += files(sub, f"{sub.name}/")
    return out
