"""Run a sweep: every point of a grid as one Dask task, one profile per point, an index of them all.

``run_sweep(grid, out)`` expands the grid, skips the points a previous run finished (their rows
in ``index.csv`` say done or stopped and their profiles open; a row whose profile does not is
run again, with a note saying why), starts a local cluster (or
connects to ``scheduler``), and submits one task per remaining point, in grid order and no
more at a time than there are workers able to run them (see :class:`_Feeder`). A task runs
``run_profile`` (an evaluation grid's point: ``evaluate``) on its worker and sends the CSV back;
this process writes it into the
sweep folder and rewrites the index after every point, so nothing finished is lost. A task that
raises is retried once (``retries=1``); a task whose worker dies is tried on a second worker and
then marked failed (Dask's ``KilledWorker``). Failures are recorded and the other points go on.

Workers report each attempt's start as a Dask event (topic ``cachelib-sweep``), which is how the
sweep counts attempts and shows what is running.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from .cluster import check_local_devices, has_dashboard, remote_notes, start_local_cluster
from .grid import EvaluationPoint, Grid, Point, load_grid
from .index import (
    FINISHED,
    GRID_FILE,
    check_sweep_folder,
    pending_row,
    profile_problem,
    read_index,
    write_atomic,
    write_index,
)

TOPIC = "cachelib-sweep"
SCHEDULER_TIMEOUT_S = 20
POLL_S = 0.1  # how often the client looks at events and results while it waits
WORKERS_REFRESH_S = 2.0


@dataclass
class SweepEvent:
    """What ``on_event`` receives. ``kind``: cluster (where the sweep runs) | skipped | note (a
    warning about the cluster) | started | done | stopped | failed."""

    kind: str
    point: str = ""
    message: str = ""  # failed / stopped: why; note: the note
    attempt: int = 0
    worker: str = ""
    pid: int | None = None  # process running the attempt (started events)
    seconds: float | None = None  # done / stopped: the run's wall time
    total: int = 0
    done: int = 0  # done or stopped
    failed: int = 0
    running: int = 0

    @property
    def left(self) -> int:
        return self.total - self.done - self.failed


@dataclass
class SweepPlan:
    """A sweep before it runs: its points, their index rows, and which of them still need running."""

    grid: Grid
    folder: Path
    points: list[Point]
    rows: dict[str, dict[str, str]]  # point id -> index row (previous runs' rows included)
    todo: list[Point] = field(default_factory=list)
    reruns: dict[str, str] = field(default_factory=dict)  # point id -> why its finished profile is run again


@dataclass
class SweepResult:
    folder: Path
    rows: list[dict[str, str]]  # index rows of the grid's points, in grid order

    def count(self, status: str) -> int:
        return sum(r["status"] == status for r in self.rows)

    @property
    def ok(self) -> bool:
        return all(r["status"] in FINISHED for r in self.rows)


def plan_sweep(grid: str | os.PathLike | Grid, out: str | os.PathLike | None = None, local: bool = True) -> SweepPlan:
    """Expand ``grid`` and read what ``out`` already holds; runs nothing, writes nothing.

    Backends the grid names no device for take this machine's best device. With ``local``
    every point's device must be present here."""
    grid = grid if isinstance(grid, Grid) else load_grid(grid)
    defaults = {}
    if grid.backends_without_devices():
        from ..models import available_devices

        defaults = {b: available_devices(b)[0] for b in grid.backends_without_devices()}
    points = grid.points(defaults)
    if local:
        check_local_devices(points)
    folder = Path(out) if out is not None else Path("profiles") / grid.name
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--out {str(folder)!r} is a file; give a folder for the sweep")
    rows = read_index(folder)
    todo = []
    reruns = {}
    for p in points:
        row = rows.get(p.id)
        if row is not None and row["status"] in FINISHED:
            check = _evaluation_problem if isinstance(p, EvaluationPoint) else profile_problem
            problem = check(folder, row)
            if not problem:
                continue
            reruns[p.id] = f"point {p.id} was {row['status']} but {problem}; running it again"
        adopted = None if p.id in reruns else _adopt(folder, p)
        if adopted is not None:
            rows[p.id] = adopted
            continue
        rows[p.id] = pending_row(p)
        todo.append(p)
    return SweepPlan(grid, folder, points, rows, todo, reruns)


