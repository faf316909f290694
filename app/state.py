"""What the app keeps between reruns: cached models and profiles, the live run, the profile folder.

A live run decodes in a background thread (:class:`LiveRun`), so the page stays responsive: a
fragment polls it a few times a second and redraws from a consistent snapshot, and Stop sets an
event the profiler checks before every step (``should_stop``), which keeps what was recorded.
The thread never calls Streamlit; the page reads its fields. Runs of all sessions share one lock,
so two sessions never decode on the same model object at once.
"""

from __future__ import annotations

import csv
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st

from cachelib.models import LoadedModel, load
from cachelib.profile import Profile, StepEvent, load_profile, run_profile, save_profile

from .data import TABLES, RunView, combine, run_view

ROOT = Path(__file__).resolve().parents[1]
PROFILES_ENV = "CACHELIB_PROFILES_DIR"  # tests point the app at a temporary folder

# session_state keys shared by the pages
LIVE = "live_run"  # the LiveRun in progress or last started
CURRENT = "current_run"  # (Profile, RunView) of the last run that recorded at least one step
LOADED = "loaded_profiles"  # name -> RunView of the profiles loaded on the Profiles page

REFRESH_SECONDS = 0.5  # a live run's charts redraw at most this often (and once at its end)
UI_SHARE = 1 / 3  # ...and slower when drawing would take more than this share of the time


def profiles_dir() -> Path:
    return Path(os.environ.get(PROFILES_ENV) or ROOT / "profiles")


# --- cached resources --------------------------------------------------------------------------


@st.cache_resource(show_spinner=False, max_entries=4)
def loaded_model(name: str, backend: str, device: str | None) -> LoadedModel:
    """One model object per (name, backend, device), shared by every session."""
    return load(name, backend, device)


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
    from cachelib.models import available_devices

    return available_devices(backend)


@st.cache_data(show_spinner=False, max_entries=32)
def _view_of_file(path: str, mtime_ns: int, size: int, name: str) -> RunView:
    return run_view(load_profile(path, name=Path(path).name), name)


def view_of_file(f: "ProfileFile") -> RunView:
    """A profile file's tables, parsed once per version of the file (mtime and size key the cache).
    The session keeps the view object, so figures drawn from it are kept too."""
    s = f.path.stat()
    key = (str(f.path), s.st_mtime_ns, s.st_size, f.label)
    views = st.session_state.setdefault("_file_views", {})
    if key not in views:
        views[key] = _view_of_file(*key)
    return views[key]


def combined(views: dict[str, RunView]) -> RunView:
    """``combine`` of the loaded views, kept while the same views stay loaded."""
    key = tuple((name, id(v)) for name, v in views.items())
    kept = st.session_state.get("_combined")
    if kept is None or kept[0] != key:
        kept = (key, combine(list(views.values())))
        st.session_state["_combined"] = kept
    return kept[1]


@st.cache_data(show_spinner=False, max_entries=16)
def view_of_upload(data: bytes, name: str) -> RunView:
    """An uploaded profile's tables (the bytes key the cache)."""
    return run_view(load_profile(data, name=name), name.removesuffix(".csv"))


@st.cache_data(show_spinner=False, max_entries=512)
def _meta_of_file(path: str, mtime_ns: int, size: int) -> dict[str, str]:
    meta: dict[str, str] = {}
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, [])
        if not {"table", "key", "value"} <= set(header):
            raise ValueError("not a cachelib profile (no table/key/value columns)")
        t, k, v = header.index("table"), header.index("key"), header.index("value")
        for row in reader:
            if len(row) > max(t, k, v) and row[t] == "meta":
                meta[row[k]] = row[v]  # the closing rows come last and win
    if "schema_version" not in meta:
        raise ValueError("not a cachelib profile (no metadata)")
    return meta


def meta_of_file(path: Path) -> dict[str, str]:
    """The metadata rows of a profile file without typing its tables (for listings)."""
    s = path.stat()
    return _meta_of_file(str(path), s.st_mtime_ns, s.st_size)


# --- the profile folder ------------------------------------------------------------------------


@dataclass(frozen=True)
class ProfileFile:
    name: str  # "run.csv" or "sweep/run.csv"
    path: Path
    folder: str  # "" or the sweep folder

    @property
    def label(self) -> str:
        """How charts name this profile: "run" or "sweep/run"."""
        return self.name.removesuffix(".csv")


