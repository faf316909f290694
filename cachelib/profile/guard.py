"""The memory guard: stop a run before the next step's caches would pass a byte limit.

The limit covers the KV caches of all strategies of the run together (they live side by side in
one process). Before each step the guard asks one predictor per strategy what its caches will
hold after the step, and stops the run when the total would pass the limit. The caller passes
the predictors in (the profiler passes the capacity planner's exact replays,
:func:`cachelib.plan.accounting.replay`), so the guard knows no planner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from ..core.memory import address_space_limit, address_space_room, available_memory, machine_memory
from ..core.units import clip_input, human_bytes, parse_memory, to_bytes
from ..introspect import CacheView
from ..spec import Spec


def parse_memory_limit(value: int | float | str | None) -> int | None:
    """Bytes of a memory limit. A number is bytes (``1_000_000``); text is a size as the planner
    reads it (:func:`cachelib.core.units.parse_memory`): ``"2"`` and ``"2GiB"`` are 2 GiB,
    ``"1.5GB"`` is 1.5 x 10^9 bytes, ``"512MiB"``. None or empty text means no limit. Checked
    after scaling (:func:`~cachelib.core.units.to_bytes`): finite, > 0 and within the range named."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise ValueError(f"memory_limit must be bytes or a size like '2GiB' or '2GB', got {value!r}")
    if isinstance(value, (int, float)):
        limit = to_bytes(value, "B", "memory_limit", repr(value))
    else:
        try:
            limit = parse_memory(value, "memory_limit")
        except ValueError as e:
            if "must be a size such as" not in str(e) and "unknown unit" not in str(e):
                raise  # a size out of range: the message names the range
            raise ValueError(
                f"memory_limit {clip_input(str(value))!r} is not a size; write e.g. '2GiB', '1.5GB' or "
                "'512MiB' (a bare number is GiB)"
            ) from None
    if not limit > 0:
        raise ValueError(f"memory_limit must be > 0, got {clip_input(repr(value))}")
    return limit


DEFAULT_SHARE = 0.9  # without a limit, the caches may take this share of the memory available at the start


def check_memory_limit(limit: int, device: str, name: str = "the memory limit (--memory-limit, memory_limit=)") -> int:
    """``limit`` when ``device`` has that much memory; a ``ValueError`` with the allowed range
    otherwise (a limit the machine cannot hold guards nothing)."""
    total = machine_memory(device)
    if limit > total:
        raise ValueError(
            f"{name} {human_bytes(limit)} ({limit:,} bytes) is more than the {human_bytes(total)} of memory "
            f"{device} has{_rlimit_note(total)}; allowed: 1 byte .. {total:,} bytes"
        )
    return limit


def _rlimit_note(total: int) -> str:
    cap = address_space_limit()
    return " (RLIMIT_AS, ulimit -v)" if cap is not None and cap == total else ""


def _planner_device(device: str) -> str:
    return "cpu" if str(device).startswith("cpu") else "gpu"


def predicted_peaks(arch, specs: Sequence[Spec], backend: str, dtype: str, prompt_tokens: int, steps: int) -> list[int]:
    """Each strategy's peak cache bytes over a run that prefills ``prompt_tokens`` tokens and then
    feeds ``steps - 1`` more one at a time, by the planner's exact accounting. A strategy bounding
    the run itself (static ``max_len``) is counted up to its bound: the run is refused there."""
    from ..plan.accounting import account

    out = []
    for spec in specs:
        context, prefill = prompt_tokens + steps - 1, prompt_tokens
        bound = spec.strategy.max_context
        if bound is not None:
            context, prefill = min(context, spec.get(bound)), min(prefill, spec.get(bound))
        out.append(account(arch, spec, backend, context=context, prefill=prefill, dtype=dtype).peak_bytes)
    return out


