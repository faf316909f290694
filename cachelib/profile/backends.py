"""What the profiler needs from a backend: the :class:`BackendProbe` protocol, and
:func:`probe_for`, which picks the probe living next to that backend's caches
(:class:`cachelib.mlx.probe.MLXProbe`, :class:`cachelib.torch.probe.TorchProbe`).

A probe builds whole-model caches from specs, lists a cache's per-layer views (introspection
only), turns the quantization-error probe on and off, captures the attention mask each layer
cache produces for a step, and reads device memory counters.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ..introspect import CacheView
from ..models import LoadedModel
from ..spec import Spec


class BackendProbe(Protocol):
    backend: str

    def make_cache(self, spec: Spec) -> Any: ...

    def views(self, cache: Any) -> list[CacheView]: ...

    def pending(self, caches: list[Any]) -> list[Any]:
        """Probe work a forward over ``caches`` built and left uncomputed (a lazy backend),
        for the runner to compute in the forward's own evaluation; [] where there is none. The
        runner calls it once the forward has updated every cache, before it hands the logits on:
        an eager backend (torch) does that work in the call itself and returns []."""
        ...

    def set_track_error(self, cache: Any, on: bool) -> None: ...

    def masks_before(self, cache: Any, views: list[CacheView], n_queries: int) -> list[Any]:
        """Per layer, what the cache says about this step's mask (None: no token axis); taken
        before the step, with the views taken before it."""
        ...

    def masks_after(self, before: list[Any], views: list[CacheView], n_queries: int) -> list[np.ndarray | None]:
        """``masks_before`` as dense boolean (query x key) arrays, keys in the cache's slot order."""
        ...

    def capture(self, cache: Any) -> Any:
        """A context manager around one forward step: the attention-capture hook when ``cache``
        has importance layers (they score keys with the step's queries), else a no-op."""
        ...

    def reset_peak(self) -> None: ...

    def device_memory(self) -> tuple[int | None, int | None]:
        """(active bytes, peak bytes since reset_peak) of the device allocator, where it counts."""
        ...


def probe_for(loaded: LoadedModel) -> BackendProbe:
    """The probe of ``loaded``'s backend."""
    # Imported on use: a machine may have only one of the two backends installed.
    if loaded.info.backend == "mlx":
        from ..mlx.probe import MLXProbe

        return MLXProbe(loaded.model)
    from ..torch.probe import TorchProbe

    return TorchProbe(loaded.model, loaded.info.device)