def _adopt(folder: Path, point: Point) -> dict[str, str] | None:
    """A profile that is in the folder but not in the index (the sweep stopped between writing
    the two) counts as finished."""
    path = folder / point.file
    if not path.exists():
        return None
    if isinstance(point, EvaluationPoint):
        return _adopt_evaluation(path, point)
    from ..profile import load_profile

    try:
        profile = load_profile(path)
    except ValueError:
        return None
    row = pending_row(point)
    row.update(
        status="done" if profile.complete else "stopped",
        file=point.file,
        error="" if profile.complete else str(profile.meta.get("reason", "")),
        started=str(profile.meta.get("created", "")),
        finished=str(profile.meta.get("finished", "")),
    )
    return row


def _adopt_evaluation(path: Path, point: EvaluationPoint) -> dict[str, str] | None:
    from ..profile import load_evaluation

    try:
        load_evaluation(path)  # an evaluation file exists only once its run finished
    except ValueError:
        return None
    row = pending_row(point)
    row.update(status="done", file=point.file)
    return row


def _evaluation_problem(folder: Path, row: dict[str, str]) -> str:
    """Why a finished row's evaluation cannot stand for its point ('' when it opens)."""
    if not row["file"]:
        return "the index names no evaluation file"
    path = Path(folder) / row["file"]
    if not path.is_file():
        return f"its evaluation {row['file']} is missing"
    from ..profile import load_evaluation

    try:
        load_evaluation(path)
    except ValueError as e:
        return f"its evaluation does not open ({e})"
    return ""


def run_sweep(
    grid: str | os.PathLike | Grid,
    out: str | os.PathLike | None = None,
    *,
    scheduler: str | None = None,
    workers: int | None = None,
    on_event: Callable[[SweepEvent], None] | None = None,
    one_by_one: bool = False,
) -> SweepResult:
    """Run every unfinished point of ``grid`` into the folder ``out`` (default ``profiles/NAME/``).

    Without ``scheduler``, a local cluster of ``workers`` CPU worker processes (default: sized to
    this machine) plus one worker per accelerator the points need; with a scheduler address, its
    workers. Each point runs its strategies as one strategy batch unless ``one_by_one``
    (docs/profiler.md). Bad input raises ``ValueError`` before anything runs."""
    if scheduler is not None and workers is not None:
        raise ValueError("workers= sizes the local cluster; with a scheduler its own workers run the sweep")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    plan = plan_sweep(grid, out, local=scheduler is None)
    check_sweep_folder(plan.folder)  # a folder that cannot take the index fails before any cluster starts
    return _Sweep(plan, on_event, one_by_one).run(scheduler, workers)


