"""What the profiler reads from PyTorch caches, in one place: whole-model caches from specs, the
per-layer views, the quantization-error switch, the attention mask each layer cache implies for
a step, and the device's memory counters (CUDA, MPS; none on the CPU).

It speaks the profiler's probe protocol (:class:`cachelib.profile.backends.BackendProbe`) by
duck typing: this layer sits below the profiler and does not import it.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from ..core.masks import visible
from ..introspect import CacheView
from ..spec import Spec
from .base import resolve_errors
from .cache import Cache
from .factory import make_cache
from .hooks import capture
from .importance import ImportanceLayer


def _resolve(caches: list[Cache]) -> None:
    # only the parts with the error switch can hold a pending error (a cachelib cache knows its own)
    resolve_errors([part for cache in caches for part in _error_parts(cache)])


def _error_parts(cache) -> list:
    parts = getattr(cache, "_error_parts", None)
    return parts() if parts is not None else list(getattr(cache, "layers", ()))


class TorchProbe:
    backend = "torch"

    def __init__(self, model, device: str):
        self.model = model
        self.device = device

    def make_cache(self, spec: Spec) -> Cache:
        return make_cache(self.model, spec)

    def views(self, cache: Cache) -> list[CacheView]:
        return self.views_of([cache])[0]

    def views_of(self, caches: list[Cache]) -> list[list[CacheView]]:
        """The views of several whole-model caches (the rows of a strategy batch)."""
        # the quantization error of each quantizing layer's last update is computed for every
        # cache together (stacked by shape), not a few small ops and host reads a layer: by
        # :meth:`pending` where the runner called it, else here
        _resolve(caches)
        return [cache.introspect() for cache in caches]

    def pending(self, caches: list[Cache]) -> list:
        """Computes the quantization error of the forward over ``caches`` (read by
        :meth:`views_of`) and returns nothing to evaluate: torch computed the forward as it ran.
        The runner calls it once every layer has updated, before it hands the logits on: in a
        strategy batch right after the last layer's update, before the final norm and the LM
        head, whose weights leave the error's small ops cold when they run after them."""
        _resolve(caches)
        return []

    def set_track_error(self, cache: Cache, on: bool) -> None:
        cache.track_error = on  # the whole-model cache passes it to every quantizing layer

    def masks_before(self, cache: Cache, views: list[CacheView], n_queries: int) -> list[Any]:
        """Per layer, the mask sizes the cache gives transformers for this step: (key count,
        position of key 0, sliding window or None); call before the step with the views taken
        before it. Layers without a token axis (recurrent state) give None."""
        out: list[Any] = []
        for idx, (layer, view) in enumerate(zip(cache.layers, views)):
            if view.layout not in ("linear", "ring", "selected"):
                out.append(None)
                continue
            kv_length, kv_offset = cache.get_mask_sizes(n_queries, idx)
            window = getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None
            out.append((int(kv_length), int(kv_offset), window))
        return out

    def masks_after(self, before: list[Any], views: list[CacheView], n_queries: int) -> list[np.ndarray | None]:
        """Resolve ``masks_before`` into dense boolean (query x key) arrays: key k holds position
        ``kv_offset + k``, and transformers' causal (+ window) rule decides. None for layers
        without an attention mask."""
        out: list[np.ndarray | None] = []
        for raw, view in zip(before, views):
            if raw is None:
                out.append(None)
                continue
            kv_length, kv_offset, window = raw
            q = view.offset - n_queries + np.arange(n_queries)[:, None]
            out.append(visible(q, kv_offset + np.arange(kv_length)[None, :], window))
        return out

    def capture(self, cache: Cache):
        """The attention-capture hook around a step, when the cache has importance layers
        (they score keys with the step's queries); a no-op context otherwise."""
        if any(isinstance(layer, ImportanceLayer) for layer in cache.layers):
            return capture(self.model)
        return nullcontext()

    def reset_peak(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()

    def device_memory(self) -> tuple[int | None, int | None]:
        """(active bytes, peak bytes since reset_peak) of the device allocator, where it counts."""
        if self.device.startswith("cuda"):
            return int(torch.cuda.memory_allocated()), int(torch.cuda.max_memory_allocated())
        if self.device.startswith("mps"):
            return int(torch.mps.current_allocated_memory()), None
        return None, None