def list_profiles(folder: Path | None = None) -> list[ProfileFile]:
    """``profiles/*.csv`` and the runs of sweep folders ``profiles/*/*.csv`` (not their index)."""
    folder = folder or profiles_dir()
    if not folder.is_dir():
        return []
    out = [ProfileFile(p.name, p, "") for p in sorted(folder.glob("*.csv")) if not p.name.startswith(".")]
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for p in sorted(sub.glob("*.csv")):
            if p.name != "index.csv" and not p.name.startswith("."):
                out.append(ProfileFile(f"{sub.name}/{p.name}", p, sub.name))
    return out


def listing(files: list[ProfileFile]) -> pd.DataFrame:
    """One row per file: what ran, and whether it finished (with the reason when it did not)."""
    rows = []
    for f in files:
        row: dict[str, Any] = {"profile": f.name}
        try:
            m = meta_of_file(f.path)
        except (ValueError, OSError, UnicodeDecodeError, csv.Error) as e:
            row.update(status="not a profile", reason=str(e))
        else:
            status = m.get("status", "")
            reason = m.get("reason", "")
            if status == "running":
                status, reason = "incomplete", reason or "the run ended before it could close the profile"
            row.update(
                status=status,
                reason=reason,
                model=m.get("model", ""),
                backend=m.get("backend", ""),
                strategies=", ".join(_json_list(m.get("strategies", ""))),
                steps=m.get("steps_completed", ""),
                created=m.get("created", ""),
            )
        rows.append(row)
    cols = ["profile", "status", "reason", "model", "backend", "strategies", "steps", "created"]
    return pd.DataFrame(rows, columns=cols)


def _json_list(text: str) -> list[str]:
    import json

    try:
        value = json.loads(text)
    except ValueError:
        return [text] if text else []
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


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


# --- the live run ------------------------------------------------------------------------------


