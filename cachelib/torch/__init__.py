"""cachelib's cache library for PyTorch: every transformers cache strategy and the mlx-lm
strategies, written by us, speaking transformers' ``Cache`` protocol (``model(..., cache=c)``
and ``model.generate(..., cache=c)`` run with them unchanged), each able to describe
itself with ``introspect()``.

- transformers' strategies: ``DynamicCache``, ``StaticCache``, ``QuantizedCache`` (KIVI),
  ``EncoderDecoderCache`` over the layers ``DynamicLayer``, ``DynamicSlidingWindowLayer``,
  ``StaticLayer``, ``StaticSlidingWindowLayer``, ``QuantizedLayer``, ``LinearAttentionLayer``
  and the linear + attention hybrid layers.
- mlx-lm's strategies: ``KVCache``, ``RotatingKVCache``, ``ChunkedKVCache``,
  ``QuantizedKVCache`` over per-layer classes of the same names + ``Layer``.
- ``make_cache(model, spec)`` builds one from a strategy spec string.
"""

from .base import AttentionLayer, CacheFullError, CropError
from .cache import Cache, DynamicCache, QuantizedCache, StaticCache, build_layers
from .encoder_decoder import EncoderDecoderCache
from .factory import make_cache
from .layers import DummyLayer, DynamicLayer
from .linear import (
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionAndStaticFullAttentionLayer,
    LinearAttentionAndStaticSlidingWindowAttentionLayer,
    LinearAttentionHybridLayer,
    LinearAttentionLayer,
)
from .mlx_style import (
    ChunkedKVCache,
    ChunkedKVCacheLayer,
    KVCache,
    KVCacheLayer,
    QuantizedKVCache,
    QuantizedKVCacheLayer,
    StrategyCache,
)
from .quantized import QuantizedLayer
from .quantizer import Quantizer
from .rotating import RotatingKVCache, RotatingKVCacheLayer
from .sliding import DynamicSlidingWindowLayer
from .static import StaticLayer, StaticSlidingWindowLayer

__all__ = [
    "AttentionLayer",
    "CacheFullError",
    "CropError",
    "Cache",
    "ChunkedKVCache",
    "ChunkedKVCacheLayer",
    "DummyLayer",
    "DynamicCache",
    "DynamicLayer",
    "DynamicSlidingWindowLayer",
    "EncoderDecoderCache",
    "KVCache",
    "KVCacheLayer",
    "LinearAttentionAndFullAttentionLayer",
    "LinearAttentionAndSlidingWindowAttentionLayer",
    "LinearAttentionAndStaticFullAttentionLayer",
    "LinearAttentionAndStaticSlidingWindowAttentionLayer",
    "LinearAttentionHybridLayer",
    "LinearAttentionLayer",
    "QuantizedCache",
    "QuantizedKVCache",
    "QuantizedKVCacheLayer",
    "QuantizedLayer",
    "Quantizer",
    "RotatingKVCache",
    "RotatingKVCacheLayer",
    "StaticCache",
    "StaticLayer",
    "StaticSlidingWindowLayer",
    "StrategyCache",
    "build_layers",
    "make_cache",
]
