"""What a session keeps between reruns: its live run (decoding in the background), its current
results, and the combined view of the profiles it loaded (under the keys of :class:`app.keys.Keys`).
The models live in :mod:`app.shelf`, the profile folder in :mod:`app.files`, exports in :mod:`app.exports`."""

from __future__ import annotations

import threading

import streamlit as st

from cachelib.models import LoadedModel
from cachelib.profile import Profile
from cachelib.spec import Spec

from .data import RunView, combine
from .keys import Keys
from .live import LiveRun, RunOptions
from .profile_folder import profiles_dir


@st.cache_resource(show_spinner=False)
def run_lock() -> threading.Lock:
    return threading.Lock()


def combined(views: dict[str, RunView]) -> RunView:
    """``combine`` of the loaded views, kept while the same views stay loaded."""
    key = tuple((name, id(v)) for name, v in views.items())
    kept = st.session_state.get(Keys.COMBINED)
    if kept is None or kept[0] != key:
        kept = (key, combine(list(views.values())))
        st.session_state[Keys.COMBINED] = kept
    return kept[1]


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
