"""Introspection tells the truth: slot tables name the positions actually stored in each slot,
byte counts equal the bytes of the arrays held, and the quantization-error probe reports only
when asked, for updates that quantized something."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch_helpers import assert_slots_true, positional_kv

import cachelib.torch as ct
from cachelib.introspect import quant_error
from cachelib.torch.quantizer import Quantizer

DIM = 32


def _stored(layer) -> torch.Tensor:
    """The keys a layer holds, in slot order, at full precision."""
    if isinstance(layer, ct.QuantizedLayer):
        parts = []
        if layer.quantized_keys is not None:
            parts.append(layer.quantizer.dequantize(layer.quantized_keys))
        return torch.cat(parts + [layer.keys], dim=-2)
    if isinstance(layer.keys, tuple):
        return layer.key_codec.dense(layer.keys) if hasattr(layer, "key_codec") else None
    return layer.keys


def _storage_bytes(layer) -> int:
    """Bytes of the storage behind every held array (views count their whole storage once)."""
    seen, total = set(), 0
    for t in layer.held_arrays():
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


LAYERS = {
    "DynamicLayer": lambda rng: ct.DynamicLayer(),
    "DynamicSlidingWindowLayer": lambda rng: ct.DynamicSlidingWindowLayer(int(rng.integers(2, 9))),
    "StaticLayer": lambda rng: ct.StaticLayer(64),
    "StaticSlidingWindowLayer": lambda rng: ct.StaticSlidingWindowLayer(64, int(rng.integers(2, 9))),
    "QuantizedLayer": lambda rng: ct.QuantizedLayer(8, 32, int(rng.integers(1, 6))),
    "KVCacheLayer": lambda rng: ct.KVCacheLayer(step=4),
    "ChunkedKVCacheLayer": lambda rng: ct.ChunkedKVCacheLayer(int(rng.integers(2, 9)), step=4),
    "RotatingKVCacheLayer": lambda rng: ct.RotatingKVCacheLayer(
        int(rng.integers(2, 9)), int(rng.integers(0, 2)), step=4
    ),
    "QuantizedRotatingKVCache": lambda rng: ct.RotatingKVCacheLayer(
        int(rng.integers(3, 9)), 1, step=4, bits=8, group_size=32
    ),
    "QuantizedKVCacheLayer": lambda rng: ct.QuantizedKVCacheLayer(32, 8, start=int(rng.integers(0, 6)), step=4),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_slot_table_and_bytes_match_what_the_layer_holds(name):
    """Keys encode their position; after every call of a random sequence (multi-token
    prefills, wrap-around, trims, crops), the slot table equals the positions found in the
    slots, and bytes allocated equal the held arrays' bytes, storage included."""
    for seed in range(150):
        rng = np.random.default_rng(1_000 + seed)
        layer = LAYERS[name](rng)
        for _ in range(int(rng.integers(2, 12))):
            can_crop = layer.get_seq_length() > 0 and getattr(layer, "is_croppable", False)
            if isinstance(layer, ct.DynamicSlidingWindowLayer):
                can_crop = can_crop and layer.get_seq_length() < layer.sliding_window
            if isinstance(layer, ct.StaticSlidingWindowLayer):
                can_crop = can_crop and layer.get_seq_length() <= layer.max_cache_len
            if can_crop and rng.random() < 0.2:
                layer.crop(-int(rng.integers(0, min(layer.get_seq_length(), layer.introspect().tokens_held) + 1)))
            else:
                n = 1 if rng.random() < 0.6 else int(rng.integers(2, 7))
                if isinstance(layer, ct.StaticLayer) and not layer.is_sliding and layer.room() < n:
                    break
                k, v = positional_kv(1, 1, layer.get_seq_length(), n, DIM)
                layer.update(k, v)
            view = layer.introspect()
            assert view.offset == layer.get_seq_length()
            assert view.bytes_allocated == layer.nbytes == sum(t.nbytes for t in layer.held_arrays())
            assert view.bytes_allocated == _storage_bytes(layer)
            assert 0 <= view.bytes_used <= view.bytes_allocated
            assert view.tokens_held <= view.capacity
            assert view.evicted == view.offset - view.tokens_held
            assert_slots_true(view, _stored(layer))


def test_ring_slot_table_after_wrap_names_sinks_and_most_recent_tokens():
    ring = ct.RotatingKVCacheLayer(max_size=6, keep=2, step=4)
    k, v = positional_kv(1, 1, 0, 5, 8)
    ring.update(k, v)  # prefill 0..4
    for pos in range(5, 13):  # decode wraps the ring
        k, v = positional_kv(1, 1, pos, 1, 8)
        ring.update(k, v)
    view = ring.introspect()
    assert (view.layout, view.capacity, view.tokens_held, view.keep) == ("ring", 6, 6, 2)
    assert sorted(view.slot_positions().tolist()) == [0, 1, 9, 10, 11, 12]
    assert view.evicted == 13 - 6
    assert_slots_true(view, ring.keys)


def test_whole_cache_introspect_gives_one_view_per_layer(tiny):
    model = tiny("tiny-gemma3")
    cache = ct.make_cache(model, "rotating:max_size=16,keep=2")
    with torch.no_grad():
        model(torch.arange(1, 40).unsqueeze(0), cache=cache)
    views = cache.introspect()
    assert len(views) == len(model.config.layer_types)
    kinds = [v.kind for v in views]
    assert kinds == [
        "RotatingKVCache" if t == "full_attention" else "DynamicSlidingWindowLayer" for t in model.config.layer_types
    ]
    assert sum(v.bytes_allocated for v in views) == cache.nbytes


