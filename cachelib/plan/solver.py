"""What fits in a memory budget: maximum context, maximum batch and concurrent sessions per
strategy, the headroom left, and the reverse (the budget a workload needs);
:func:`cachelib.plan.request.plan` asks these for each strategy of a request.

Memory model, per device: ``budget = weights + overhead + reserve + activations + cache``
(:class:`~cachelib.plan.device.DeviceMemory`): the weights at their precision and share of the
deployment, what the runtime holds outside arrays, what the caller keeps free, the activation
peak of the run's worst forward (:func:`~cachelib.plan.device.run_activation_peak`) and the
cache's device peak (the worst moment of the run, transient copies included;
:attr:`~cachelib.plan.accounting.Account.peak_bytes`). A batch of ``b`` needs ``b`` times the
cache and the activations of one row. Concurrent sessions are independent caches of batch 1:
``n`` fit when ``n - 1`` of them sit at their largest between-update footprint while one goes
through its peak (and its forward's activations). Cache bytes are exact (see
:mod:`cachelib.plan.accounting`); the activations are a model checked against measured peaks
(``bench/bench_peak.py``). Messages write memory in GiB (2^30 bytes).

Quality is not measured here: a :class:`Quality` (mean KL and top-1 agreement against the full
cache, and the model they were measured on) can be attached to each :class:`Fit` by
:func:`attach_quality`, from whatever table of measured profiles the caller has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, Mapping

from ..core.units import STEP, human_gib
from ..spec import Spec, parse_spec
from .accounting import Account, Replay, account, replay
from .arch import Arch
from .device import DeviceMemory
from .runtimes import Deployment

NO_LIMIT = 1 << 40  # tokens: a context limit that never binds (search memory alone)


@dataclass(frozen=True)
class Quality:
    """The quality price of a strategy, measured against the full cache on real runs."""

    mean_kl: float  # mean KL(full || strategy) of the next-token distribution
    top1_agreement: float  # share of steps whose top-1 token equals the full cache's
    model: str  # the model it was measured on (it may differ from the one planned)
    source: str = ""  # the evaluation(s) or profile(s) it comes from
    context: int | None = None  # the context (tokens) it was measured at
    backend: str = ""  # the backend it was measured on
    kept_fraction: float | None = None  # share of that context the strategy's attention still saw
    samples: int = 0  # windows x texts (or runs) averaged
    mean_kl_ci95: float | None = None  # 95% confidence half-widths; None: one sample
    top1_ci95: float | None = None
    delta_ppl: float | None = None  # perplexity minus the full cache's
    delta_ppl_ci95: float | None = None
    retrieval: float | None = None  # exact-match accuracy of the retrieval task
    note: str = ""  # how it was matched to the plan: kept fraction, extrapolation, other backend/model


@dataclass(frozen=True)
class Fit:
    """One strategy against one workload (batch x context) and, if given, one budget."""

    spec: str
    cache: Account  # the cache after the run, and its peaks
    weights_bytes: int | None
    reserve_bytes: int
    budget_bytes: int | None
    max_context: int | None  # None: no budget given, or memory never binds (see context_limit)
    context_limit: str  # "memory" | "unbounded" | "max_len" | "" (no budget)
    max_batch: int | None
    sessions: int | None  # concurrent sessions of this context (batch 1 each)
    quality: Quality | None = None
    activation_bytes: int = 0  # the run's worst forward, whole batch (one device)
    overhead_bytes: int = 0  # what the runtime holds outside arrays (one device)
    device: DeviceMemory | None = None  # every term counted, with where each comes from

    @property
    def budget_needed(self) -> int | None:
        """Weights + overhead + reserve + activations + the cache's peak (one device); None
        when the weights are unknown."""
        if self.weights_bytes is None:
            return None
        return (
            self.weights_bytes
            + self.overhead_bytes
            + self.reserve_bytes
            + self.activation_bytes
            + self.cache.peak_bytes
        )

    @property
    def headroom_bytes(self) -> int | None:
        """Budget left at the run's worst moment (negative: it does not fit)."""
        if self.budget_bytes is None or self.budget_needed is None:
            return None
        return self.budget_bytes - self.budget_needed

    @property
    def fits(self) -> bool | None:
        headroom = self.headroom_bytes
        return None if headroom is None else headroom >= 0


