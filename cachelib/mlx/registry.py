"""The explicit table of cache classes by name, used wherever a class name comes from outside
(a saved file, a ``CacheList`` state, a model's own ``make_cache``): never a globals() lookup.
"""

from __future__ import annotations

from .arrays import ArraysCache, CacheList, MambaCache
from .base import LayerCache, known_names
from .batch import BatchKVCache, BatchRotatingKVCache
from .kivi import KIVICache
from .kv import ChunkedKVCache, ConcatenateKVCache, KVCache, StaticKVCache
from .quantized import QuantizedKVCache
from .rotating import QuantizedRotatingKVCache, RotatingKVCache

CACHE_CLASSES: dict[str, type[LayerCache]] = {
    cls.__name__: cls
    for cls in (
        KVCache,
        ConcatenateKVCache,
        RotatingKVCache,
        QuantizedKVCache,
        QuantizedRotatingKVCache,
        ChunkedKVCache,
        StaticKVCache,
        KIVICache,
        ArraysCache,
        MambaCache,
        CacheList,
        BatchKVCache,
        BatchRotatingKVCache,
    )
}


def cache_class(name: str) -> type[LayerCache]:
    """Our class called ``name``, or a ValueError listing the known names."""
    cls = CACHE_CLASSES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown cache class {name!r}; cachelib.mlx knows: {known_names(CACHE_CLASSES)}")
    return cls


# A CacheList state names its members' classes; it looks them up here.
CacheList.member_class = staticmethod(cache_class)


def from_mlx_lm(cache) -> LayerCache:
    """Our equivalent of an mlx-lm cache object (same class name, same state); ours pass through."""
    if isinstance(cache, LayerCache):
        return cache
    name = type(cache).__name__
    if name not in CACHE_CLASSES:
        raise ValueError(
            f"cachelib.mlx has no class for the cache {name!r} (from {type(cache).__module__}); "
            f"it knows: {known_names(CACHE_CLASSES)}"
        )
    return CACHE_CLASSES[name].from_state(cache.state)