def test_quant_error_probe_is_off_by_default_and_measures_each_update_when_on():
    layer = ct.QuantizedKVCacheLayer(32, 4, step=8)
    rng = np.random.default_rng(0)
    k = torch.from_numpy(rng.standard_normal((1, 2, 3, 64)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((1, 2, 3, 64)).astype(np.float32))
    layer.update(k, v)
    assert layer.introspect().quant_error is None  # off: nothing computed
    layer.track_error = True
    layer.update(k, v)
    err = layer.introspect().quant_error
    q = Quantizer(4, 32)
    want_k = quant_error(k.numpy(), q.dequantize(q.quantize(k)).numpy())
    want_v = quant_error(v.numpy(), q.dequantize(q.quantize(v)).numpy())
    assert err.key_rel_rms == pytest.approx(want_k[0]) and err.key_max_abs == pytest.approx(want_k[1])
    assert err.value_rel_rms == pytest.approx(want_v[0]) and err.value_max_abs == pytest.approx(want_v[1])
    assert 0 < err.key_rel_rms < 0.2


def test_quant_error_is_none_for_an_update_that_quantized_nothing():
    """KIVI keeps new tokens in its full-precision residual until it is full."""
    layer = ct.QuantizedLayer(nbits=4, q_group_size=32, residual_length=4)
    layer.track_error = True
    rng = np.random.default_rng(1)
    x = lambda n: torch.from_numpy(rng.standard_normal((1, 1, n, 32)).astype(np.float32))  # noqa: E731
    layer.update(x(3), x(3))  # the first update quantizes the prompt
    assert layer.introspect().quant_error is not None
    layer.update(x(1), x(1))  # goes to the residual
    assert layer.introspect().quant_error is None
    layer.update(x(3), x(3))  # residual + new >= 4: flushed, quantized
    assert layer.introspect().quant_error.key_rel_rms > 0


def test_cache_track_error_switch_reaches_every_quantizing_layer(tiny):
    model = tiny("tiny-llama")
    cache = ct.make_cache(model, "quantized:bits=4,group_size=32")
    cache.track_error = True
    with torch.no_grad():
        model(torch.arange(1, 9).unsqueeze(0), cache=cache)
    assert all(v.quant_error is not None and v.quant_error.key_rel_rms > 0 for v in cache.introspect())
    cache.track_error = False
    assert all(v.quant_error is None for v in cache.introspect())


def test_quantized_storage_really_takes_bits_over_8_bytes_per_element():
    """Per token and kv head: head_dim * bits / 8 bytes of codes + 2 * head_dim / group_size
    scales and biases in the input dtype (the MLX layout)."""
    for bits, group, dtype in [(2, 32, torch.float32), (4, 64, torch.float16), (8, 128, torch.bfloat16)]:
        layer = ct.QuantizedKVCacheLayer(group, bits, step=256)
        k = torch.randn(2, 3, 5, 128).to(dtype)
        layer.update(k, k)
        item = torch.empty((), dtype=dtype).element_size()
        per_token_head = 128 * bits // 8 + 2 * (128 // group) * item
        view = layer.introspect()
        assert view.bytes_allocated == 2 * 2 * 3 * 256 * per_token_head  # K and V, batch 2, 3 heads, 256 slots
        assert view.bytes_used == 2 * 2 * 3 * 5 * per_token_head
        assert view.dtype == str(dtype).removeprefix("torch.")
        assert (view.key_bits, view.value_bits, view.group_size, view.quantized_tokens) == (bits, bits, group, 5)


def test_views_equal_the_mlx_backend_views_for_the_same_updates():
    """Same strategy, same update sizes, same dtype: every CacheView field of ours equals the
    view of cachelib.mlx's class of the same name (bytes, slots, ring pointer, bits...)."""
    cm = pytest.importorskip("cachelib.mlx")
    mx = pytest.importorskip("mlx.core")
    pairs = {
        "KVCache": (lambda: cm.KVCache(), lambda: ct.KVCacheLayer()),
        "RotatingKVCache": (lambda: cm.RotatingKVCache(20, 4), lambda: ct.RotatingKVCacheLayer(20, 4)),
        "QuantizedRotatingKVCache": (
            lambda: cm.QuantizedRotatingKVCache(20, 4, bits=4, group_size=32),
            lambda: ct.RotatingKVCacheLayer(20, 4, bits=4, group_size=32),
        ),
        "QuantizedKVCache": (
            lambda: cm.QuantizedKVCache(32, 8, start=24),
            lambda: ct.QuantizedKVCacheLayer(32, 8, start=24),
        ),
        "ChunkedKVCache": (lambda: cm.ChunkedKVCache(16, trim_front=True), lambda: ct.ChunkedKVCacheLayer(16)),
    }
    rng = np.random.default_rng(7)
    for name, (make_mlx, make_torch) in pairs.items():
        theirs, ours = make_mlx(), make_torch()
        for n in [16] + [1] * 30 + [5] + [1] * 5:
            x = rng.standard_normal((1, 2, n, 64)).astype(np.float32)
            theirs.update_and_fetch(mx.array(x), mx.array(x))
            ours.update(torch.from_numpy(x), torch.from_numpy(x))
            assert ours.introspect() == theirs.introspect(), name  # quant_error is not compared
