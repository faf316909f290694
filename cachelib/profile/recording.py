"""What one step of one strategy records: its rows of the profile's tables (steps, layers, slots,
masks), read through the probes from its cache before and after its forward.

:mod:`cachelib.profile.run` drives the steps (one forward per strategy, or one for a strategy
batch); this module turns what a forward left in a cache into rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, NamedTuple

import numpy as np

from ..introspect import CacheView
from ..spec import Spec
from .probes import Probes


@dataclass(frozen=True)
class StepAt:
    """Where a run is: the backend's probe, the run's probe periods, the step and whether it is the last."""

    probe: Any
    probes: Probes
    step: int
    last: bool

    def on(self, name: str) -> bool:
        """Whether probe ``name`` samples this step."""
        return self.probes.on(name, self.step, self.last)


class Before(NamedTuple):
    """What the probes took from a cache before its forward."""

    masks_raw: Any  # the backend's masks, finished by ``probe.masks_after``; None when masks are off
    want_error: bool  # quantization error tracked through this forward


class Forward(NamedTuple):
    """What one strategy's forward gave: the tokens fed, its logits, the forward's wall seconds,
    the cache's views after it, (device active, device peak, RSS) bytes where a strategy batch
    read them once for all its rows (None: read them for this row), and its greedy token where
    the caller took the logits' argmax already (None: taken here)."""

    ids: list[int]
    logits: Any
    wall: float
    views: list[CacheView]
    system: tuple | None = None
    token: int | None = None


class StrategyState:
    """One strategy's live state in a run: its cache, the tokens it was fed, and its last views."""

    def __init__(self, label: str, spec: Spec, cache: Any):
        self.label = label
        self.spec = spec
        self.cache = cache
        self.last_token: int | None = None
        self.tokens: list[int] = []
        self.departed = False
        # The views its last step ended with: the cache holds still between steps, so the guard
        # and the next step's mask probe read these instead of introspecting it again.
        self.views: list[CacheView] | None = None
        self.tracking = False  # its cache's quantization-error switch is on (left on between sampled steps)

    def views_now(self, probe) -> list[CacheView]:
        if self.views is None:
            self.views = probe.views(self.cache)
        return self.views


def before_step(at: StepAt, st: StrategyState, n: int) -> Before:
    """What the probes read from ``st``'s cache before its forward of ``n`` tokens."""
    want_masks = at.on("masks")
    want_error = at.on("quant_error")
    masks_raw = at.probe.masks_before(st.cache, st.views_now(at.probe), n) if want_masks else None
    if want_error and not st.tracking:
        at.probe.set_track_error(st.cache, True)
        st.tracking = True
    return Before(masks_raw, want_error)


_OFFSET, _TOKENS_HELD, _LAYOUT = attrgetter("offset"), attrgetter("tokens_held"), attrgetter("layout")
_BYTES_USED, _BYTES_ALLOCATED = attrgetter("bytes_used"), attrgetter("bytes_allocated")


def step_rows(at: StepAt, st: StrategyState, before: Before, forward: Forward) -> dict[str, Any]:
    """The rows of ``st``'s step, read from its cache after ``forward``; its views were taken after
    that forward, while error tracking was still on (so they carry this step's quantization error)."""
    probe, step, want_error = at.probe, at.step, before.want_error
    ids, logits, wall, views, system, token = forward
    n = len(ids)
    st.views = views
    # The switch stays on into the next step where that step samples the error too (flipping it
    # walks the cache's layers twice a step); it is off after the run's last step, and through
    # any step that does not sample, so no forward does the probe's work unasked.
    if st.tracking and (at.last or not at.probes.on("quant_error", step + 1)):
        probe.set_track_error(st.cache, False)
        st.tracking = False
    if token is None:
        token = int(np.argmax(logits))
    st.last_token = token
    st.tokens.append(token)

    position = max(map(_OFFSET, views), default=step) - 1
    row: dict[str, Any] = {
        "strategy": st.label,
        "step": step,
        "phase": "prefill" if step == 0 else "decode",
        "position": position,
        "tokens_in": n,
        "token_id": token,
    }
    rows: dict[str, Any] = {"steps": row}
    if at.on("system"):
        active, peak, rss = system if system is not None else (*probe.device_memory(), process_rss())
        row.update(
            wall_seconds=wall,
            tokens_per_second=n / wall if wall > 0 else None,
            device_active_bytes=active,
            device_peak_bytes=peak,
            rss_bytes=rss,
        )
    if at.on("memory"):
        row.update(
            cache_tokens_held=max(map(_TOKENS_HELD, views), default=0),
            cache_bytes_used=sum(map(_BYTES_USED, views)),
            cache_bytes_allocated=sum(map(_BYTES_ALLOCATED, views)),
        )
        if "selected" in map(_LAYOUT, views):
            row["score_seconds"] = sum(v.score_seconds for v in views)
        rows["layers"] = _layer_rows(st.label, step, views, ring=at.on("ring"), error=want_error)
    if at.on("ring"):
        ring_texts: dict[tuple, str] = {}
        rows["slots"] = [
            {
                "strategy": st.label,
                "step": step,
                "layer": i,
                "write_index": v.write_index,
                "keep": v.keep,
                "positions": _ring_text(v, ring_texts),
            }
            for i, v in enumerate(views)
            if v.layout == "ring"
        ] + [
            {
                "strategy": st.label,
                "step": step,
                "layer": i,
                "head": head,
                "write_index": v.write_index,
                "keep": v.keep,
                "positions": " ".join(map(str, positions.tolist())),
            }
            for i, v in enumerate(views)
            if v.layout == "selected" and v.head_positions is not None
            for head, positions in enumerate(v.head_positions)
        ]
    if before.masks_raw is not None:
        masks = probe.masks_after(before.masks_raw, views, n)
        rows["masks"] = _mask_rows(st.label, step, masks, views, n)
    return rows