def predicted_activations(
    arch,
    specs: Sequence[Spec],
    *,
    backend: str,
    dtype: str,
    device: str,
    prompt_tokens: int,
    steps: int,
    prefill_chunk: int | None,
    rows: int,
) -> int:
    """The planner's activation bytes of the run's largest forward pass (``rows`` strategies fed
    as the rows of one batch; attention scores where the backend materialises them)."""
    from ..plan.device import run_activation_peak

    if not arch.attention_layers and arch.recurrent is None:
        return 0
    return max(
        run_activation_peak(
            arch,
            spec,
            context=prompt_tokens + steps - 1,
            prefill=prompt_tokens,
            prefill_chunk=prefill_chunk or prompt_tokens,
            batch=rows,
            dtype=dtype,
            backend=backend,
            device=_planner_device(device),
        ).total
        for spec in specs
    )


@dataclass(frozen=True)
class RunNeed:
    """What a run is predicted to take: each strategy's peak cache bytes, its largest forward's
    activations, and the default limit the guard then holds it to."""

    peaks: list[int]
    activations: int
    default_limit: int


def check_fits(
    arch,
    specs: Sequence[Spec],
    *,
    backend: str,
    dtype: str,
    device: str,
    prompt_tokens: int,
    steps: int,
    prefill_chunk: int | None = None,
    rows: int | None = None,
    what: str = "run",
    hint: str = "give a memory limit (--memory-limit, memory_limit=) to run under the memory guard anyway",
    loaded: bool = False,
) -> RunNeed | None:
    """Refuse, before anything is allocated, a run whose caches (the planner's rules) plus its
    largest forward's activations would pass :data:`DEFAULT_SHARE` of :func:`available_memory`
    (a ``ValueError`` with the figures and ``hint``); else what it needs. One check for
    ``profile``, ``evaluate``, ``retrieval`` and every sweep point. None where the planner cannot
    account the architecture or a strategy: nothing is refused then. Before the model is
    ``loaded``, its weights as it will load (``dtype``) count too, and under ``RLIMIT_AS`` the
    address space its runtime maps (:func:`runtime_bytes`)."""
    try:
        peaks = predicted_peaks(arch, specs, backend, dtype, prompt_tokens, steps)
        acts = predicted_activations(
            arch,
            specs,
            backend=backend,
            dtype=dtype,
            device=device,
            prompt_tokens=prompt_tokens,
            steps=steps,
            prefill_chunk=prefill_chunk,
            rows=rows or len(specs),
        )
    except ValueError:  # the planner's limits, not the run's: it runs unchecked, as before
        return None
    available = available_memory(device)
    default = int(available * DEFAULT_SHARE)
    caches = sum(peaks)
    weights = 0 if loaded else model_bytes(arch, dtype, backend, device)
    if caches + acts + weights > default:
        each = ", ".join(f"{spec} {human_bytes(b)}" for spec, b in zip(specs, peaks))
        plus = f" plus {human_bytes(acts)} ({acts:,} bytes) of activations in its largest forward pass" if acts else ""
        if weights:
            plus += f" plus {human_bytes(weights)} for the model as it loads ({_model_note(arch, dtype, device)})"
        raise ValueError(
            f"the caches of this {what} would need {human_bytes(caches)} ({caches:,} bytes: {each}){plus}, more than "
            f"the {human_bytes(default)} it may use ({DEFAULT_SHARE:.0%} of the {human_bytes(available)} available on "
            f"{device}{_room_note(device, available)}); use fewer tokens or smaller strategies"
            + (f", or {hint}" if hint else "")
        )
    return RunNeed(peaks, acts, default)


def model_bytes(arch, dtype: str, backend: str, device: str) -> int:
    """What loading the model takes before any cache exists: its weights at ``dtype`` (the
    planner's parameter count; 0 when it has none), and under ``RLIMIT_AS`` the address space its
    runtime maps beside them (:func:`runtime_bytes`)."""
    from ..core.units import DTYPE_BYTES

    params = getattr(arch, "num_params", None) or 0
    weights = int(params * DTYPE_BYTES.get(dtype, 4))
    if str(device).startswith("cuda") or address_space_limit() is None:
        return weights
    return weights + runtime_bytes(backend, weights)


