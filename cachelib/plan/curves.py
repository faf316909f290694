"""The planner over a range of contexts, for charts: per strategy, the cache's bytes at the end
of a run and the run's peak (:func:`memory_curves`), and the largest batch and the most
concurrent sessions whose cache fits the budget (:func:`frontier_curves`), at each context of a
grid (:func:`context_grid`).

Every point is what :func:`~cachelib.plan.account`, :func:`~cachelib.plan.max_batch` and
:func:`~cachelib.plan.max_sessions` give for a run of that many tokens, so what
``python -m cachelib plan`` prints for that context. Runs of growing length share their updates,
so one replay per strategy walks the whole grid, jumping over the cycles of equal updates as
``account`` does: the time is bounded by the grid's points and the updates' cycles, whatever the
context (10^12 tokens cost what 10^5 do).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np

from ..spec import Spec
from .accounting import Replay, replay, schedule
from .arch import Arch
from .request import PlanRequest
from .solver import batch_count, session_count

if TYPE_CHECKING:  # annotations only: pandas is imported where a frame is built
    import pandas as pd

GRID_POINTS = 64  # contexts sampled per curve; the asked context is always one of them


def chart_range(context: int, max_position: int | None = None) -> int:
    """The default end of the context axis: twice the asked context, cut to the model's
    context length when that still covers the asked context."""
    end = 2 * context
    if max_position and max_position >= context:
        end = min(end, max_position)
    return end


def context_grid(context: int, end: int, *, points: int = GRID_POINTS, log: bool = False) -> list[int]:
    """About ``points`` contexts from 1 (log) or ``end / points`` (linear) to ``end``, evenly
    (or geometrically) spaced, with ``context`` itself always included."""
    if context < 1 or end < 1:
        raise ValueError(f"context and the chart range must be >= 1 token, got context={context}, end={end}")
    if log:
        grid = np.geomspace(1, end, points)
    else:
        grid = np.linspace(end / points, end, points)
    values = {int(round(x)) for x in grid if x >= 1} | {context, end}
    return sorted(v for v in values if v >= 1)


def memory_curves(arch: Arch, request: PlanRequest, contexts: Sequence[int]) -> pd.DataFrame:
    """Per strategy of ``request`` and context: bytes allocated at the end of the run (its
    workload at that context) and the run's peak. A run the strategy refuses (a static cache
    shorter than the context) is NaN; a strategy that refuses every run raises its error."""
    import pandas as pd  # here, not above: the CLI's plan never draws curves

    rows = []
    for spec in request.strategies:
        points = _walk(arch, spec, request, contexts, batch=request.batch)
        errors = [p for p in points.values() if isinstance(p, ValueError)]
        if contexts and len(errors) == len(points):
            raise points[contexts[0]]
        for n in contexts:
            p = points[n]
            allocated, peak = (np.nan, np.nan) if isinstance(p, ValueError) else (p.bytes_allocated, p.peak_bytes)
            rows.append({"strategy": str(spec), "context": n, "bytes_allocated": allocated, "peak_bytes": peak})
    return pd.DataFrame(rows, columns=["strategy", "context", "bytes_allocated", "peak_bytes"]).astype(
        {"context": "int64", "bytes_allocated": "float64", "peak_bytes": "float64"}
    )


def frontier_curves(arch: Arch, request: PlanRequest, contexts: Sequence[int]) -> pd.DataFrame:
    """Per strategy of ``request`` and context: the largest batch and the most concurrent
    sessions (batch 1 each) whose cache and activations fit what the request's budget leaves. NaN where
    the strategy refuses the run. The request's batch plays no part: bytes scale with it."""
    import pandas as pd  # here, not above: the CLI's plan never draws curves

    available = request.cache_budget(arch)
    if available is None:
        raise ValueError("give a memory budget (--budget) to see what fits")
    rows = []
    for spec in request.strategies:
        points = _walk(arch, spec, request, contexts, batch=1)
        prompt = request.prefill
        shared = points.get(prompt) if prompt in points else None  # the prompt-only run, when on the grid
        if prompt is not None and any(n > prompt for n in contexts) and not isinstance(shared, _Point):
            shared = _walk(arch, spec, request, [prompt], batch=1)[prompt]
        for n in contexts:
            p = points[n]
            if isinstance(p, ValueError):
                most = sessions = np.nan
            else:
                before = shared.peak_bytes if prompt is not None and n > prompt and isinstance(shared, _Point) else None
                extra = request.forward_bytes(
                    arch, spec, context=n, batch=1, run_peak=p.peak_bytes, prompt_peak=before
                )[0]
                row = p.peak_bytes + extra  # as plan counts it
                most = batch_count(row, available)
                sessions = session_count(row, p.max_resident_bytes, available)
            rows.append({"strategy": str(spec), "context": n, "max_batch": most, "sessions": sessions})
    return pd.DataFrame(rows, columns=["strategy", "context", "max_batch", "sessions"]).astype(
        {"context": "int64", "max_batch": "float64", "sessions": "float64"}
    )