class _Sweep:
    def __init__(self, plan: SweepPlan, on_event: Callable[[SweepEvent], None] | None, one_by_one: bool = False):
        self.plan = plan
        self.on_event = on_event
        self.one_by_one = one_by_one
        self.token = uuid.uuid4().hex[:8]  # tells this sweep's events from another's on a shared scheduler
        self.events: queue.Queue = queue.Queue()
        self.attempts: dict[str, list[dict]] = {}  # point id -> started events
        total = len(plan.points)
        finished = total - len(plan.todo)
        self.counts = {"total": total, "done": finished, "failed": 0, "running": 0}

    # --- bookkeeping ------------------------------------------------------------------------

    def emit(self, kind: str, point: str = "", **kw: Any) -> None:
        if self.on_event is not None:
            self.on_event(SweepEvent(kind, point, **kw, **self.counts))

    def write_index(self) -> None:
        order = [p.id for p in self.plan.points]
        rest = [pid for pid in self.plan.rows if pid not in set(order)]  # earlier grids' points stay listed
        write_index(self.plan.folder, [self.plan.rows[pid] for pid in order + rest])

    def result(self) -> SweepResult:
        return SweepResult(self.plan.folder, [self.plan.rows[p.id] for p in self.plan.points])

    # --- the run ----------------------------------------------------------------------------

    def run(self, scheduler: str | None, workers: int | None) -> SweepResult:
        plan = self.plan
        if not plan.todo:
            self._start_folder()
            return self.result()

        from distributed import Client

        cluster = None
        try:
            if scheduler is None:
                cluster = start_local_cluster(plan.todo, workers)
                client = Client(cluster)
            else:
                try:
                    client = Client(scheduler, timeout=SCHEDULER_TIMEOUT_S)
                except (OSError, TimeoutError) as e:
                    raise ValueError(f"cannot reach the Dask scheduler at {scheduler!r}: {e}") from None
            try:
                self._start_folder()  # only once there is a cluster to run on
                workers_now = client.scheduler_info(n_workers=-1).get("workers", {})
                where = "local Dask cluster" if scheduler is None else f"Dask scheduler {scheduler}"
                link = _dashboard_link(client) if scheduler is not None or has_dashboard() else None
                dashboard = f"; dashboard {link}" if link else ""
                self.emit("cluster", message=f"{where}: {len(workers_now)} worker(s){dashboard}")
                if scheduler is not None:
                    for note in remote_notes(client, plan.todo):
                        self.emit("note", message=note)
                self._submit_and_collect(client)
            finally:
                client.close()
        finally:
            if cluster is not None:
                cluster.close()
        return self.result()

    def _start_folder(self) -> None:
        """The grid file as run, and the index with every point (pending ones included)."""
        plan = self.plan
        plan.folder.mkdir(parents=True, exist_ok=True)
        write_atomic(plan.folder / GRID_FILE, plan.grid.text.encode("utf-8"))
        self.write_index()
        skipped = len(plan.points) - len(plan.todo)
        if skipped:
            self.emit("skipped", message=f"{skipped} of {len(plan.points)} points finished earlier; skipping them")
        for why in plan.reruns.values():
            self.emit("note", message=why)

    def _submit_and_collect(self, client) -> None:
        from distributed import wait

        client.subscribe_topic(TOPIC, self._on_dask_event)
        feeder = _Feeder(client, self.plan.todo, self.token, self.one_by_one)
        pending: set = set()
        try:
            while True:
                pending |= feeder.top_up()
                if not pending:
                    break
                self._drain_events()
                try:
                    finished, pending = wait(pending, timeout=POLL_S, return_when="FIRST_COMPLETED")
                except TimeoutError:
                    continue
                self._drain_events()  # attempts that started before these ended
                for f in finished:
                    self._record(feeder.done(f), f)
                    f.release()
        except BaseException:
            for f in pending:
                f.cancel()
            self.write_index()
            raise
        finally:
            client.unsubscribe_topic(TOPIC)

    def _on_dask_event(self, event) -> None:  # runs in the client's event loop thread
        _, msg = event
        if isinstance(msg, dict) and msg.get("token") == self.token:
            self.events.put(msg)

    def _drain_events(self) -> None:
        while True:
            try:
                msg = self.events.get_nowait()
            except queue.Empty:
                return
            tries = self.attempts.setdefault(msg["point"], [])
            tries.append(msg)
            if len(tries) == 1:
                self.counts["running"] += 1
            self.emit("started", msg["point"], attempt=len(tries), worker=msg["worker"], pid=msg["pid"])

    def _record(self, point: Point, future) -> None:
        tries = self.attempts.get(point.id, [])
        if tries:
            self.counts["running"] -= 1
        row = self.plan.rows[point.id]
        row.update(attempts=str(max(len(tries), 1)))
        if tries:
            row.update(started=_iso(tries[-1]["time"]), worker=tries[-1]["worker"])
        if future.status == "finished":
            try:
                res = future.result()
            except Exception as e:  # the result could not come back (e.g. the scheduler went away)
                self._failed(point, row, f"result lost: {_one_line(e)}")
                return
            write_atomic(self.plan.folder / point.file, res["csv"])
            status = "done" if res["status"] == "complete" else "stopped"
            row.update(status=status, file=point.file, error=res["reason"] if status == "stopped" else "")
            row.update(started=res["started"], finished=res["finished"], worker=res["worker"])
            self.counts["done"] += 1
            self.write_index()
            self.emit(
                status, point.id, message=row["error"], attempt=len(tries), worker=res["worker"], seconds=res["seconds"]
            )
            return
        if future.status == "error":
            from distributed import KilledWorker

            exc = future.exception()
            if isinstance(exc, KilledWorker):
                n = len(tries) or "its"
                reason = f"KilledWorker: the worker running it died on each of {n} attempts (killed, or crashed)"
            else:
                reason = _one_line(exc)
        else:
            reason = f"cancelled ({future.status}): the scheduler dropped the task"
        self._failed(point, row, reason)

    def _failed(self, point: Point, row: dict[str, str], reason: str) -> None:
        row.update(status="failed", file="", error=reason, finished=_now())
        self.counts["failed"] += 1
        self.write_index()
        self.emit("failed", point.id, message=reason, attempt=int(row["attempts"]), worker=row["worker"])


def _dashboard_link(client) -> str | None:
    try:
        return client.dashboard_link
    except Exception:  # the scheduler runs without a dashboard
        return None


