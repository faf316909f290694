"""Whole-model caches: a model's cache is a plain list with one layer cache per layer.

:func:`make_prompt_cache` builds the model's own layout (as mlx-lm's does, but with our
classes); :func:`make_cache` builds it from a strategy spec (``cachelib.spec``), putting the
strategy on the model's full-attention layers while sliding-window and recurrent layers keep
the caches the model defines. :func:`trim_prompt_cache`, :func:`can_trim_prompt_cache` and
:func:`introspect` work on such lists.
"""

from __future__ import annotations

from ..introspect import CacheView
from ..spec import Spec, parse_spec
from .arrays import CacheList
from .base import LayerCache, check_int
from .kv import KVCache
from .quantized import check_head_dim
from .registry import from_mlx_lm
from .rotating import RotatingKVCache


def make_prompt_cache(model, max_kv_size: int | None = None, *, keep: int = 4) -> list[LayerCache]:
    """The model's cache, one layer cache per layer, as mlx-lm's ``make_prompt_cache`` builds it.

    A model with its own ``make_cache`` decides the layout (and, as in mlx-lm, ``max_kv_size``
    is then not used); its caches are rebuilt as ours with the same settings. Otherwise every
    layer gets a :class:`KVCache`, or with ``max_kv_size`` a ``RotatingKVCache(max_kv_size,
    keep)``; ``keep`` (beyond mlx-lm, which fixes it at 4) is the number of sink tokens.
    """
    if hasattr(model, "make_cache"):
        return [from_mlx_lm(c) for c in model.make_cache()]
    layers = len(model.layers)
    if max_kv_size is not None:
        check_int("max_kv_size", max_kv_size, 1, "make_prompt_cache")
        return [RotatingKVCache(max_size=max_kv_size, keep=keep) for _ in range(layers)]
    return [KVCache() for _ in range(layers)]


def make_cache(model, spec: Spec | str) -> list[LayerCache]:
    """The model's cache with strategy ``spec`` (a :class:`~cachelib.spec.Spec` or its text).

    The strategy replaces the cache of every full-attention layer. Layers the model gives a
    sliding window keep their ``RotatingKVCache(window)``, recurrent layers keep their state
    caches, chunked layers keep their chunk cache, except with ``sliding``, which puts a window
    of ``window`` tokens on every attention layer.
    """
    spec = parse_spec(spec)
    spec.check_backend("mlx")
    group_size = spec.get("group_size") if spec.key_bits is not None else None
    head_dim = _head_dim(model)
    if group_size is not None and head_dim is not None:
        check_head_dim(head_dim, group_size, f"make_cache({str(spec)!r})")
    own = make_prompt_cache(model)
    layers = sum(map(_full_layers, own))
    full = iter(range(layers))  # hands each full-attention layer its index, in model order
    return [_apply(spec, c, full, layers) for c in own]


def _full_layers(cache: LayerCache) -> int:
    if isinstance(cache, CacheList):
        return sum(map(_full_layers, cache.caches))
    return int(type(cache) is KVCache)


def _apply(spec: Spec, cache: LayerCache, full, layers: int) -> LayerCache:
    if isinstance(cache, CacheList):
        return CacheList(*(_apply(spec, c, full, layers) for c in cache.caches))
    if type(cache) is RotatingKVCache:  # the model's own sliding-window layer
        return spec.strategy.builder("mlx")(spec) if spec.strategy.every_attention_layer else cache
    if type(cache) is not KVCache:  # recurrent state, chunked attention, ...: the model's own
        return cache
    layer = next(full)
    if spec.strategy.layered:  # the layer's depth decides its cache (PyramidKV's budgets)
        return spec.strategy.builder("mlx")(spec, layer=layer, layers=layers)
    return spec.strategy.builder("mlx")(spec)


def _head_dim(model) -> int | None:
    """The attention head dimension from the model's args (None for attention-free models)."""
    args = getattr(model, "args", None)
    args = getattr(args, "text_config", None) or args
    if isinstance(args, dict):
        head_dim, hidden, heads = args.get("head_dim"), args.get("hidden_size"), args.get("num_attention_heads")
    else:
        head_dim = getattr(args, "head_dim", None)
        hidden, heads = getattr(args, "hidden_size", None), getattr(args, "num_attention_heads", None)
    if head_dim:
        return int(head_dim)
    if hidden and heads:
        return int(hidden) // int(heads)
    return None


def can_trim_prompt_cache(cache: list) -> bool:
    """Whether every layer cache can drop its newest tokens."""
    return all(c.is_trimmable() for c in cache)


def trim_prompt_cache(cache: list, num_tokens: int) -> int:
    """Drop the newest ``num_tokens`` tokens from every layer, in place, when all layers can;
    returns the number dropped (0 when the cache cannot be trimmed)."""
    check_int("num_tokens", num_tokens, 0, "trim_prompt_cache")
    if not cache or not can_trim_prompt_cache(cache):
        return 0
    return [c.trim(num_tokens) for c in cache][0]


def introspect(cache: list) -> list[CacheView]:
    """One :class:`~cachelib.introspect.CacheView` per layer of a model's cache."""
    return [c.introspect() for c in cache]
