"""The profile folder: where it is, its files' views and metadata (read once per version of a
file), its listing, and saving a profile in it under a name."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st

from cachelib.core.units import human_bytes
from cachelib.profile import Profile, ProfileFile, load_profile, read_meta, save_profile
from cachelib.profile.store import meta_list
from cachelib.profile.tables import read_table

from .data import LazyTables, RunView, run_view
from .keys import Keys

ROOT = Path(__file__).resolve().parents[1]
PROFILES_ENV = "CACHELIB_PROFILES_DIR"  # tests point the app at a temporary folder


def profiles_dir() -> Path:
    return Path(os.environ.get(PROFILES_ENV) or ROOT / "profiles")


@st.cache_data(show_spinner=False, max_entries=32)
def _table_of_file(path: str, mtime_ns: int, size: int, table: str) -> pd.DataFrame:
    return read_table(path, table, name=Path(path).name)


class _FileTables:
    """Reads one table of a profile file, once per version of the file (picklable, as what
    ``st.cache_data`` keeps of a view must be)."""

    def __init__(self, path: str, mtime_ns: int, size: int):
        self.path, self.mtime_ns, self.size = path, mtime_ns, size

    def __call__(self, table: str) -> pd.DataFrame:
        return _table_of_file(self.path, self.mtime_ns, self.size, table)


@st.cache_data(show_spinner=False, max_entries=32)
def _view_of_file(path: str, mtime_ns: int, size: int, name: str) -> RunView:
    # The metadata and the steps table now; the others when a figure reads them.
    label = Path(path).name
    meta = read_meta(path, name=label)
    if "schema_version" not in meta:  # a partial file whose run recorded nothing yet
        raise ValueError(f"{label}: {meta['status']}: {meta.get('reason', '')}; nothing to load")
    tables = LazyTables(_FileTables(path, mtime_ns, size))
    profile = Profile(meta)
    profile.path = Path(path)
    return run_view(profile, name, tables=tables, size_bytes=size)


def view_of_file(f: ProfileFile) -> RunView:
    """A profile file's view: its metadata and steps table, parsed once per version of the file
    (mtime and size key the cache); the other tables are read when a figure needs them. The
    session keeps the view object, so figures drawn from it, and tables read, are kept too."""
    s = f.path.stat()
    key = (str(f.path), s.st_mtime_ns, s.st_size, f.label)
    views = st.session_state.setdefault(Keys.FILE_VIEWS, {})
    if key not in views:
        views[key] = _view_of_file(*key)
    return views[key]


@st.cache_data(show_spinner=False, max_entries=16)
def view_of_upload(data: bytes, name: str) -> RunView:
    """An uploaded profile's tables (the bytes key the cache)."""
    return run_view(load_profile(data, name=name), name.removesuffix(".csv"))


@st.cache_data(show_spinner=False, max_entries=512)
def _meta_of_file(path: str, mtime_ns: int, size: int) -> dict[str, str]:
    return read_meta(path, name=Path(path).name)


def meta_of_file(path: Path) -> dict[str, str]:
    """:func:`cachelib.profile.read_meta`, once per version of the file."""
    s = path.stat()
    return _meta_of_file(str(path), s.st_mtime_ns, s.st_size)


def listing(files: list[ProfileFile]) -> pd.DataFrame:
    """One row per file: what ran, and whether it finished (with the reason when it did not)."""
    rows = []
    for f in files:
        row: dict[str, Any] = {"profile": f.name}
        try:
            row["size"] = human_bytes(f.path.stat().st_size)
        except OSError:
            row["size"] = ""
        try:
            # A partial file's status hangs on whether its run is alive, which no file stamp shows: read it afresh.
            m = read_meta(f.path, name=f.name) if f.partial else meta_of_file(f.path)
        except (ValueError, OSError) as e:
            row.update(status="not a profile", reason=str(e))
        else:
            row.update(
                status=m.get("status", ""),
                reason=m.get("reason", ""),
                model=m.get("model", ""),
                backend=m.get("backend", ""),
                strategies=", ".join(meta_list(m.get("strategies", ""))),
                steps=m.get("steps_completed", ""),
                created=m.get("created", ""),
            )
        rows.append(row)
    cols = ["profile", "size", "status", "reason", "model", "backend", "strategies", "steps", "created"]
    return pd.DataFrame(rows, columns=cols)


NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def save_as(profile: Profile, name: str) -> Path:
    """Write ``profile`` as ``profiles/NAME.csv``; refuses bad names and existing files."""
    name = name.strip().removesuffix(".csv")
    if not NAME_RE.match(name):
        raise ValueError(
            f"profile name {name!r} is not allowed: use letters, digits, '.', '_' or '-' (at most 100), "
            "starting with a letter or digit"
        )
    path = profiles_dir() / f"{name}.csv"
    if path.exists():
        raise ValueError(f"a profile named {name!r} already exists in {profiles_dir()}; choose another name")
    profile.meta["name"] = name
    return save_profile(profile, path)
