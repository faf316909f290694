"""What the profiler reads from MLX caches, in one place: whole-model caches from specs, the
per-layer views, the quantization-error switch, the attention mask each layer cache produces
for a step, and MLX's memory counters.

It speaks the profiler's probe protocol (:class:`cachelib.profile.backends.BackendProbe`) by
duck typing: this layer sits below the profiler and does not import it.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import mlx.core as mx
import numpy as np

from ..core.masks import visible
from ..introspect import CacheView
from ..spec import Spec
from .factory import introspect, make_cache
from .hooks import capture
from .importance import ImportanceKVCache
from .quantized import Terms, resolve_terms, stage_terms


class MLXProbe:
    backend = "mlx"

    def __init__(self, model):
        self.model = model

    def make_cache(self, spec: Spec) -> list:
        return make_cache(self.model, spec)

    def views(self, cache: list) -> list[CacheView]:
        return self.views_of([cache])[0]

    def views_of(self, caches: list[list]) -> list[list[CacheView]]:
        """The views of several whole-model caches (the rows of a strategy batch)."""
        # the quantization-error terms of the last update, a pair per quantizing layer, are
        # read here for every cache together (computed by the forward's own evaluation where
        # the runner was given :meth:`pending`, else by one evaluation here), not one small
        # graph per layer as each view reads its own
        resolve_terms(_terms(caches))
        return [introspect(cache) for cache in caches]

    def pending(self, caches: list[list]) -> list:
        """The probe arrays a forward over ``caches`` just built and left uncomputed (a decode
        step's quantization-error terms, stacked per width and shape), for the runner to
        evaluate with the logits: one evaluation a step, not a second one for the probe."""
        return stage_terms(_terms(caches))

    def set_track_error(self, cache: list, on: bool) -> None:
        for c in _switched(cache):
            c.track_error = on

    def masks_before(self, cache: list, views: list[CacheView], n_queries: int) -> list[Any]:
        """Per layer, what the cache says about this step's mask; call before the step with the
        views taken before it. Layers without a token axis (recurrent state) give None."""
        out: list[Any] = []
        for layer, view in zip(cache, views):
            if view.layout not in ("linear", "ring", "selected"):
                out.append(None)
            elif hasattr(layer, "make_mask"):
                out.append(("array", layer.make_mask(n_queries, return_array=True)))
            else:  # mlx-lm models then pass None (one query) or "causal" (aligned to the end)
                out.append(("causal",))
        return out

    def masks_after(self, before: list[Any], views: list[CacheView], n_queries: int) -> list[np.ndarray | None]:
        """Resolve ``masks_before`` into dense boolean (query x key) arrays, keys in the order the
        cache returned them (slot order). None for layers without an attention mask."""
        arrays = [raw[1] for raw in before if raw is not None and raw[0] == "array" and isinstance(raw[1], mx.array)]
        if arrays:
            mx.eval(arrays)  # one evaluation for every layer's mask, not one per np.array below
        out: list[np.ndarray | None] = []
        for raw, view in zip(before, views):
            if raw is None:
                out.append(None)
            elif raw[0] == "causal":  # the queries are the last n of the k keys held
                k = view.tokens_held
                out.append(visible((k - n_queries + np.arange(n_queries))[:, None], np.arange(k)[None, :]))
            elif raw[1] is None:  # no mask means every returned key is visible
                out.append(np.ones((n_queries, view.tokens_held), dtype=bool))
            else:
                m = np.array(raw[1])
                while m.ndim > 2:
                    m = m[0]
                if m.dtype != np.bool_:
                    m = m > -1e30  # additive masks: finite = visible
                out.append(np.broadcast_to(m, (n_queries, m.shape[-1])).copy())
        return out

    def capture(self, cache: list):
        """The attention-capture hook around a step, when the cache has importance layers
        (they score keys with the step's queries); a no-op context otherwise."""
        if any(isinstance(c, ImportanceKVCache) for c in cache):
            return capture(self.model)
        return nullcontext()

    def reset_peak(self) -> None:
        mx.reset_peak_memory()

    def device_memory(self) -> tuple[int | None, int | None]:
        """(active bytes, peak bytes since reset_peak) of MLX's allocator."""
        return int(mx.get_active_memory()), int(mx.get_peak_memory())


# per layer class: MEMBERS (a CacheList: its members are the layer caches), SWITCHED (it has
# the track_error switch and records error terms), or neither (0); the profiler walks every layer
# of every cache twice a step for each, and a class lookup costs less than the attribute misses
MEMBERS, SWITCHED = 2, 1
_KINDS: dict[type, int] = {}


def _kind(layer) -> int:
    kind = _KINDS.get(type(layer))
    if kind is None:
        # a CacheList's members are an instance attribute: asked of its first instance
        kind = MEMBERS if hasattr(layer, "caches") else SWITCHED if hasattr(type(layer), "track_error") else 0
        _KINDS[type(layer)] = kind
    return kind


def _switched(layers) -> list:
    """The layer caches of ``layers`` that have the track_error switch (a CacheList's members
    in its place)."""
    out = []
    for layer in layers:
        kind = _kind(layer)
        if kind == SWITCHED:
            out.append(layer)
        elif kind == MEMBERS:
            out += _switched(layer.caches)
    return out


def _terms(caches: list[list]) -> list[Terms]:
    """The error terms the last update of every quantizing layer of ``caches`` recorded."""
    out = []
    for cache in caches:
        for c in _switched(cache):
            error = getattr(c, "_error", None)
            if type(error) is tuple:
                out += [t for t in error if isinstance(t, Terms)]
    return out
