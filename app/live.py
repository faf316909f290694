"""A profiling run in a background thread, readable while it goes.

The page stays responsive: one fragment polls the run's progress twice a second, another redraws
the charts from a consistent snapshot every ``CHART_SECONDS`` (and as soon as step 0 is in), and
Stop sets an event the profiler checks before every step (``should_stop``), which keeps what was
recorded. The thread never calls Streamlit; the page reads its fields. Runs of all sessions share
one lock, so two sessions never decode on the same model object at once.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from streamlit import runtime
from streamlit.runtime.scriptrunner import get_script_run_ctx

from cachelib.core.blas import openblas
from cachelib.core.threads import release_thread_streams
from cachelib.models import LoadedModel
from cachelib.profile import Probes, Profile, StepEvent, run_profile
from cachelib.spec import Spec

from .data import TABLES, RunView, run_view

PROGRESS_SECONDS = 0.5  # the progress bar and rate of a live run refresh this often
# The charts redraw this often (and at the first step and the end). Each redraw of a changed
# plotly figure costs the browser a fresh plot, ~0.1-0.2 CPU seconds a chart on a 2-core
# machine, on the cores the decode needs (bench/bench_app.py).
CHART_SECONDS = 2.0
UI_SHARE = 1 / 3  # ...and slower when building the figures takes more than this share of the time


@dataclass(frozen=True)
class RunOptions:
    """What a live run passes to :func:`cachelib.profile.run_profile` besides the model, the
    strategies and where to write: the input (a chat prompt or an evaluation text), how long,
    and what to record."""

    prompt: str | None = None
    text: str | None = None
    max_tokens: int = 64
    free_running: bool = False
    one_by_one: bool = False  # True: every strategy by its own forward (default: one strategy batch)
    probes: Probes = field(default_factory=Probes)
    memory_limit: int | None = None  # bytes


class LiveRun:
    """One profiling run in a background thread, readable while it goes."""

    def __init__(self, loaded: LoadedModel, strategies: list[Spec], out: Path, name: str, options: RunOptions):
        self.loaded = loaded
        self.strategies = strategies
        self.out = out
        self.name = name
        self.options = options
        self.total = options.max_tokens
        self.stop_event = threading.Event()
        self.started = time.perf_counter()
        self.first_step_at: float | None = None  # seconds after start when step 0 was recorded
        self.ended_at: float | None = None  # seconds after start when the run ended (its clock stops)
        self.last_step_at: float | None = None  # seconds after start when the last step was recorded
        self.profile: Profile | None = None  # the profile being filled (set at step 0)
        self.result: Profile | None = None
        self.error = ""
        self.waiting = False  # another session's run holds the lock
        self.orphaned = False  # stopped because its browser session went away
        self.session_id: str | None = None
        self.done = threading.Event()
        self.refreshes: list[float] = []  # when the page drew new data (UI thread)
        self.min_gap = 0.0  # seconds between two snapshots (> 0 when building the figures is slow)
        self.drawn_view: RunView | None = None  # the snapshot the page drew last
        self._first_draw_asked = False
        self.collected = False  # its result was made the current run
        self._view_at = 0.0
        self._marks: tuple[int, dict[str, int]] = (-1, {})  # (last step, rows per table) at a step end
        self._built: dict[str, int] = {}
        self._frames: dict[str, pd.DataFrame] = {}
        self._view: tuple[int, RunView] | None = None
        self._thread = threading.Thread(target=self._work, name=f"cachelib-run-{name}", daemon=True)

    def start(self, lock: threading.Lock) -> "LiveRun":
        if runtime.exists():  # a real server (AppTest runs in the test process: leave its BLAS alone)
            leave_a_core()
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
                self.ended_at = time.perf_counter() - self.started
                self.done.set()
                return
        self.waiting = False
        try:
            o = self.options
            self.result = run_profile(
                self.loaded,
                self.strategies,
                prompt=o.prompt,
                text=o.text,
                max_tokens=o.max_tokens,
                free_running=o.free_running,
                one_by_one=o.one_by_one,
                probes=o.probes,
                memory_limit=o.memory_limit,
                out=self.out,
                name=self.name,
                on_step=self._on_step,
                should_stop=self._should_stop,
            )
        except ValueError as e:
            self.error = str(e)
        except Exception as e:  # shown to the user as one line; the partial profile is kept
            self.error = f"{type(e).__name__}: {e}"
        finally:
            try:
                release_thread_streams()  # last MLX call of this thread (MLX asks it of a thread)
            finally:
                self._lock.release()
                self.ended_at = time.perf_counter() - self.started
                self.done.set()

    def _on_step(self, event: StepEvent) -> None:
        if self.profile is None:
            self.profile = event.profile
            self.first_step_at = time.perf_counter() - self.started
        # Row counts at a step boundary: the UI reads rows only up to here, so it never sees
        # half a step while the next one is being appended.
        self._marks = (event.step, {t: len(event.profile.rows(t)) for t in TABLES})
        self.last_step_at = time.perf_counter() - self.started

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

    def first_draw_due(self) -> bool:
        """True once, when step 0 is recorded and no chart is drawn yet: the page then redraws
        at once instead of waiting for the charts' next refresh."""
        if self.step < 0 or self.drawn_view is not None or self._first_draw_asked:
            return False
        self._first_draw_asked = True
        return True

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
        self.min_gap = seconds / UI_SHARE

    def rate_text(self) -> str:
        """The status line: steps, seconds, steps/s. A finished run's numbers are its own (the
        clock stops when the run ends, however much later the page is drawn)."""
        ended = self.ended_at if self.done.is_set() else None
        elapsed = ended if ended is not None else time.perf_counter() - self.started
        steps = self.step + 1
        parts = [f"step {max(steps, 0)}/{self.total}", f"{elapsed:.1f} s" + (" in all" if ended is not None else "")]
        if self.first_step_at is not None and steps > 1:
            # Decode steps after the first, over the time they took (the prefill and step 0 excluded).
            until = self.last_step_at if ended is not None and self.last_step_at is not None else elapsed
            rate = (steps - 1) / max(1e-9, until - self.first_step_at)
            parts.append(f"{rate:.1f} steps/s ({len(self.strategies)} strategies each)")
        if len(self.refreshes) > 1:
            gaps = pd.Series(self.refreshes).diff().dropna()
            parts.append(f"charts refreshed {len(self.refreshes)} times, every {gaps.mean():.2f} s")
        if self.profile is not None and self.profile.meta.get("batch"):
            parts.append(batch_text(self.profile.meta))
        return " · ".join(parts)


