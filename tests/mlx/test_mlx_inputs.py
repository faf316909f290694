"""Bad input is refused with a ValueError that names the argument and what is allowed."""

from __future__ import annotations

import mlx.core as mx
import pytest

import cachelib.mlx as ours


@pytest.mark.parametrize(
    "build, words",
    [
        (lambda: ours.RotatingKVCache(0), ["max_size", ">= 1"]),
        (lambda: ours.RotatingKVCache(-3, 0), ["max_size", ">= 1"]),
        (lambda: ours.RotatingKVCache(4, keep=4), ["keep=4", "max_size=4", "0..3"]),
        (lambda: ours.RotatingKVCache(4, keep=-1), ["keep", ">= 0"]),
        (lambda: ours.QuantizedRotatingKVCache(0, bits=4), ["max_size"]),
        (lambda: ours.QuantizedRotatingKVCache(8, 8, bits=4), ["keep=8", "max_size=8"]),
        (lambda: ours.QuantizedKVCache(bits=7), ["bits=7", "2, 3, 4, 5, 6, 8"]),
        (lambda: ours.QuantizedKVCache(bits=1), ["bits=1", "2, 3, 4, 5, 6, 8"]),
        (lambda: ours.QuantizedKVCache(group_size=48), ["group_size=48", "32, 64, 128"]),
        (lambda: ours.QuantizedKVCache(bits=4, value_bits=9), ["value_bits=9", "2, 3, 4, 5, 6, 8"]),
        (lambda: ours.QuantizedKVCache(start=-1), ["start", ">= 0"]),
        (lambda: ours.QuantizedRotatingKVCache(8, bits=16), ["bits=16"]),
        (lambda: ours.KIVICache(residual=0), ["residual", ">= 1"]),
        (lambda: ours.KIVICache(bits=0), ["bits=0"]),
        (lambda: ours.ChunkedKVCache(0), ["chunk_size", ">= 1"]),
        (lambda: ours.StaticKVCache(0), ["max_len", ">= 1"]),
        (lambda: ours.KVCache(step=0), ["step", ">= 1"]),
        (lambda: ours.BatchRotatingKVCache(0, [0]), ["max_size"]),
        (lambda: ours.KVCache().to_quantized(bits=7), ["bits=7", "2, 3, 4, 5, 6, 8"]),
        (lambda: ours.RotatingKVCache(8).to_quantized(group_size=16), ["group_size=16", "32, 64, 128"]),
    ],
)
def test_constructors_refuse_bad_arguments_naming_them(build, words):
    with pytest.raises(ValueError) as err:
        build()
    for word in words:
        assert word in str(err.value), f"{word!r} not in {err.value}"


@pytest.mark.parametrize(
    "make",
    [
        ours.KVCache,
        ours.ConcatenateKVCache,
        lambda: ours.RotatingKVCache(8, 2),
        lambda: ours.QuantizedKVCache(32, 4),
        lambda: ours.QuantizedRotatingKVCache(8, 2, 32, 4),
        lambda: ours.ChunkedKVCache(8),
        lambda: ours.StaticKVCache(16),
        lambda: ours.KIVICache(4, 32, 4),
        lambda: ours.BatchKVCache([0, 1]),
        lambda: ours.BatchRotatingKVCache(8, [0, 1]),
    ],
)
def test_negative_trim_is_refused_naming_n(make):
    cache = make()
    rows = cache.offset.shape[0] if isinstance(cache.offset, mx.array) else 1
    cache.update_and_fetch(mx.ones((rows, 1, 3, 32)), mx.ones((rows, 1, 3, 32)))
    with pytest.raises(ValueError, match=r"trim: n must be an integer >= 0.*got -1"):
        cache.trim(-1)
    assert cache.trim(1) == 1  # a good trim still works


@pytest.mark.parametrize(
    "make",
    [
        lambda: ours.QuantizedKVCache(group_size=64, bits=4),
        lambda: ours.QuantizedKVCache(group_size=64, bits=4, start=2),
        lambda: ours.QuantizedRotatingKVCache(8, 0, group_size=64, bits=4),
        lambda: ours.KIVICache(residual=1, group_size=64, bits=4),
    ],
)
def test_group_size_that_does_not_divide_head_dim_is_refused_naming_both(make):
    cache = make()
    with pytest.raises(ValueError, match=r"group_size=64.*head_dim=32.*allowed group sizes for it: 32"):
        for _ in range(3):
            cache.update_and_fetch(mx.ones((1, 1, 1, 32)), mx.ones((1, 1, 1, 32)))


def test_kvcache_to_quantized_refuses_a_group_size_that_does_not_divide_head_dim():
    cache = ours.KVCache()
    cache.update_and_fetch(mx.ones((1, 1, 2, 32)), mx.ones((1, 1, 2, 32)))
    with pytest.raises(ValueError, match=r"group_size=64.*head_dim=32"):
        cache.to_quantized(group_size=64, bits=4)


def test_static_cache_refuses_to_grow_and_stays_unchanged():
    cache = ours.StaticKVCache(5)
    k = mx.arange(3 * 32, dtype=mx.float32).reshape(1, 1, 3, 32)
    cache.update_and_fetch(k, k)
    before = [mx.array(x) if isinstance(x, mx.array) else x for x in cache.state]
    with pytest.raises(ValueError, match=r"max_len=5.*3 are held.*at most 2"):
        cache.update_and_fetch(mx.ones((1, 1, 3, 32)), mx.ones((1, 1, 3, 32)))
    after = cache.state
    assert after[2:] == tuple(before[2:]) and cache.offset == 3
    assert all(mx.array_equal(a, b).item() for a, b in zip(after[:2], before[:2]))
    keys, _ = cache.update_and_fetch(mx.ones((1, 1, 2, 32)), mx.ones((1, 1, 2, 32)))
    assert keys.shape[2] == 5 and cache.keys.shape[2] == 5  # never grew


@pytest.mark.parametrize(
    "cls, state, words",
    [
        (ours.KVCache, (None, None), ["KVCache state must have 3 entries", "keys, values, offset"]),
        (ours.KVCache, (mx.zeros((1, 1, 4, 8)), mx.zeros((1, 1, 4, 8)), 9), ["offset=9", "4 slots"]),
        (ours.KVCache, (mx.zeros((1, 1, 4, 8)), mx.zeros((1, 1, 3, 8)), 2), ["keys hold 4 tokens but values hold 3"]),
        (ours.RotatingKVCache, (None, None, 0, 5, 5, 0), ["keep=5", "max_size=5"]),
        (ours.QuantizedKVCache, (None, None, 0, 64, 7), ["bits=7"]),
        (ours.ArraysCache, ([], None, None), ["ArraysCache state: cache must be a non-empty list"]),
        (ours.CacheList, [((None, None, 0), "NoSuchCache")], ["unknown cache class 'NoSuchCache'", "KVCache"]),
        # one padding entry for several rows loads (mlx-lm's own files do that); two for three rows cannot
        (
            ours.BatchKVCache,
            (None, None, mx.array([0, 1, 2]), mx.array([0, 1]), 0),
            ["left_padding has 2 entries", "one per row"],
        ),
    ],
)
def test_inconsistent_state_is_refused_naming_the_class(cls, state, words):
    with pytest.raises(ValueError) as err:
        cls.from_state(state)
    for word in words:
        assert word in str(err.value), f"{word!r} not in {err.value}"
