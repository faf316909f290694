"""What the app keeps between reruns: cached models and profile views, the profile folder, and
the session's live and current runs (under the keys of :class:`app.keys.Keys`)."""

from __future__ import annotations

import functools
import os
import re
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import streamlit as st

from cachelib.core.units import human_bytes
from cachelib.models import LoadedModel, available_devices, load
from cachelib.profile import Profile, ProfileFile, load_profile, read_meta, save_profile
from cachelib.profile.report import ReportRun, decoder_for, report_html
from cachelib.profile.store import meta_list
from cachelib.profile.tables import read_table
from cachelib.spec import Spec

from .data import LazyTables, RunView, combine, run_view
from .keys import Keys
from .live import LiveRun, RunOptions

ROOT = Path(__file__).resolve().parents[1]
PROFILES_ENV = "CACHELIB_PROFILES_DIR"  # tests point the app at a temporary folder


def profiles_dir() -> Path:
    return Path(os.environ.get(PROFILES_ENV) or ROOT / "profiles")


# --- cached resources --------------------------------------------------------------------------


class ModelShelf:
    """The loaded models of this server process, one per (name, backend, device), shared by every
    session and page, the most recently used ``max_entries`` kept. A model is loaded once even
    when two sessions ask at the same moment (the second waits for the first)."""

    def __init__(self, max_entries: int = 4):
        self.max_entries = max_entries
        self._models: OrderedDict[tuple, LoadedModel] = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[tuple, threading.Lock] = {}
        self.loads = 0  # how many times a model was actually loaded (not taken from the shelf)

    def has(self, key: tuple) -> bool:
        return key in self._models

    def get(self, key: tuple, progress: Callable[[str, float], None] | None = None) -> LoadedModel:
        with self._lock:
            if key in self._models:
                self._models.move_to_end(key)
                return self._models[key]
            loading = self._loading.setdefault(key, threading.Lock())
        with loading:
            with self._lock:
                if key in self._models:
                    return self._models[key]
            try:
                model = load(*key, progress=progress)
            finally:
                with self._lock:
                    self._loading.pop(key, None)
            with self._lock:
                self.loads += 1
                self._models[key] = model
                while len(self._models) > self.max_entries:
                    self._models.popitem(last=False)
            return model


@st.cache_resource(show_spinner=False)
def model_shelf() -> ModelShelf:
    return ModelShelf()


def loaded_model(
    name: str, backend: str, device: str | None, progress: Callable[[str, float], None] | None = None
) -> LoadedModel:
    """One model object per (name, backend, device), shared by every session and page, loaded
    on first use (``progress(stage, fraction)`` hears how the load goes; :func:`cachelib.models.load`)."""
    return model_shelf().get((name, backend, device), progress)


def model_is_loaded(name: str, backend: str, device: str | None) -> bool:
    return model_shelf().has((name, backend, device))


@st.cache_resource(show_spinner=False)
def run_lock() -> threading.Lock:
    return threading.Lock()


@st.cache_resource(show_spinner=False)
def backends_here() -> dict[str, str]:
    """Backend -> "" when it imports here, else why not."""
    out = {}
    for backend, module in (("mlx", "mlx.core"), ("torch", "torch")):
        try:
            __import__(module)
            out[backend] = ""
        except Exception as e:  # a missing or broken install: offer the other backend
            out[backend] = f"{type(e).__name__}: {e}"
    return out


@st.cache_resource(show_spinner=False)
def devices_of(backend: str) -> list[str]:
    return available_devices(backend)


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


def combined(views: dict[str, RunView]) -> RunView:
    """``combine`` of the loaded views, kept while the same views stay loaded."""
    key = tuple((name, id(v)) for name, v in views.items())
    kept = st.session_state.get(Keys.COMBINED)
    if kept is None or kept[0] != key:
        kept = (key, combine(list(views.values())))
        st.session_state[Keys.COMBINED] = kept
    return kept[1]


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


# --- exports: a profile as CSV or Parquet, a comparison as one HTML page ------------------------

EXPORT_FORMATS = {"csv": "text/csv", "parquet": "application/vnd.apache.parquet"}


def export_bytes(source: Path | bytes, fmt: str, name: str = "profile") -> bytes:
    """A profile (a file, or an upload's bytes) as ``fmt`` (csv or parquet). A CSV file is sent
    as it is; Parquet is written by :func:`cachelib.profile.save_profile` from the loaded profile."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; use one of: {', '.join(EXPORT_FORMATS)}")
    if isinstance(source, Path):
        s = source.stat()
        return _export_file(str(source), s.st_mtime_ns, s.st_size, fmt)
    if fmt == "csv":
        return source
    return _as_parquet(load_profile(source, name=name))


@functools.lru_cache(maxsize=4)  # download callables run outside the script thread: no st.cache here
def _export_file(path: str, mtime_ns: int, size: int, fmt: str) -> bytes:
    if fmt == "csv" and path.lower().endswith(".csv"):
        return Path(path).read_bytes()
    profile = load_profile(path, name=Path(path).name)
    return _as_parquet(profile) if fmt == "parquet" else _as_csv(profile)


def _as_parquet(profile: Profile) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        return save_profile(profile, Path(tmp) / "profile.parquet").read_bytes()


def _as_csv(profile: Profile) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        return save_profile(profile, Path(tmp) / "profile.csv").read_bytes()


def report_bytes(views: dict[str, RunView], title: str | None = None) -> bytes:
    """The HTML report (:func:`cachelib.profile.report.report_html`) of the views, each with its
    own metadata and steps table, and its generated text where the model's tokenizer is here."""
    runs = [ReportRun(name, v.meta, v.steps) for name, v in views.items() if v.meta]
    return report_html(runs, title=title, decode=[decoder_of(r.meta) for r in runs]).encode("utf-8")


def decoder_of(meta: dict):
    """``ids -> text`` with the profile's own tokenizer (kept per model source), or None."""
    return _decoder(str(meta.get("model_source", "") or ""))


@functools.lru_cache(maxsize=8)
def _decoder(source: str):
    return decoder_for({"model_source": source}) if source else None


# --- the profile folder: its listing, saving under a name -----------------------------------------


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


# --- the session's runs ------------------------------------------------------------------------


def start_run(loaded: LoadedModel, strategies: list[Spec], name: str, options: RunOptions) -> LiveRun:
    """Start decoding in the background, writing ``profiles/NAME.csv``; the run becomes the session's live run."""
    out = profiles_dir() / f"{name}.csv"
    run = LiveRun(loaded, strategies, out, name, options).start(run_lock())
    st.session_state[Keys.LIVE] = run
    return run


def live_run() -> LiveRun | None:
    return st.session_state.get(Keys.LIVE)


def collect(run: LiveRun | None) -> None:
    """Move a finished run that recorded something into the current results (once)."""
    if run is None or run.running or run.collected:
        return
    run.collected = True
    final = run.final
    if final is not None:
        st.session_state[Keys.CURRENT] = (final, run.view())


def current() -> tuple[Profile, RunView] | None:
    return st.session_state.get(Keys.CURRENT)