# Address space a run maps beyond its weights (counted twice: the file is read while the arrays are
# made) and its caches under RLIMIT_AS: thread stacks, allocator arenas, libraries loaded on first
# use. Measured on this machine (2 cores, Linux, 2026-12-03) as VmPeak minus the VmSize at the check,
# less twice the weights: MLX CPU evaluate 2.03 GB on smollm2 (538 MB of float32 weights) and
# 2.03 GB on tiny-llama, profile 1.75 GB, retrieval 1.95 GB; torch CPU evaluate on smollm2 0.94 GB.
RUNTIME_BYTES = {"mlx": 2_100_000_000, "torch": 1_000_000_000}


def runtime_bytes(backend: str, weights: int) -> int:
    """Address space, beside the weights, a ``backend`` run maps under ``RLIMIT_AS``: the measured
    runtime share (:data:`RUNTIME_BYTES`) plus the weights' file read once more while loading."""
    return RUNTIME_BYTES.get(backend, max(RUNTIME_BYTES.values())) + weights


def _model_note(arch, dtype: str, device: str) -> str:
    params = getattr(arch, "num_params", None) or 0
    note = f"{params:,} parameters at {dtype}"
    if not str(device).startswith("cuda") and address_space_limit() is not None:
        note += ", and the address space its runtime maps under RLIMIT_AS"
    return note


def _room_note(device: str, available: int) -> str:
    room = None if str(device).startswith("cuda") else address_space_room()
    return ", as RLIMIT_AS (ulimit -v) leaves it" if room is not None and room <= available else ""


class StepPrediction(Protocol):
    bytes_allocated: int


class CachePredictor(Protocol):
    """One strategy's caches replayed on integers, step by step (the planner's ``Replay``)."""

    def copy(self) -> "CachePredictor": ...

    def update(self, n: int, phase: str, keep_layers: bool) -> StepPrediction: ...


class MemoryGuard:
    def __init__(self, limit: int, predictors: Sequence[CachePredictor], source: str = ""):
        self.limit = limit
        self.source = source  # where the limit comes from, when not from the caller (said in the reason)
        self._runs = list(predictors)

    def check(self, tokens_in: int, views: list[list[CacheView]]) -> str:
        """A reason to stop before a step that feeds ``tokens_in`` tokens to every cache, or ""
        to go on (the guard then counts that step as taken)."""
        twins = [r.copy() for r in self._runs]
        after = sum(t.update(tokens_in, "prefill" if tokens_in > 1 else "decode", False).bytes_allocated for t in twins)
        if after > self.limit:
            now = sum(v.bytes_allocated for layer_views in views for v in layer_views)
            return (
                f"memory guard: the next step would bring the caches to {after:,} bytes "
                f"(now {now:,}), over the limit of {self.limit:,} bytes" + (f" ({self.source})" if self.source else "")
            )
        self._runs = twins
        return ""


class PastPositionsWarning(UserWarning):
    """A run feeds positions past the model's ``max_position_embeddings``: the runtime computes
    them (rotary positions have no hard end), but the model was not trained to attend that far."""


def warn_past_positions(info, positions: int, what: str = "this run") -> None:
    """Warn (:class:`PastPositionsWarning`) before anything is fed when ``positions`` tokens pass
    the limit ``info`` (a ModelInfo or planner Arch) gives; nothing when it gives none."""
    limit = getattr(info, "max_position_embeddings", None)
    if limit and positions > limit:
        import warnings

        warnings.warn(
            f"{what} feeds {positions:,} positions, past {info.name}'s limit of {limit:,} (max_position_embeddings): "
            "the model computes them, but was not built to attend that far",
            PastPositionsWarning,
            stacklevel=3,
        )