def weight_bytes(arch: Arch, bits: float = 16) -> int:
    """Weight bytes as parameter count x ``bits`` / 8 (e.g. 4.5 for 4-bit weights with group
    scales)."""
    if not bits or bits <= 0:
        raise ValueError(f"weight bits must be positive, got {bits!r}")
    if arch.num_params is None:
        raise ValueError(
            f"{arch.name} has no parameter count; give the weights' memory instead (--weights-memory, or "
            "weights_bytes=)"
        )
    return math.ceil(arch.num_params * bits / 8)


def cache_budget(budget_bytes: int, weights_bytes: int, reserve_bytes: int = 0, overhead_bytes: int = 0) -> int:
    """Bytes one device leaves for the cache and the activations (budget - weights - overhead -
    reserve); a budget that does not hold the weights (+ overhead + reserve) is refused."""
    for name, v in (
        ("budget", budget_bytes),
        ("weights", weights_bytes),
        ("reserve", reserve_bytes),
        ("overhead", overhead_bytes),
    ):
        if v < 0:
            raise ValueError(f"{name} must be >= 0 bytes, got {v}")
    if budget_bytes <= weights_bytes:
        raise ValueError(
            f"budget {human_gib(budget_bytes)} per device is below the weights on one device "
            f"({human_gib(weights_bytes)}): nothing is left for the cache; raise the budget, quantize the "
            "weights (--weights-dtype) or split them (--tp, --pp)"
        )
    left = budget_bytes - weights_bytes - reserve_bytes - overhead_bytes
    if left <= 0:
        raise ValueError(
            f"budget {human_gib(budget_bytes)} per device holds the weights ({human_gib(weights_bytes)}) but not "
            f"the reserve ({human_gib(reserve_bytes)}) and the runtime's overhead ({human_gib(overhead_bytes)}); "
            "lower the reserve or raise the budget"
        )
    return left


def _peak(arch, spec, context, batch, backend, dtype, prefill, prefill_chunk, deployment=None) -> int:
    p = None if prefill is None else min(prefill, context)
    return account(
        arch,
        spec,
        backend,
        context=context,
        prefill=p,
        prefill_chunk=prefill_chunk,
        batch=batch,
        dtype=dtype,
        deployment=deployment,
    ).peak_bytes


