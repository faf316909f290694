"""Exact KV-cache bytes of a model under a strategy: per layer, in total, and step by step.

:func:`~cachelib.plan.layer_caches.cache_layout` says which cache class each layer gets (slot sizes:
:mod:`cachelib.plan.slot_bytes`); :func:`trace` replays a prefill then 1-token decode steps through
those classes' byte rules (:mod:`cachelib.core.rules`) and records every update; :func:`account`
runs the same replay fast (regular decode stretches are skipped in bulk) and returns the final state
plus the run's peaks. Bytes allocated equal what the real caches report as ``nbytes``; peaks add the
transient copies the rules model.

Offloading follows transformers' ``Cache``: before layer i updates, the next offloaded layer is
prefetched to the device; after its update, layer i goes back to the host. Between steps the
device holds the non-offloaded layers and the first offloaded layer (prefetched by the last).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Iterable, Sequence

from ..core.layout import LayerLayout
from ..core.units import check_dtype
from ..spec import Spec, parse_spec
from .arch import Arch
from .layer_caches import deployment_of, device_layout, layer_rule
from .runtimes import (
    Deployment,
    largest_stage,
    prompt_last_alone,
    stage_arches,
    stages,
)

CYCLE_KEYS = 4096  # distinct cycle keys a feed remembers before it starts looking afresh


# ---------------------------------------------------------------------------------------------
# update schedules


@dataclass(frozen=True)
class Update:
    """``repeat`` consecutive cache updates of ``tokens`` tokens each."""

    tokens: int
    repeat: int = 1
    phase: str = "decode"  # prefill / decode


def _positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def schedule(
    context: int, prefill: int | None = None, prefill_chunk: int | None = None, *, last_alone: bool = False
) -> list[Update]:
    """The updates of a run that ends holding ``context`` tokens: a prompt of ``prefill`` tokens
    (default: all of ``context``) fed in chunks of at most ``prefill_chunk`` tokens (default: one
    update), then ``context - prefill`` one-token decode steps. ``last_alone``: the prompt's last
    token is its own update after the chunks (mlx-lm's ``generate_step``)."""
    context = _positive_int("context", context)
    prefill = context if prefill is None else _positive_int("prefill", prefill, 0)
    if prefill > context:
        raise ValueError(f"prefill={prefill} must be <= context={context}")
    out: list[Update] = []
    if prefill:
        chunked = prefill - 1 if last_alone else prefill
        if chunked:
            chunk = chunked if not prefill_chunk else _positive_int("prefill_chunk", prefill_chunk)
            whole, rest = divmod(chunked, chunk)
            if whole:
                out.append(Update(chunk, whole, "prefill"))
            if rest:
                out.append(Update(rest, 1, "prefill"))
        if last_alone:
            out.append(Update(1, 1, "prefill"))
    if context > prefill:
        out.append(Update(1, context - prefill, "decode"))
    return out


# ---------------------------------------------------------------------------------------------
# the whole-model replay


@dataclass(frozen=True)
class StepBytes:
    """The whole cache around one update."""

    index: int
    phase: str
    tokens: int
    offset: int  # tokens seen after the update
    bytes_allocated: int  # every array of every layer, wherever it lives (== sum of nbytes)
    bytes_used: int
    device_bytes: int  # what stays on the device after the update
    host_bytes: int  # offloaded layers' bytes on the host after the update
    peak_bytes: int  # device bytes at the worst moment inside the update (transients included)
    layer_bytes: tuple[int, ...] = ()  # bytes allocated per layer after the update


class Replay:
    """A whole-model cache replayed on integers: one rule per distinct layer cache (identical
    layers share it), the layer order kept for peaks and offloading. :func:`trace`,
    :func:`account` and the solver drive it."""

    def __init__(
        self,
        caches: Sequence[LayerLayout],
        arch: Arch,
        backend: str,
        dtype: str,
        batch: int,
        kv_format: str | None = None,
    ):
        self.caches = list(caches)
        self.arch = arch  # the layers' architecture: one device's under a deployment
        self.first_layer = 0  # the model's index of the first layer here (a pipeline stage's start)
        self.stage_count = 1  # pipeline stages laid out alike
        groups: dict[LayerLayout, int] = {}
        for c in self.caches:
            groups.setdefault(c, len(groups))
        self.group_caches = list(groups)
        self.rules = [layer_rule(c, arch, backend, dtype, batch, kv_format) for c in self.group_caches]
        self.order = [groups[c] for c in self.caches]
        self.offloaded = [c.offloaded for c in self.caches]
        off = [i for i, o in enumerate(self.offloaded) if o]
        self.next_offloaded = {i: next((j for j in off if j > i), off[0]) for i in off}
        self.first_offloaded = off[0] if off else None
        self.counts = [self.order.count(g) for g in range(len(self.rules))]
        self.device_counts = [
            sum(1 for i, h in enumerate(self.order) if h == g and self.on_device(i)) for g in range(len(self.rules))
        ]
        self.offset = 0
        self.steps = 0

    def copy(self) -> Replay:
        twin = copy.copy(self)
        twin.rules = [r.copy() for r in self.rules]
        return twin

    def bounded(self) -> bool:
        """Whether no layer's cache can grow past a fixed size whatever comes."""
        return all(r.bounded for r in self.rules)

    def settled(self) -> bool:
        """Whether every coming 1-token update leaves every byte count and the peak as they are."""
        return all(r.settled() for r in self.rules)

    # -- state
    def totals(self) -> tuple[int, int]:
        alloc = sum(n * r.bytes_allocated for n, r in zip(self.counts, self.rules))
        used = sum(n * r.bytes_used for n, r in zip(self.counts, self.rules))
        return alloc, used

    def on_device(self, i: int) -> bool:
        if not self.offloaded[i]:
            return True
        first = self.first_offloaded
        return i == first and self.next_offloaded[first] != first

    def device_bytes(self) -> int:
        return sum(n * r.bytes_allocated for n, r in zip(self.device_counts, self.rules))

    # -- one update through every layer
    def update(self, n: int, phase: str, keep_layers: bool) -> StepBytes:
        before = [r.bytes_allocated for r in self.rules]
        trans = [r.update(n) for r in self.rules]
        after = [r.bytes_allocated for r in self.rules]
        self.offset += n
        peak = self._peak(before, trans, after)
        alloc, used = self.totals()
        device = self.device_bytes()
        step = StepBytes(
            self.steps,
            phase,
            n,
            self.offset,
            alloc,
            used,
            device,
            alloc - device,
            peak,
            tuple(after[g] for g in self.order) if keep_layers else (),
        )
        self.steps += 1
        return step

    def _peak(self, before: list[int], trans: list[int], after: list[int]) -> int:
        order = self.order
        if self.first_offloaded is None:
            running = sum(before[g] for g in order)
            peak = running
            for g in order:
                peak = max(peak, running - before[g] + trans[g])
                running += after[g] - before[g]
            return peak
        # offloading: the device holds resident layers, the layer updating and the one prefetched
        first = self.first_offloaded
        device = sum(before[g] for i, g in enumerate(order) if not self.offloaded[i]) + before[order[first]]
        present = {first}
        peak = device
        for i, g in enumerate(order):
            if self.offloaded[i]:
                j = self.next_offloaded[i]
                if j not in present:
                    device += before[order[j]] if j > i else after[order[j]]
                    present.add(j)
                peak = max(peak, device - before[g] + trans[g])
                device += after[g] - before[g]
                device -= after[g]
                present.discard(i)
            else:
                peak = max(peak, device - before[g] + trans[g])
                device += after[g] - before[g]
        return peak

    def regular_steps(self) -> int:
        return min(r.regular_steps() for r in self.rules)

    def skip(self, k: int) -> None:
        for r in self.rules:
            r.skip(k)
        self.offset += k
        self.steps += k

    def feed(self, n: int, count: int, phase: str) -> tuple[int, int]:
        """Apply ``count`` updates of ``n`` tokens; return the highest peak and the most device
        bytes among them. Exact, in time bounded by the updates' cycle, not by ``count``.

        1-token updates skip their regular stretches (the maximum is at a stretch's last step).
        Once every rule's ``cycle_key`` has come round three times at equal spacing, and every
        field moved by the same amounts between them, the updates go round a cycle: whole cycles
        are jumped over by shifting the fields, within every rule's ``cycle_horizon``, and the
        cycle after them is replayed. Bytes move affinely from cycle to cycle, so each moment's
        peak is a maximum of affine functions of the cycle's number, highest at the first or the
        last cycle, both replayed."""
        peak = resident = 0
        seen: dict = {}  # cycle key -> [(updates left, fields)] at its sightings
        left = count
        while left:
            key = self._cycle_key(n)
            if key is not None:
                marks = seen.setdefault(key, [])
                marks.append((left, [r.fields() for r in self.rules]))
                jumped = self._jump(n, marks, left) if len(marks) >= 3 else 0
                if jumped:
                    left -= jumped
                    seen.clear()
                    continue
                if len(seen) > CYCLE_KEYS:  # no cycle in sight: start looking afresh
                    seen.clear()
            k = 1  # updates this event makes: a regular stretch's skipped ones and the last
            if n == 1:
                k = max(1, min(self.regular_steps(), left))
                if k > 1:
                    self.skip(k - 1)
            step = self.update(n, phase, False)
            peak = max(peak, step.peak_bytes)
            resident = max(resident, step.device_bytes)
            left -= k
        return peak, resident

    def _cycle_key(self, n: int):
        keys = tuple(r.cycle_key(n) for r in self.rules)
        return None if any(k is None for k in keys) else keys

    def _jump(self, n: int, marks: list, left: int) -> int:
        """Shift the state by whole cycles seen in the last three ``marks``; the updates jumped."""
        (l0, f0), (l1, f1), (l2, f2) = marks[-3:]
        per_cycle = l1 - l2
        if per_cycle <= 0 or l0 - l1 != per_cycle:
            return 0
        deltas = []
        for a, b, c in zip(f0, f1, f2):
            if a.keys() != c.keys() or any(b[f] - a[f] != c[f] - b[f] for f in a):
                return 0
            deltas.append({f: c[f] - b[f] for f in c})
        # keep one whole cycle to replay, inside every horizon
        reach = min([left, *(r.cycle_horizon(n) for r in self.rules)])
        cycles = reach // per_cycle - 1
        if cycles < 1:
            return 0
        for r, d in zip(self.rules, deltas):
            r.shift(d, cycles)
        jumped = cycles * per_cycle
        self.offset += jumped * n
        self.steps += jumped
        return jumped


def replay(
    arch: Arch,
    spec: str | Spec,
    backend: str = "mlx",
    *,
    batch: int = 1,
    dtype: str = "float16",
    deployment: Deployment | None = None,
    context: int | None = None,
) -> Replay:
    """An empty :class:`Replay` of the cache ``spec`` builds for ``arch`` on ``backend``; with a
    ``deployment``, of one device's cache (the largest pipeline stage, one tensor-parallel rank;
    ``context``: the run's, for runtimes that allocate it at start)."""
    spec = parse_spec(spec)
    check_dtype(dtype)
    _positive_int("batch", batch)
    d = deployment_of(deployment, backend)
    return _stage_replays(arch, spec, d, dtype, batch, context)[0]


def _stage_replays(arch: Arch, spec: Spec, d: Deployment, dtype: str, batch: int, context: int | None) -> list[Replay]:
    """Replays of the distinct pipeline stages, the largest first, each with how many stages
    share its layout (``Replay.stage_count``)."""
    stage_list = stage_arches(arch, d)
    starts = [r.start for r in stages(arch, d.pp, d)]
    first = largest_stage(stage_list)
    order = [first] + [i for i in range(len(stage_list)) if i != first]
    seen: dict[tuple, Replay] = {}
    for i in order:
        a = stage_list[i]
        key = (a.layer_kinds,)
        if key in seen:
            seen[key].stage_count += 1
            continue
        run = Replay(device_layout(a, spec, d, context, batch), a, d.backend, dtype, batch, d.kv_format)
        run.first_layer = starts[i]
        seen[key] = run
    return list(seen.values())


@dataclass(frozen=True)
class Trace:
    """Every update of a run, in order."""

    arch: str
    spec: str
    backend: str
    dtype: str
    batch: int
    layers: tuple[LayerLayout, ...]
    steps: tuple[StepBytes, ...]
    deployment: Deployment | None = None  # steps are one device's bytes under a deployment

    @property
    def peak_bytes(self) -> int:
        return max((s.peak_bytes for s in self.steps), default=0)

    def rows(self) -> list[dict]:
        """One plain dict per update (per-layer bytes left out), for tables and CSV."""
        keys = (
            "index",
            "phase",
            "tokens",
            "offset",
            "bytes_allocated",
            "bytes_used",
            "device_bytes",
            "host_bytes",
            "peak_bytes",
        )
        return [{k: getattr(s, k) for k in keys} for s in self.steps]


def trace(
    arch: Arch,
    spec: str | Spec,
    backend: str = "mlx",
    *,
    context: int | None = None,
    prefill: int | None = None,
    prefill_chunk: int | None = None,
    updates: Iterable[int] | None = None,
    batch: int = 1,
    dtype: str = "float16",
    deployment: Deployment | None = None,
) -> Trace:
    """Bytes after every update of a run: ``context`` tokens as :func:`schedule` splits them, or
    an explicit list of update sizes (``updates``, e.g. ``[100, 1, 1, 7, 1]``).

    With a ``deployment`` (its backend wins over ``backend``) every byte count is one device's:
    the largest pipeline stage on one tensor-parallel rank; the prompt goes in the runtime's
    chunks (``deployment.prefill_chunk``) unless ``prefill_chunk`` says otherwise."""
    spec = parse_spec(spec)
    d = deployment_of(deployment, backend)
    if updates is not None:
        if context is not None or prefill is not None or prefill_chunk is not None:
            raise ValueError("give either updates or context/prefill/prefill_chunk, not both")
        plan = [Update(_positive_int("update size", int(n)), 1, "prefill" if n > 1 else "decode") for n in updates]
    else:
        if context is None:
            raise ValueError("context is required (or give updates)")
        plan = schedule(context, prefill, prefill_chunk or d.prefill_chunk, last_alone=prompt_last_alone(d.runtime))
    total = sum(u.tokens * u.repeat for u in plan)
    run = replay(arch, spec, backend, batch=batch, dtype=dtype, deployment=deployment, context=total)
    steps = [run.update(u.tokens, u.phase, True) for u in plan for _ in range(u.repeat)]
    return Trace(arch.name, str(spec), d.backend, dtype, batch, tuple(run.caches), tuple(steps), deployment)


# ---------------------------------------------------------------------------------------------
# final state + peaks, fast


@dataclass(frozen=True)
class LayerAccount:
    index: int
    layer_type: str
    kind: str
    tokens_held: int
    capacity: int
    bytes_allocated: int
    bytes_used: int
    on_device: bool


@dataclass(frozen=True)
class Account:
    """A run's end state and worst moments. Byte counts cover the whole batch."""

    arch: str
    spec: str
    backend: str
    dtype: str
    batch: int
    context: int
    prefill: int
    prefill_chunk: int | None
    layers: tuple[LayerAccount, ...]
    bytes_allocated: int  # after the last update: every array of the cache (== sum of nbytes)
    bytes_used: int  # the slots that hold tokens (+ recurrent state)
    device_bytes: int  # after the last update, on the device
    host_bytes: int  # after the last update, offloaded to the host
    peak_bytes: int  # device: the worst moment of the run, transients included
    max_resident_bytes: int  # device: the most held between updates
    deployment: Deployment | None = None  # every count above is one device's under a deployment
    devices: int = 1  # devices the deployment spreads the cache over (tp x pp)
    total_bytes_allocated: int | None = None  # summed over every device (None: one device, bytes_allocated)

    @property
    def total_bytes(self) -> int:
        """Bytes allocated at the end over every device of the deployment (replicated KV heads
        counted on each rank that holds them)."""
        return self.bytes_allocated if self.total_bytes_allocated is None else self.total_bytes_allocated

    @property
    def bytes_per_token(self) -> float:
        """Bytes allocated at the end per token of context (whole batch)."""
        return self.bytes_allocated / self.context


def account(
    arch: Arch,
    spec: str | Spec,
    backend: str = "mlx",
    *,
    context: int,
    prefill: int | None = None,
    prefill_chunk: int | None = None,
    batch: int = 1,
    dtype: str = "float16",
    deployment: Deployment | None = None,
) -> Account:
    """The cache after a run of ``context`` tokens (see :func:`schedule`), per layer and in
    total, with the run's peak and resident maxima. Equal to the last step of :func:`trace`,
    computed in time bounded by the updates' cycles (:meth:`Replay.feed`), not by tokens.

    With a ``deployment`` (its backend wins over ``backend``; the prompt goes in its runtime's
    chunks unless ``prefill_chunk`` is given) the layers and every byte count are one device's:
    the largest pipeline stage (most layers, then most full-attention layers) on one
    tensor-parallel rank, which is what must fit in one device's memory. ``total_bytes`` sums
    every device: each stage's bytes times ``tp`` (KV heads replicated past their count are
    counted on every rank that holds them), so it is ``bytes_allocated x devices`` only when
    the stages are alike."""
    spec = parse_spec(spec)
    check_dtype(dtype)
    _positive_int("batch", batch)
    d = deployment_of(deployment, backend)
    plan = schedule(context, prefill, prefill_chunk or d.prefill_chunk, last_alone=prompt_last_alone(d.runtime))
    runs = _stage_replays(arch, spec, d, dtype, batch, context)
    total = 0
    for i, run in enumerate(runs):
        peak = resident = 0
        for u in plan:
            p, r = run.feed(u.tokens, u.repeat, u.phase)
            peak, resident = max(peak, p), max(resident, r)
        total += run.totals()[0] * run.stage_count * d.tp
        if i == 0:
            first = (peak, resident)
    run = runs[0]
    peak, resident = first
    alloc, used = run.totals()
    device = run.device_bytes()
    layers = []
    for i, (cache, g) in enumerate(zip(run.caches, run.order)):
        s = run.rules[g].state()
        layers.append(
            LayerAccount(
                run.first_layer + i,
                cache.layer_type,
                s.kind,
                s.tokens_held,
                s.capacity,
                s.bytes_allocated,
                s.bytes_used,
                run.on_device(i),
            )
        )
    prefill_tokens = sum(u.tokens * u.repeat for u in plan if u.phase == "prefill")
    return Account(
        arch.name,
        str(spec),
        d.backend,
        dtype,
        batch,
        context,
        prefill_tokens,
        prefill_chunk or d.prefill_chunk,
        tuple(layers),
        alloc,
        used,
        device,
        alloc - device,
        peak,
        resident,
        deployment,
        d.devices,
        total if deployment is not None else None,
    )