def planned_arch(model, backend: str, device: str | None):
    """(the planner's Arch of ``model``, the device it will run on, its dtype) before it loads,
    so a run can be checked first; the Arch is None where the planner cannot read the model (the
    loader then names the problem)."""
    from ..models import LoadedModel
    from ..models.devices import resolve_device
    from ..plan import arch_from_model_info
    from ..plan.arch import ConfigNumberError
    from ..plan.presets import resolve_model

    if isinstance(model, LoadedModel):
        try:
            return arch_from_model_info(model.info), model.info.device, model.info.dtype
        except ValueError:
            return None, model.info.device, model.info.dtype
    where = resolve_device(backend, device)
    try:
        return resolve_model(model), where, "float32"  # cachelib.models.load's default dtype
    except ConfigNumberError:  # 10^6 layers, a hidden size of 0: the loader would fail too, after minutes
        raise
    except (ValueError, OSError):
        return None, where, "float32"


class RunWatch:
    """The memory guard of a run measured in pieces (``evaluate``'s windows, ``retrieval``'s
    trials). Made once the model is loaded, it checks the run again with the loaded model's exact
    dtype and device (:func:`check_fits`: a ``ValueError`` when it cannot fit); then, before each
    piece, :meth:`check` gives a reason to stop when this process has grown past the default limit
    since the start (:data:`DEFAULT_SHARE` of what was available), or when the memory available
    now, with what the process holds, no longer covers the next piece's predicted need."""

    def __init__(self, loaded, specs: Sequence[Spec], *, prompt_tokens, steps, prefill_chunk, rows, what: str):
        from ..plan import arch_from_model_info

        info = loaded.info
        self.device = info.device
        self.need: RunNeed | None = None
        try:
            arch = arch_from_model_info(info)
        except ValueError:  # an architecture the planner cannot account: nothing to watch
            return
        self.need = check_fits(
            arch,
            specs,
            backend=info.backend,
            dtype=info.dtype,
            device=info.device,
            prompt_tokens=prompt_tokens,
            steps=steps,
            prefill_chunk=prefill_chunk,
            rows=rows,
            what=what,
            hint="",
            loaded=True,
        )
        self.start = _resident()

    def check(self) -> str:
        """'' to go on, or why the run stops before its next piece."""
        if self.need is None:
            return ""
        need = sum(self.need.peaks) + self.need.activations
        grown = max(0, _resident() - self.start) if not str(self.device).startswith("cuda") else 0
        if grown > self.need.default_limit:
            return (
                f"memory guard: the process has grown by {human_bytes(grown)} since the start, past its limit of "
                f"{human_bytes(self.need.default_limit)} ({DEFAULT_SHARE:.0%} of the memory available at the start)"
            )
        available = available_memory(self.device)
        if available + grown < need:
            return (
                f"memory guard: {human_bytes(available)} is available on {self.device} now, less than the "
                f"{human_bytes(need)} the next piece is predicted to need"
            )
        return ""


def _resident() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # psutil missing or the platform refuses: no growth is seen
        return 0


def check_point_fits(point, *, one_by_one: bool = False) -> None:
    """A sweep point's check before its model loads, as ``profile`` (what cannot fit even for one
    token) or ``evaluate`` (its context) makes it: a ``ValueError`` naming the point. Run where the
    point will run (the local cluster's workers share this machine, memory and ``RLIMIT_AS``)."""
    arch, where, dtype = planned_arch(point.model, point.backend, point.device)
    specs = list(point.strategies)
    if arch is None or getattr(point, "memory_limit", None) is not None:
        return  # a model the planner cannot read (the loader names it); a limit the guard holds the run to
    rows = 1 if one_by_one else len(specs)
    kind = dict(backend=point.backend, dtype=dtype, device=where, rows=rows)
    try:
        if hasattr(point, "context"):  # an evaluation point
            check_fits(
                arch,
                specs,
                **kind,
                prompt_tokens=point.context,
                steps=point.score_tokens,
                prefill_chunk=point.prefill_chunk,
                what="evaluation",
                hint="",
            )
        else:
            check_fits(arch, specs, **kind, prompt_tokens=1, steps=1, hint="give the point a memory_limit")
    except ValueError as e:
        raise ValueError(f"sweep point {point.id}: {e}") from None
