"""Bad input gets a clear error naming the limit, and leaves the cache as it was."""

from __future__ import annotations

import pytest
import torch

import cachelib.torch as ct


def _kv(n, dim=64, batch=1):
    x = torch.randn(batch, 2, n, dim)
    return x, x.clone()


@pytest.mark.parametrize(
    "make",
    [
        ct.DynamicLayer,
        lambda: ct.StaticLayer(32),
        lambda: ct.KVCacheLayer(),
        lambda: ct.ChunkedKVCacheLayer(16),
        lambda: ct.RotatingKVCacheLayer(16, 2),
        lambda: ct.QuantizedLayer(4, 32, 4),
        lambda: ct.QuantizedKVCacheLayer(32, 4),
    ],
    ids=lambda m: "layer",
)
def test_crop_beyond_the_tokens_held_empties_the_layer_and_a_positive_count_is_refused(make):
    # transformers (and mlx-lm's trim) empty the layer on an over-crop; ours raised (issue 17)
    layer = make()
    layer.update(*_kv(5))
    with pytest.raises(ct.CropError, match="must be <= 0") as refused:
        layer.crop(2)
    assert isinstance(refused.value, ValueError) and isinstance(refused.value, RuntimeError)
    assert layer.get_seq_length() == 5
    layer.crop(-2)
    assert layer.get_seq_length() == 3
    layer.crop(-6)
    assert layer.get_seq_length() == 0 and layer.introspect().tokens_held == 0
    layer.update(*_kv(2))  # and it goes on from empty
    assert layer.get_seq_length() == 2


def test_ring_refuses_to_crop_once_it_has_overwritten_tokens():
    ring = ct.RotatingKVCacheLayer(4, 1)
    for _ in range(6):
        ring.update(*_kv(1))
    with pytest.raises(ValueError, match="max_size=4 has already overwritten tokens"):
        ring.crop(-1)
    assert ring.get_seq_length() == 6


def test_sliding_window_refuses_to_crop_past_the_window_without_recording():
    layer = ct.DynamicSlidingWindowLayer(4)
    layer.update(*_kv(6))
    with pytest.raises(ValueError, match="activate_past_recording"):
        layer.crop(-1)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma3"])
def test_static_cache_overflow_is_refused_before_any_layer_changes(tiny, preset):
    model = tiny(preset)
    cache = ct.make_cache(model, "static:max_len=12")
    too_long = torch.arange(1, 14).unsqueeze(0)  # 13 tokens
    with (
        torch.no_grad(),
        pytest.raises(ValueError, match=r"13 new tokens at position 0 do not fit in max_cache_len=12"),
    ):
        model(too_long, cache=cache)
    assert cache.get_seq_length() == 0 and cache.nbytes == 0  # nothing written, nothing allocated
    with torch.no_grad():
        model(too_long[:, :10], cache=cache)
        before = [t.clone() for layer in cache.layers for t in layer.held_arrays()]
        with pytest.raises(ValueError, match=r"3 new tokens at position 10 .* \(room for 2\)"):
            model(too_long[:, :3], cache=cache)
        after = [t for layer in cache.layers for t in layer.held_arrays()]
        assert cache.get_seq_length() == 10 and all(torch.equal(a, b) for a, b in zip(before, after))
        model(too_long[:, :2], cache=cache)  # what fits still goes in
    assert cache.get_seq_length() == 12


def test_unsupported_quantization_settings_name_the_allowed_values():
    with pytest.raises(ValueError, match="bits=3 is not supported; allowed: 2, 4, 8"):
        ct.QuantizedKVCacheLayer(64, 3)
    with pytest.raises(ValueError, match="value_bits=6 is not supported; allowed: 2, 4, 8"):
        ct.QuantizedKVCache(64, 4, value_bits=6)
    with pytest.raises(ValueError, match="group_size=16 is not supported; allowed: 32, 64, 128"):
        ct.RotatingKVCacheLayer(8, bits=4, group_size=16)
    with pytest.raises(ValueError, match="nbits=5 is not supported; allowed: 2, 4, 8"):
        ct.QuantizedCache(config=None, nbits=5)
    with pytest.raises(ValueError, match="group_size=64 must divide head_dim=48"):
        ct.QuantizedKVCacheLayer(64, 4).update(*_kv(2, dim=48))
    with pytest.raises(ValueError, match="needs bits=, or both key_bits= and value_bits="):
        ct.RotatingKVCacheLayer(8, key_bits=4)


def test_bad_sizes_name_the_allowed_range():
    with pytest.raises(ValueError, match="keep=8 must be an int in 0..7"):
        ct.RotatingKVCacheLayer(8, keep=8)
    with pytest.raises(ValueError, match="max_size must be an int >= 1"):
        ct.RotatingKVCache(0)
    with pytest.raises(ValueError, match="step must be an int >= 1"):
        ct.KVCache(step=0)
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
        ct.ChunkedKVCacheLayer(0)
    with pytest.raises(ValueError, match="max_cache_len must be an int >= 1"):
        ct.StaticLayer(0)


def test_quanto_and_hqq_backends_say_what_to_install(tiny):
    config = tiny("tiny-llama").config
    with pytest.raises(ImportError, match=r"pip install optimum-quanto"):
        ct.QuantizedCache(config, backend="quanto")
    with pytest.raises(ImportError, match=r"pip install hqq"):
        ct.QuantizedCache(config, backend="hqq")
    with pytest.raises(ValueError, match="backend='fp4' is not supported; allowed: cachelib, quanto, hqq"):
        ct.QuantizedCache(config, backend="fp4")


def test_unknown_strategies_and_knobs_are_refused_by_make_cache(tiny):
    model = tiny("tiny-llama")
    with pytest.raises(ValueError, match="unknown strategy 'ring'"):
        ct.make_cache(model, "ring:max_size=4")
    with pytest.raises(ValueError, match="keep=9 must be < max_size=8"):
        ct.make_cache(model, "rotating:max_size=8,keep=9")
