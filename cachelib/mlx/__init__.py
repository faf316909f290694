"""Every KV-cache strategy of mlx-lm, written by us, speaking mlx-lm's cache protocol so that any
mlx-lm model runs with them unchanged, and able to say what it holds (``introspect()``).

Classes carry mlx-lm's names, constructor arguments and ``state`` layout (mlx-lm 0.32.2); what
goes beyond mlx-lm is keyword-only and off by default: a quantized ring
(:class:`QuantizedRotatingKVCache`, ``RotatingKVCache.to_quantized``), separate key and value
widths, quantize-after-N-tokens (``QuantizedKVCache(start=N)``), ``keep`` in
:func:`make_prompt_cache`, and caches for the ``static`` and ``kivi`` strategies.
"""

from .arrays import ArraysCache, CacheList, MambaCache
from .base import LayerCache
from .batch import BatchKVCache, BatchRotatingKVCache
from .factory import can_trim_prompt_cache, introspect, make_cache, make_prompt_cache, trim_prompt_cache
from .files import load_prompt_cache, save_prompt_cache
from .kivi import KIVICache
from .kv import ChunkedKVCache, ConcatenateKVCache, KVCache, StaticKVCache
from .quantized import QuantizedKVCache
from .registry import CACHE_CLASSES, from_mlx_lm
from .rotating import QuantizedRotatingKVCache, RotatingKVCache

__all__ = [
    "ArraysCache",
    "BatchKVCache",
    "BatchRotatingKVCache",
    "CACHE_CLASSES",
    "CacheList",
    "ChunkedKVCache",
    "ConcatenateKVCache",
    "KIVICache",
    "KVCache",
    "LayerCache",
    "MambaCache",
    "QuantizedKVCache",
    "QuantizedRotatingKVCache",
    "RotatingKVCache",
    "StaticKVCache",
    "can_trim_prompt_cache",
    "from_mlx_lm",
    "introspect",
    "load_prompt_cache",
    "make_cache",
    "make_prompt_cache",
    "save_prompt_cache",
    "trim_prompt_cache",
]