class LiveRun:
    """One profiling run in a background thread, readable while it goes."""

    def __init__(self, loaded: LoadedModel, strategies: list[str], out: Path, name: str, **options: Any):
        self.loaded = loaded
        self.strategies = strategies
        self.out = out
        self.name = name
        self.options = options  # prompt= or text=, max_tokens=, free_running=, probes=, memory_limit=
        self.total = int(options.get("max_tokens", 0))
        self.stop_event = threading.Event()
        self.started = time.perf_counter()
        self.first_step_at: float | None = None  # seconds after start when step 0 was recorded
        self.profile: Profile | None = None  # the profile being filled (set at step 0)
        self.result: Profile | None = None
        self.error = ""
        self.waiting = False  # another session's run holds the lock
        self.orphaned = False  # stopped because its browser session went away
        self.session_id: str | None = None
        self.done = threading.Event()
        self.refreshes: list[float] = []  # when the page drew new data (UI thread)
        self.min_gap = REFRESH_SECONDS  # seconds between two snapshots (grows when drawing is slow)
        self.drawn_view: RunView | None = None  # the snapshot the page drew last
        self.collected = False  # its result was made the current run
        self._view_at = 0.0
        self._marks: tuple[int, dict[str, int]] = (-1, {})  # (last step, rows per table) at a step end
        self._built: dict[str, int] = {}
        self._frames: dict[str, pd.DataFrame] = {}
        self._view: tuple[int, RunView] | None = None
        self._thread = threading.Thread(target=self._work, name=f"cachelib-run-{name}", daemon=True)

    def start(self, lock: threading.Lock) -> "LiveRun":
        from streamlit.runtime.scriptrunner import get_script_run_ctx

        ctx = get_script_run_ctx()
        self.session_id = ctx.session_id if ctx is not None else None
        self._lock = lock
        self._thread.start()
        return self

    # worker thread ------------------------------------------------------------------------------

    def _should_stop(self) -> bool:
        """Stop asked, or the browser session that started the run is gone (a closed tab or a
        reload would otherwise keep decoding, and hold the lock, to the last token)."""
        if self.stop_event.is_set():
            return True
        if self.session_id is not None and not _session_alive(self.session_id):
            self.orphaned = True
            return True
        return False

    def _work(self) -> None:
        while not self._lock.acquire(timeout=0.25):
            self.waiting = True
            if self._should_stop():
                self.waiting = False
                self.done.set()
                return
        self.waiting = False
        try:
            self.result = run_profile(
                self.loaded,
                self.strategies,
                out=self.out,
                name=self.name,
                on_step=self._on_step,
                should_stop=self._should_stop,
                **self.options,
            )
        except ValueError as e:
            self.error = str(e)
        except Exception as e:  # shown to the user as one line; the partial profile is kept
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self._lock.release()
            self.done.set()

    def _on_step(self, event: StepEvent) -> None:
        if self.profile is None:
            self.profile = event.profile
            self.first_step_at = time.perf_counter() - self.started
        # Row counts at a step boundary: the UI reads rows only up to here, so it never sees
        # half a step while the next one is being appended.
        self._marks = (event.step, {t: len(event.profile.rows(t)) for t in TABLES})

    # UI thread ----------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return not self.done.is_set()

    @property
    def step(self) -> int:
        """The last step recorded (-1: none yet)."""
        return self._marks[0]

    def stop(self) -> None:
        self.stop_event.set()

    @property
    def final(self) -> Profile | None:
        """The finished profile: the result, or what a failed or stopped run recorded."""
        if self.running:
            return None
        return self.result or (self.profile if self.step >= 0 else None)

    def view(self) -> RunView | None:
        """What has been recorded so far (None before step 0)."""
        final = self.final
        step, marks = self._marks
        if step < 0:
            return None
        key = step if final is None else -2
        if self._view is not None:
            # The decode thread shares the interpreter: drawing too often would slow it down.
            fresh_enough = final is None and time.perf_counter() - self._view_at < self.min_gap
            if self._view[0] == key or fresh_enough:
                return self._view[1]
        if final is not None and final is self.result:
            view = run_view(final, self.name)
        else:
            view = run_view(self.profile, self.name, tables=self._snapshot(marks))
        self._view = (key, view)
        self._view_at = time.perf_counter()
        return view

    def _snapshot(self, marks: dict[str, int]) -> dict[str, pd.DataFrame]:
        out = {}
        for t in TABLES:
            n, built = marks.get(t, 0), self._built.get(t, 0)
            if n > built or t not in self._frames:
                chunk = Profile()
                chunk.add(t, self.profile.rows(t)[built:n])
                new = chunk.frame(t)
                old = self._frames.get(t)
                self._frames[t] = new if old is None or not len(old) else pd.concat([old, new], ignore_index=True)
                self._built[t] = n
            out[t] = self._frames[t]
        return out

    def note_refresh(self, seconds: float) -> None:
        """The page drew a new snapshot in ``seconds``: space the next ones accordingly."""
        self.refreshes.append(time.perf_counter() - self.started)
        self.min_gap = max(REFRESH_SECONDS, seconds / UI_SHARE)

    def rate_text(self) -> str:
        elapsed = time.perf_counter() - self.started
        steps = self.step + 1
        parts = [f"step {max(steps, 0)}/{self.total}", f"{elapsed:.1f} s"]
        if self.first_step_at is not None and steps > 1:
            rate = (steps - 1) / max(1e-9, elapsed - self.first_step_at)
            parts.append(f"{rate:.1f} steps/s ({len(self.strategies)} strategies each)")
        if len(self.refreshes) > 1:
            gaps = pd.Series(self.refreshes).diff().dropna()
            parts.append(f"charts refreshed {len(self.refreshes)} times, every {gaps.mean():.2f} s")
        return " · ".join(parts)


def _session_alive(session_id: str) -> bool:
    from streamlit import runtime

    if not runtime.exists():  # AppTest and bare mode: no sessions to lose
        return True
    return runtime.get_instance().is_active_session(session_id)


def start_run(loaded: LoadedModel, strategies: list[str], name: str, **options: Any) -> LiveRun:
    out = profiles_dir() / f"{name}.csv"
    run = LiveRun(loaded, strategies, out, name, **options).start(run_lock())
    st.session_state[LIVE] = run
    return run


def collect(run: LiveRun | None) -> None:
    """Move a finished run that recorded something into the current results (once)."""
    if run is None or run.running or run.collected:
        return
    run.collected = True
    final = run.final
    if final is not None:
        st.session_state[CURRENT] = (final, run.view())


def current() -> tuple[Profile, RunView] | None:
    return st.session_state.get(CURRENT)