MAX_MASK_QUERIES = 64  # prefill masks keep their last 64 query rows (documented in profiles/README.md)


def _geometry(v: CacheView) -> tuple:
    """What a linear or ring view's slot -> position table is a function of: the layers of one
    cache mostly share it, so a step makes each distinct table's text once."""
    return (v.layout, v.offset, v.tokens_held, v.capacity, v.write_index, v.keep, v.start_position, v.left_padding)


def _ring_text(v: CacheView, texts: dict) -> str:
    """The slot -> position table of a ring view as text (``texts``: those made this step)."""
    key = _geometry(v)
    text = texts.get(key)
    if text is None:
        text = texts[key] = " ".join(map(str, v.slot_positions().tolist()))
    return text


def _mask_rows(label: str, step: int, masks: list, views: list[CacheView], n: int) -> list[dict]:
    rows = []
    key_texts: dict[tuple, str] = {}  # the layers of one cache mostly hold the same slots
    first = max(0, n - MAX_MASK_QUERIES)
    for layer, (mask, view) in enumerate(zip(masks, views)):
        if mask is None:
            continue
        width = mask.shape[1]
        key = (*_geometry(view), width)
        key_text = key_texts.get(key) if view.layout in ("linear", "ring") else None
        if key_text is None:
            positions = view.slot_positions()
            if positions.ndim > 1:
                positions = positions[0]
            keys = positions[positions >= 0] if view.layout == "linear" else positions
            key_text = " ".join(map(str, keys[:width].tolist()))
            key_texts[key] = key_text
        # "1" / "0" per key: the bytes of the boolean rows shifted to ASCII digits, one text cut per query
        digits = np.asarray(mask[first:n], dtype=bool).view(np.uint8) + np.uint8(ord("0"))
        text = digits.tobytes().decode("ascii")
        cols = digits.shape[1]
        start = view.offset - n
        rows += [
            {
                "strategy": label,
                "step": step,
                "layer": layer,
                "query": q,
                "query_position": start + q,
                "mask": text[(q - first) * cols : (q - first + 1) * cols],
                "key_positions": key_text,
            }
            for q in range(first, n)
        ]
    return rows


def _layer_rows(label: str, step: int, views: list[CacheView], ring: bool, error: bool) -> list[dict]:
    """One row per layer (the per-step loop of a run: built in one pass, probes decided once)."""
    rows = []
    for layer, v in enumerate(views):
        row = {
            "strategy": label,
            "step": step,
            "layer": layer,
            "kind": v.kind,
            "offset": v.offset,
            "tokens_held": v.tokens_held,
            "capacity": v.capacity,
            "max_capacity": v.max_capacity,
            "bytes_used": v.bytes_used,
            "bytes_allocated": v.bytes_allocated,
            "key_bits": v.key_bits,
            "value_bits": v.value_bits,
            "group_size": v.group_size,
            "quantized_tokens": v.quantized_tokens,
        }
        if ring:
            row["write_index"] = v.write_index
            row["keep"] = v.keep
            row["evicted"] = v.evicted
        e = v.quant_error if error else None
        if e is not None:
            row["key_rel_rms"] = e.key_rel_rms
            row["key_max_abs"] = e.key_max_abs
            row["value_rel_rms"] = e.value_rel_rms
            row["value_max_abs"] = e.value_max_abs
        rows.append(row)
    return rows


class _Resident:
    """This process's resident set size, read cheaply: on Linux from ``/proc/self/statm`` through
    a descriptor kept open (what psutil reads there too: resident pages x page size), elsewhere
    through a psutil handle made once. A forked child opens its own."""

    def __init__(self):
        self.pid = os.getpid()
        self.fd: int | None = None
        self.process: Any = None
        try:
            self.fd = os.open("/proc/self/statm", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            self.page = os.sysconf("SC_PAGE_SIZE")
        except (OSError, AttributeError, ValueError):
            import psutil

            self.process = psutil.Process(self.pid)

    def __call__(self) -> int:
        if self.fd is not None:
            return int(os.pread(self.fd, 128, 0).split()[1]) * self.page
        return int(self.process.memory_info().rss)


_RESIDENT: list[_Resident] = []  # the one reader of this process


def process_rss() -> int | None:
    """This process's resident set size in bytes (None where it cannot be read)."""
    try:
        if not _RESIDENT or _RESIDENT[0].pid != os.getpid():
            _RESIDENT[:] = [_Resident()]
        return _RESIDENT[0]()
    except Exception:  # psutil missing or the platform refuses: the column stays empty
        return None