def max_context(
    arch: Arch,
    spec: str | Spec,
    available_bytes: int,
    *,
    batch: int = 1,
    backend: str = "mlx",
    dtype: str = "float16",
    prefill: int | None = None,
    prefill_chunk: int | None = None,
    limit: int | None = None,
    deployment: Deployment | None = None,
) -> tuple[int | None, str]:
    """The longest context ``n`` such that every run of at most ``n`` tokens keeps its cache
    peak within ``available_bytes``, and what binds: ``(n, "memory")``; ``(max_len, "max_len")``
    for a static cache; ``(limit, "model")`` when memory allows every run up to ``limit`` tokens
    (default: the model's ``max_position_embeddings``; pass :data:`NO_LIMIT` to search memory
    alone); ``(None, "unbounded")`` when the cache stops changing (bounded strategies, recurrent
    models) and memory never binds.

    A run of ``n`` tokens has a prompt of ``min(prefill, n)`` tokens (default: all ``n``) fed in
    ``prefill_chunk`` chunks, then 1-token decode steps. Runs of growing length share their
    updates, so one replay walks them all: chunk by chunk, and through decode stretches by
    bisection (peaks never fall inside a regular stretch). Time grows with the number of growth
    events up to the answer, not with tokens."""
    spec = parse_spec(spec)
    cap = limit if limit is not None else (arch.max_position_embeddings or NO_LIMIT)
    if cap < 1:
        raise ValueError(f"limit must be >= 1 token, got {cap}")
    if spec.max_context is not None:  # a longer run is refused: only the longest allowed one counts
        most = spec.max_context
        fits = _peak(arch, spec, most, batch, backend, dtype, prefill, prefill_chunk, deployment) <= available_bytes
        return (most, spec.strategy.max_context) if fits else (0, "memory")
    if deployment is not None and prefill_chunk is None:
        prefill_chunk = deployment.prefill_chunk
    run = replay(arch, spec, backend, batch=batch, dtype=dtype, deployment=deployment)
    prompt = cap if prefill is None else min(prefill, cap)
    chunk = prefill_chunk or (prompt if prefill is not None else None)
    if chunk is None:  # each run is one update of its whole length
        return _bisect_update(run, 0, cap, available_bytes, cap)
    context = 0
    quiet: list[tuple] = []  # the last updates' byte signatures, to spot a bounded cache's fixed point
    window = 3 + -(-STEP // chunk)
    while context < prompt:
        n = min(chunk, prompt - context)
        if n == 1:
            found = _walk_single_steps(run, context, prompt, available_bytes, cap)
            if found is not None:
                return found
            context = prompt
            break
        # a run ending one token into this chunk takes the 1-token path (e.g. a ring's in-place
        # growth), whose peak may pass longer partial chunks'
        if run.copy().update(1, "prefill", False).peak_bytes > available_bytes:
            return context, "memory"
        twin = run.copy()
        step = twin.update(n, "prefill", False)
        if step.peak_bytes > available_bytes:
            return _bisect_update(run, context, n - 1, available_bytes, cap)
        run, context = twin, context + n
        if run.bounded() and prefill is None:
            quiet = [*quiet[-(window - 1) :], (step.tokens, step.bytes_allocated, step.peak_bytes, step.device_bytes)]
            if len(quiet) == window and len(set(quiet)) == 1:
                return None, "unbounded"
    if context >= cap:
        return _at_limit(cap)
    return _walk_single_steps(run, context, cap, available_bytes, cap)


def _at_limit(cap: int) -> tuple[int | None, str]:
    return (None, "unbounded") if cap >= NO_LIMIT else (cap, "model")


def _bisect_update(run: Replay, context: int, most: int, available: int, cap: int) -> tuple[int | None, str]:
    """The largest ``r <= most`` such that single updates of 1..r tokens from ``run`` all fit
    (peaks grow with ``r`` from 2 on; 1 token may take another path, so it is checked alone)."""

    def fits(r: int) -> bool:
        return run.copy().update(r, "prefill", False).peak_bytes <= available

    if most < 1 or not fits(1):
        return context, "memory"
    if fits(most):
        return _at_limit(cap) if context + most >= cap else (context + most, "memory")
    lo, hi = 1, most  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return context + lo, "memory"


def _walk_single_steps(run: Replay, context: int, end: int, available: int, cap: int) -> tuple[int | None, str] | None:
    """Walk 1-token updates from ``context`` to ``end``: the answer if one does not fit, if the
    cache settles, or at ``cap``; None when all of them fit short of ``cap``. Mutates ``run``."""

    def peak_at(j: int) -> int:  # the j-th step (1-based) of the coming regular stretch
        twin = run.copy()
        if j > 1:
            twin.skip(j - 1)
        return twin.update(1, "decode", False).peak_bytes

    while context < end:
        if run.settled():
            return (None, "unbounded") if peak_at(1) <= available else (context, "memory")
        k = min(run.regular_steps(), end - context)
        if k >= 2:
            if peak_at(k) <= available:
                run.skip(k - 1)
                run.update(1, "decode", False)
                context += k
                continue
            lo, hi = 0, k  # peak_at(hi) does not fit
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if peak_at(mid) <= available else (lo, mid)
            return context + lo, "memory"
        if peak_at(1) > available:
            return context, "memory"
        run.update(1, "decode", False)
        context += 1
    return _at_limit(cap) if context >= cap else None


def max_batch(
    arch: Arch,
    spec: str | Spec,
    available_bytes: int,
    *,
    context: int,
    backend: str = "mlx",
    dtype: str = "float16",
    prefill: int | None = None,
    prefill_chunk: int | None = None,
    deployment: Deployment | None = None,
    row_bytes: int = 0,
) -> int:
    """The largest batch whose cache peak fits, with ``row_bytes`` more per batch row (the
    activations of one row); every cache array has a batch axis, so bytes scale exactly with it."""
    return batch_count(
        _peak(arch, spec, context, 1, backend, dtype, prefill, prefill_chunk, deployment) + row_bytes, available_bytes
    )


def batch_count(peak_bytes: int, available_bytes: int) -> int:
    """:func:`max_batch` from the run's peak at batch 1."""
    return available_bytes // peak_bytes if peak_bytes else 0


def max_sessions(
    arch: Arch,
    spec: str | Spec,
    available_bytes: int,
    *,
    context: int,
    backend: str = "mlx",
    dtype: str = "float16",
    prefill: int | None = None,
    prefill_chunk: int | None = None,
    deployment: Deployment | None = None,
    forward_bytes: int = 0,
) -> int:
    """How many independent sessions of ``context`` tokens fit: one at its peak (with
    ``forward_bytes`` of activations), the others at their largest footprint between updates."""
    p = None if prefill is None else min(prefill, context)
    acc = account(
        arch, spec, backend, context=context, prefill=p, prefill_chunk=prefill_chunk, dtype=dtype, deployment=deployment
    )
    return session_count(acc.peak_bytes + forward_bytes, acc.max_resident_bytes, available_bytes)


def session_count(peak_bytes: int, max_resident_bytes: int, available_bytes: int) -> int:
    """:func:`max_sessions` from one session's peak and largest resident footprint."""
    if peak_bytes > available_bytes:
        return 0
    if max_resident_bytes == 0:
        return 0  # nothing cached: sessions are not limited by the cache; report none rather than infinity
    return 1 + (available_bytes - peak_bytes) // max_resident_bytes


def budget_needed(
    arch: Arch,
    spec: str | Spec,
    *,
    context: int,
    weights_bytes: int,
    batch: int = 1,
    sessions: int = 1,
    reserve_bytes: int = 0,
    backend: str = "mlx",
    dtype: str = "float16",
    prefill: int | None = None,
    prefill_chunk: int | None = None,
    deployment: Deployment | None = None,
    activation_bytes: int = 0,
) -> int:
    """The smallest budget that holds the weights, the reserve, the activations of one forward
    and ``sessions`` concurrent runs of ``batch`` x ``context`` (one at its peak, the rest at
    their largest resident footprint)."""
    if sessions < 1:
        raise ValueError(f"sessions must be >= 1, got {sessions}")
    p = None if prefill is None else min(prefill, context)
    acc = account(
        arch,
        spec,
        backend,
        context=context,
        prefill=p,
        prefill_chunk=prefill_chunk,
        batch=batch,
        dtype=dtype,
        deployment=deployment,
    )
    return weights_bytes + reserve_bytes + activation_bytes + acc.peak_bytes + (sessions - 1) * acc.max_resident_bytes


def attach_quality(fits: Iterable[Fit], table: Mapping[str | Spec, Quality]) -> list[Fit]:
    """The fits with ``quality`` set from ``table`` (keyed by spec; specs are compared by meaning,
    so ``"rotating:keep=4,max_size=512"`` and ``"rotating:max_size=512"`` match, :attr:`Spec.key`)."""
    by_spec = {parse_spec(k).key: q for k, q in table.items()}
    return [replace(f, quality=by_spec.get(parse_spec(f.spec).key, f.quality)) for f in fits]