# --- one walk per strategy ------------------------------------------------------------------------


class _Point(NamedTuple):
    bytes_allocated: int  # at the end of the run
    peak_bytes: int  # device bytes at the worst moment of the run
    max_resident_bytes: int  # the largest device footprint between updates


class _Run:
    """A replay fed update by update, with the peak and the largest resident footprint so far,
    kept as :func:`~cachelib.plan.account` keeps them."""

    def __init__(self, run: Replay):
        self.run, self.peak, self.resident = run, 0, 0

    @property
    def offset(self) -> int:
        return self.run.offset

    def copy(self) -> _Run:
        twin = _Run(self.run.copy())
        twin.peak, twin.resident = self.peak, self.resident
        return twin

    def feed(self, n: int, count: int, phase: str) -> None:
        """``count`` updates of ``n`` tokens, as :func:`~cachelib.plan.account` feeds them
        (:meth:`~cachelib.plan.accounting.Replay.feed`: cycles jumped over, exactly)."""
        if count > 0:
            peak, resident = self.run.feed(n, count, phase)
            self.peak, self.resident = max(self.peak, peak), max(self.resident, resident)

    def update(self, n: int, phase: str) -> None:
        self.feed(n, 1, phase)

    def singles_to(self, offset: int, phase: str) -> None:
        """1-token updates up to ``offset``."""
        self.feed(1, offset - self.offset, phase)

    def point(self) -> _Point:
        return _Point(self.run.totals()[0], self.peak, self.resident)


def _walk(arch: Arch, spec: Spec, request: PlanRequest, contexts: Sequence[int], *, batch: int) -> dict:
    """Per context, the :class:`_Point` of the run :func:`~cachelib.plan.account` makes for it (a
    prompt of ``min(prefill, n)`` tokens fed in chunks, then 1-token decode steps), or the
    ValueError it raises. Runs share their whole chunks and their decode steps."""
    targets = sorted(set(contexts))
    if not targets:
        return {}
    prefill, chunk = request.prefill, request.chunk or None
    try:
        end = targets[-1]
        schedule(end, None if prefill is None else min(prefill, end), chunk)  # the checks account makes
        empty = _Run(
            replay(arch, spec, request.backend, batch=batch, dtype=request.dtype, deployment=request.deployment)
        )
    except ValueError as e:
        return {n: e for n in targets}
    whole = empty.copy()  # the prompt's whole chunks fed so far, shared by every longer run
    broken: list[ValueError] = []  # a whole chunk refused: every longer run is refused too

    def prompt(n: int) -> _Run:
        """The run after an ``n``-token prompt, fed as :func:`~cachelib.plan.schedule` feeds it."""
        if chunk is None or n == 0:  # one update, or none
            run = empty.copy()
            if n:
                run.update(n, "prefill")
            return run
        if broken:
            raise broken[0]
        try:
            whole.feed(chunk, (n - whole.offset) // chunk, "prefill")
        except ValueError as e:
            broken.append(e)
            raise
        if whole.offset == n:
            return whole
        run = whole.copy()
        run.update(n - whole.offset, "prefill")
        return run

    out: dict[int, _Point | ValueError] = {}
    decode = [n for n in targets if prefill is not None and n > prefill]
    for n in targets[: len(targets) - len(decode)]:  # all prompt
        try:
            out[n] = prompt(n).point()
        except ValueError as e:
            out[n] = e
    if decode:
        try:
            run = prompt(prefill)
            for n in decode:
                run.singles_to(n, "decode")
                out[n] = run.point()
        except ValueError as e:  # a refused step refuses every longer run
            out.update({n: e for n in decode if n not in out})
    return out
