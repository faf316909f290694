"""The memory guard: stop a run before the next step's caches would pass a byte limit.

The limit covers the KV caches of all strategies of the run together (they live side by side in
one process). Before each step the guard asks one predictor per strategy what its caches will
hold after the step, and stops the run when the total would pass the limit. The caller passes
the predictors in (the profiler passes the capacity planner's exact replays,
:func:`cachelib.plan.accounting.replay`), so the guard knows no planner.
"""

from __future__ import annotations

import math
from typing import Protocol, Sequence

from ..core.units import parse_memory
from ..introspect import CacheView


def parse_memory_limit(value: int | float | str | None) -> int | None:
    """Bytes of a memory limit. A number is bytes (``1_000_000``); text is a size as the planner
    reads it (:func:`cachelib.core.units.parse_memory`): ``"2"`` and ``"2GiB"`` are 2 GiB,
    ``"1.5GB"`` is 1.5 x 10^9 bytes, ``"512MiB"``. None or empty text means no limit."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise ValueError(f"memory_limit must be bytes or a size like '2GiB' or '2GB', got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError(f"memory_limit must be a finite number of bytes, got {value!r}")
        limit = int(value)
    else:
        try:
            limit = parse_memory(value, "memory_limit")
        except ValueError:
            raise ValueError(f"memory_limit {value!r} is not a size; write e.g. '2GiB', '1.5GB' or '512MiB' "
                             "(a bare number is GiB)") from None  # fmt: skip
    if not limit > 0:
        raise ValueError(f"memory_limit must be > 0, got {value!r}")
    return limit


DEFAULT_SHARE = 0.9  # without a limit, the caches may take this share of the memory available at the start


def available_memory(device: str) -> int:
    """Bytes free for a run's caches on ``device``: the GPU's free memory for a CUDA device,
    else the machine's available memory (psutil; MLX on Apple silicon shares it with the GPU)."""
    if str(device).startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


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