class _Feeder:
    """Submits points in grid order, no more at a time than there are workers able to run them.

    Dask assigns a submitted task to a worker at once, and when a worker dies it counts every
    task assigned to it as a suspect, running or not. Holding the rest back here means a worker
    that dies takes down only the run it was running, and its neighbours' attempts stay honest.
    """

    def __init__(self, client, points: list[Point], token: str, one_by_one: bool = False):
        self.client = client
        self.token = token
        self.one_by_one = one_by_one
        self.waiting: dict[tuple, list[Point]] = {}  # resource class -> points not yet submitted
        for p in points:
            self.waiting.setdefault(_resource_class(p), []).append(p)
        self.running: dict[tuple, int] = dict.fromkeys(self.waiting, 0)
        self.futures: dict[Any, Point] = {}
        self._order = {p.id: i for i, p in enumerate(points)}
        self._capacity: dict[tuple, int] = {}
        self._checked = 0.0

    def capacity(self, cls: tuple) -> int:
        """Workers that can run a point of resource class ``cls`` (read at most every few seconds)."""
        if time.monotonic() - self._checked > WORKERS_REFRESH_S:
            workers = self.client.scheduler_info(n_workers=-1).get("workers", {}).values()
            offered = [w.get("resources") or {} for w in workers]
            self._capacity = {c: sum(all(have.get(r, 0) >= n for r, n in c) for have in offered) for c in self.waiting}
            self._checked = time.monotonic()
        # With no able worker yet, one task waits at the scheduler until a worker joins.
        return max(1, self._capacity.get(cls, 0))

    def top_up(self) -> set:
        new = set()
        for cls, points in self.waiting.items():
            while points and self.running[cls] < self.capacity(cls):
                p = points.pop(0)
                f = self.client.submit(
                    run_point,
                    p,
                    self.token,
                    self.one_by_one,
                    key=f"cachelib-sweep-{p.id}-{self.token}",
                    retries=1,  # an exception: once more; a dead worker: the scheduler's allowed-failures
                    resources=p.resources or None,
                    priority=-self._order[p.id],
                    pure=False,
                )
                self.futures[f] = p
                self.running[cls] += 1
                new.add(f)
        return new

    def done(self, future) -> Point:
        p = self.futures.pop(future)
        self.running[_resource_class(p)] -= 1
        return p


def _resource_class(p: Point) -> tuple:
    return tuple(sorted(p.resources.items()))


# --- on the worker ------------------------------------------------------------------------------

_LOADED: dict[tuple, Any] = {}  # this worker's last model, reused by the next point on the same model


def run_point(point: Point | EvaluationPoint, token: str = "", one_by_one: bool = False) -> dict[str, Any]:
    """Run one point's profile (or evaluation) on this worker; returns its CSV and how the run ended."""
    from distributed import get_worker

    from ..profile import evaluate, run_profile

    try:
        worker = get_worker()
        address = worker.address
        worker.log_event(
            TOPIC, {"token": token, "point": point.id, "worker": address, "pid": os.getpid(), "time": time.time()}
        )
    except ValueError:  # not on a Dask worker (called directly)
        address = ""
    started, t0 = _now(), time.perf_counter()
    kwargs = point.run_kwargs()
    kwargs["one_by_one"] = one_by_one
    try:
        if (point.model, point.backend, point.device) not in _LOADED:  # refused before its model loads
            from ..profile.guard import check_point_fits

            check_point_fits(point, one_by_one=one_by_one)
        kwargs["model"] = _loaded(point)
        with tempfile.TemporaryDirectory(prefix="cachelib-sweep-") as tmp:
            path = Path(tmp) / point.file
            if isinstance(point, EvaluationPoint):
                result = evaluate(**kwargs, out=path)
                status, reason = result.status, result.reason
                path = Path(result.path) if result.path is not None else path  # an unfinished one: NAME.incomplete.csv
            else:
                profile = run_profile(**kwargs, out=path)
                status, reason = profile.status, str(profile.meta.get("reason", ""))
            data = path.read_bytes()
    except BaseException:
        _LOADED.clear()  # a failed run may have left the model in a bad state (e.g. out of memory)
        raise
    return {
        "csv": data,
        "status": status,
        "reason": reason,
        "started": started,
        "finished": _now(),
        "seconds": time.perf_counter() - t0,
        "worker": address,
    }


def _loaded(point: Point):
    from ..models import load

    key = (point.model, point.backend, point.device)
    if key not in _LOADED:
        _LOADED.clear()  # one model per worker: free the last before loading the next
        _LOADED[key] = load(point.model, point.backend, point.device)
    return _LOADED[key]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= 400 else text[:397] + "..."
