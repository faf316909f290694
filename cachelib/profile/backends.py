"""What the profiler needs from a backend, in one small adapter per backend.

Builds whole-model caches from specs, lists a cache's per-layer views (introspection only), turns
the quantization-error probe on and off, captures the attention mask each layer cache produces
for a step, and reads device memory counters.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..introspect import CacheView
from ..models import LoadedModel
from ..spec import Spec


class BackendProbe:
    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.backend = loaded.info.backend
        self.device = loaded.info.device
        if self.backend == "mlx":
            import mlx.core as mx

            from .. import mlx as lib

            self._mx = mx
        else:
            import torch

            from .. import torch as lib

            self._torch = torch
        self._lib = lib

    # --- caches ---------------------------------------------------------------------------

    def make_cache(self, spec: Spec):
        return self._lib.make_cache(self.loaded.model, spec)

    def layer_caches(self, cache) -> list[Any]:
        return list(cache) if self.backend == "mlx" else list(cache.layers)

    def views(self, cache) -> list[CacheView]:
        if self.backend == "mlx":
            return self._lib.introspect(cache)
        return cache.introspect()

    def set_track_error(self, cache, on: bool) -> None:
        if self.backend == "torch":  # the whole-model cache passes it to every quantizing layer
            cache.track_error = on
            return
        for layer in cache:
            for c in getattr(layer, "caches", (layer,)):
                if hasattr(type(c), "track_error"):
                    c.track_error = on

    # --- masks ----------------------------------------------------------------------------

    def masks_before(self, cache, views: list[CacheView], n_queries: int) -> list[Any]:
        """Per layer, what the cache says about this step's mask; call before the step with the
        views taken before it. Layers without a token axis (recurrent state) give None."""
        out: list[Any] = []
        for idx, (layer, view) in enumerate(zip(self.layer_caches(cache), views)):
            if view.layout not in ("linear", "ring"):
                out.append(None)
            elif self.backend == "mlx":
                if hasattr(layer, "make_mask"):
                    out.append(("array", layer.make_mask(n_queries, return_array=True)))
                else:  # mlx-lm models then pass None (one query) or "causal" (aligned to the end)
                    out.append(("causal",))
            else:
                kv_length, kv_offset = cache.get_mask_sizes(n_queries, idx)
                window = getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None
                out.append(("sizes", int(kv_length), int(kv_offset), window))
        return out

    def masks_after(self, before: list[Any], views: list[CacheView], n_queries: int) -> list[np.ndarray | None]:
        """Resolve ``masks_before`` into dense boolean (query x key) arrays, keys in the order the
        cache returned them (slot order). None for layers without an attention mask."""
        out: list[np.ndarray | None] = []
        for raw, view in zip(before, views):
            if raw is None:
                out.append(None)
                continue
            if raw[0] == "causal":
                k = view.tokens_held
                out.append(np.arange(k)[None, :] <= (k - n_queries + np.arange(n_queries))[:, None])
                continue
            if raw[0] == "sizes":  # torch: key k holds position kv_offset + k; causal (+ window)
                _, kv_length, kv_offset, window = raw
                q = view.offset - n_queries + np.arange(n_queries)[:, None]
                p = kv_offset + np.arange(kv_length)[None, :]
                m = p <= q
                if window is not None:
                    m &= (q - p) < window
                out.append(m)
                continue
            if raw[1] is None:  # mlx: no mask means every returned key is visible
                out.append(np.ones((n_queries, view.tokens_held), dtype=bool))
                continue
            m = np.array(raw[1])
            while m.ndim > 2:
                m = m[0]
            if m.dtype != np.bool_:
                m = m > -1e30  # additive masks: finite = visible
            out.append(np.broadcast_to(m, (n_queries, m.shape[-1])).copy())
        return out

    # --- memory ---------------------------------------------------------------------------

    def reset_peak(self) -> None:
        if self.backend == "mlx":
            self._mx.reset_peak_memory()
        elif self.device.startswith("cuda"):
            self._torch.cuda.reset_peak_memory_stats()

    def device_memory(self) -> tuple[int | None, int | None]:
        """(active bytes, peak bytes since reset_peak) of the device allocator, where it counts."""
        if self.backend == "mlx":
            return int(self._mx.get_active_memory()), int(self._mx.get_peak_memory())
        torch = self._torch
        if self.device.startswith("cuda"):
            return int(torch.cuda.memory_allocated()), int(torch.cuda.max_memory_allocated())
        if self.device.startswith("mps"):
            return int(torch.mps.current_allocated_memory()), None
        return None, None