def batch_text(meta: dict) -> str:
    """How a profile's strategies ran: one strategy batch (which rows) or one by one, and which
    ran on their own (from the metadata ``batch``, ``batched``, ``batch_notes``)."""
    batched = json.loads(meta.get("batched") or "[]")
    notes = json.loads(meta.get("batch_notes") or "{}")
    text = f"{len(batched)} strategies in one batch, one forward per step" if batched else "one by one"
    if notes:
        text += "; on its own: " + ", ".join(notes)
    return text


@functools.cache
def leave_a_core() -> int | None:
    """Give OpenBLAS, which MLX multiplies with on a Linux CPU (:mod:`cachelib.core.blas`), one
    thread fewer than this process's cores, at least one; returns the thread count set, or None
    where the process has no OpenBLAS. Once per process.

    The browser drawing a live run shares the machine. With a thread on every core, each
    multiply waits for the thread the browser (or the page's script) has pushed off its core:
    on 2 cores a three-strategy decode spent 0.31 CPU seconds a step against 0.18 with one
    thread, and was slower even without a browser on a machine busy with other work
    (bench/README.md, "The app"). ``CACHELIB_APP_BLAS_THREADS=N`` sets the count instead; 0
    leaves OpenBLAS as it is."""
    lib = openblas()
    if lib is None:  # macOS (Accelerate), or no OpenBLAS
        return None
    given = os.environ.get("CACHELIB_APP_BLAS_THREADS", "").strip()
    if given:
        if not given.isdigit():
            raise ValueError(
                f"CACHELIB_APP_BLAS_THREADS must be a whole number (0 = leave OpenBLAS as it is), got {given!r}"
            )
        if int(given) == 0:
            return None
        threads = int(given)
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores - 1)
    lib.openblas_set_num_threads(threads)
    return threads


def _session_alive(session_id: str) -> bool:
    if not runtime.exists():  # AppTest and bare mode: no sessions to lose
        return True
    return runtime.get_instance().is_active_session(session_id)
