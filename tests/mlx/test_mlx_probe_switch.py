"""The MLX probe's walk over a whole-model cache (the error switch, twice a step, and the error
terms each forward left): every quantizing layer cache, the members of a CacheList in its place,
and no other; the figures read for several caches together equal each layer's read alone."""

from __future__ import annotations

import mlx.core as mx
import pytest

from cachelib.mlx.arrays import CacheList
from cachelib.mlx.kivi import KIVICache
from cachelib.mlx.kv import KVCache
from cachelib.mlx.probe import MLXProbe, _terms
from cachelib.mlx.quantized import QuantizedKVCache


def _cache():
    return [
        KVCache(),
        QuantizedKVCache(group_size=32, bits=4),
        CacheList(QuantizedKVCache(group_size=64, bits=8), KVCache()),
        KIVICache(bits=2, group_size=32, residual=1),
    ]


def _quantizing(cache):
    return [cache[1], cache[2].caches[0], cache[3]]


def _feed(caches, seed: int, tokens: int):
    mx.random.seed(seed)
    for cache in caches:
        for layer in cache:
            for c in getattr(layer, "caches", (layer,)):
                k = mx.random.normal((1, 2, tokens, 64)) * 3
                c.update_and_fetch(k, mx.random.normal((1, 2, tokens, 64)))


def test_the_switch_reaches_every_quantizing_cache_and_no_other():
    probe = MLXProbe(model=None)
    caches = [_cache(), _cache()]
    for cache in caches:
        probe.set_track_error(cache, True)
        assert all(c.track_error for c in _quantizing(cache))
        assert not any(hasattr(c, "track_error") for c in (cache[0], cache[2].caches[1]))
    _feed(caches, seed=1, tokens=5)
    _feed(caches, seed=2, tokens=1)
    terms = _terms(caches)
    assert len(terms) == 2 * 3 * 2  # keys and values, three quantizing caches, two whole-model caches
    # in the order of the layers (members in place), keys before values: the stacks the figures
    # are computed in, as the walk made them before its class lookup
    walked = [
        t
        for cache in caches
        for layer in cache
        for c in getattr(layer, "caches", (layer,))
        if isinstance(getattr(c, "_error", None), tuple)
        for t in c._error
    ]
    assert len(walked) == len(terms) and all(a is b for a, b in zip(terms, walked))
    alone = [_cache(), _cache()]
    for cache in alone:
        probe.set_track_error(cache, True)
    _feed(alone, seed=1, tokens=5)
    _feed(alone, seed=2, tokens=1)
    probe.pending(caches)
    together = probe.views_of(caches)
    for cache, views, other in zip(caches, together, alone):
        got = [views[1].quant_error, cache[2].caches[0].introspect().quant_error, views[3].quant_error]
        own = [c.introspect().quant_error for c in _quantizing(other)]
        for a, b in zip(got, own):  # float32 sums, stacked or alone: equal to rounding
            assert a.key_rel_rms == pytest.approx(b.key_rel_rms, rel=1e-5) and a.key_max_abs == b.key_max_abs
            assert a.value_rel_rms == pytest.approx(b.value_rel_rms, rel=1e-5) and a.value_max_abs == b.value_max_abs
            assert a.key_rel_rms > 0
    for cache in caches:
        probe.set_track_error(cache, False)
        assert not any(c.track_error for c in _quantizing(cache))
