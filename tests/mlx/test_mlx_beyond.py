"""What goes beyond mlx-lm: the quantized ring, separate key and value widths, quantize after N
tokens, and the static and KIVI caches - each pinned against a plain reference computation."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import cachelib.mlx as ours


def _q(x, gs, bits):
    """What group-wise quantization at ``bits`` makes of ``x`` (the reference)."""
    return mx.dequantize(*mx.quantize(x, group_size=gs, bits=bits), group_size=gs, bits=bits)


def _deq(parts, gs, bits):
    return mx.dequantize(*parts, group_size=gs, bits=bits)


def test_quantized_ring_holds_what_the_plain_ring_holds_quantized(kv, same):
    """Same calls on RotatingKVCache and QuantizedRotatingKVCache: every update hands back
    parts whose dequantization equals the plain ring's arrays quantized; masks, offsets,
    sizes and trims are the plain ring's."""
    rng = np.random.default_rng(601)
    for _ in range(150):
        max_size = int(rng.integers(1, 20))
        keep = int(rng.integers(0, min(max_size, 4)))
        bits = int(rng.choice([2, 4, 8]))
        plain, packed = ours.RotatingKVCache(max_size, keep), ours.QuantizedRotatingKVCache(max_size, keep, 32, bits)
        assert packed.bits == bits and not hasattr(plain, "bits")
        for i in range(int(rng.integers(4, 16))):
            if rng.random() < 0.7:
                S = 1 if rng.random() < 0.6 else int(rng.integers(2, 9))
                k, v = kv(rng, 1, 1, S, 32)
                pk, pv = plain.update_and_fetch(k, v)
                qk, qv = packed.update_and_fetch(k, v)
                assert isinstance(qk, list) and len(qk) == 3
                same.check(f"{i} keys", _deq(qk, 32, bits), _q(pk, 32, bits))
                same.check(f"{i} values", _deq(qv, 32, bits), _q(pv, 32, bits))
            elif plain.is_trimmable():
                n = int(rng.integers(0, 3))
                same.check(f"{i} trim", packed.trim(n), plain.trim(n))
            w = None if rng.random() < 0.5 else int(rng.integers(1, 8))
            N = int(rng.choice([1, 3]))
            same.check(f"{i} mask", packed.make_mask(N, window_size=w), plain.make_mask(N, window_size=w))
            same.check(f"{i} offset/size", (packed.offset, packed.size()), (plain.offset, plain.size()))
        same.flush()


def test_rotating_to_quantized_continues_the_same_ring(kv, same):
    rng = np.random.default_rng(602)
    plain = ours.RotatingKVCache(8, 2)
    for S in (5, 1, 1, 1, 1, 1):
        plain.update_and_fetch(*kv(rng, 1, 2, S, 64))
    packed = plain.to_quantized(group_size=64, bits=8)
    assert isinstance(packed, ours.QuantizedRotatingKVCache)
    assert (packed.offset, packed.introspect().write_index) == (plain.offset, plain.introspect().write_index)
    for _ in range(5):
        k, v = kv(rng, 1, 2, 1, 64)
        same.check("keys", _deq(packed.update_and_fetch(k, v)[0], 64, 8), _q(plain.update_and_fetch(k, v)[0], 64, 8))
    same.flush()


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: ours.QuantizedKVCache(32, 8, key_bits=8, value_bits=4), id="linear"),
        pytest.param(lambda: ours.QuantizedRotatingKVCache(6, 1, 32, key_bits=8, value_bits=4), id="ring"),
    ],
)
def test_separate_key_and_value_bits_store_quantized_and_hand_back_dequantized(make, kv, same):
    rng = np.random.default_rng(603)
    cache = make()
    plain = ours.RotatingKVCache(6, 1) if isinstance(cache, ours.QuantizedRotatingKVCache) else ours.KVCache()
    assert not hasattr(cache, "bits")  # mlx-lm's attention must not take its one-width path
    for S in (4, 1, 1, 3, 1, 1):
        k, v = kv(rng, 1, 2, S, 64)
        got_k, got_v = cache.update_and_fetch(k, v)
        want_k, want_v = plain.update_and_fetch(k, v)
        same.check("keys", got_k, _q(want_k, 32, 8))
        same.check("values", got_v, _q(want_v, 32, 4))
    same.flush()
    packed_k, packed_v = cache.keys[0], cache.values[0]
    assert packed_k.dtype == mx.uint32 and packed_k.shape[-1] == 64 * 8 // 32 and packed_v.shape[-1] == 64 * 4 // 32
    view = cache.introspect()
    assert (view.key_bits, view.value_bits, view.bits) == (8, 4, None)


def test_quantize_after_start_looks_unquantized_until_it_converts(kv):
    rng = np.random.default_rng(604)
    cache = ours.QuantizedKVCache(64, 4, start=6)
    k, v = kv(rng, 1, 1, 5, 64)
    keys, _ = cache.update_and_fetch(k, v)
    assert not hasattr(cache, "bits") and isinstance(keys, mx.array)
    assert mx.array_equal(keys, k).item()  # full precision, untouched
    assert cache.introspect().key_bits is None and cache.introspect().quantized_tokens == 0
    cache.update_and_fetch(*kv(rng, 1, 1, 1, 64))  # offset before: 5 < 6
    assert not hasattr(cache, "bits")
    keys, _ = cache.update_and_fetch(*kv(rng, 1, 1, 1, 64))  # offset before: 6 -> converts
    assert cache.bits == 4 and isinstance(keys, list) and keys[0].shape[2] == 7
    view = cache.introspect()
    assert (view.key_bits, view.quantized_tokens, view.tokens_held) == (4, 7, 7)


def test_static_cache_preallocates_and_hands_back_the_filled_prefix(kv, same):
    rng = np.random.default_rng(605)
    static, plain = ours.StaticKVCache(12), ours.KVCache()
    for S in (5, 1, 1, 2):
        k, v = kv(rng, 2, 1, S, 32)
        same.check("update", static.update_and_fetch(k, v), plain.update_and_fetch(k, v))
        assert static.keys.shape[2] == 12
    same.check("trim", static.trim(3), plain.trim(3))
    k, v = kv(rng, 2, 1, 4, 32)
    same.check("after trim", static.update_and_fetch(k, v), plain.update_and_fetch(k, v))
    same.check("mask", static.make_mask(3, return_array=True), plain.make_mask(3, return_array=True))
    same.flush()
    view = static.introspect()
    assert (view.capacity, view.max_capacity, view.tokens_held) == (12, 12, 10)


def test_kivi_quantizes_the_prompt_then_flushes_the_residual_like_transformers(kv, same):
    """transformers' QuantizedCache bookkeeping: the prompt is quantized at once; new tokens wait
    in a full-precision residual until residual + new >= residual_length, then all of them are
    quantized. The torch QuantizedLayer (tested against transformers) gives the same counts and,
    on the same quantizer codes, the same values."""
    import torch

    from cachelib.torch import QuantizedLayer

    rng = np.random.default_rng(606)
    cache, plain = ours.KIVICache(residual=5, group_size=32, bits=2), ours.KVCache()
    layer = QuantizedLayer(nbits=2, q_group_size=32, residual_length=5)
    assert not hasattr(cache, "bits")
    quantized = 0
    for i, S in enumerate((3, 1, 4, 1, 1, 7, 1, 2)):
        k, v = kv(rng, 1, 2, S, 32)
        got_k, got_v = cache.update_and_fetch(k, v)
        all_k, all_v = plain.update_and_fetch(k, v)
        ref_k, ref_v = layer.update(torch.from_numpy(np.array(k)), torch.from_numpy(np.array(v)))
        n = all_k.shape[2]
        if i == 0:  # the prompt comes back as it went in
            same.check("prompt keys", got_k, all_k)
        else:  # tokens already in the store come back quantized, the rest exactly
            same.check("exact new keys", got_k[..., quantized:, :], all_k[..., quantized:, :])
            same.check("exact new values", got_v[..., quantized:, :], all_v[..., quantized:, :])
            same.check("quantized keys", got_k[..., :quantized, :], _q(all_k[..., :quantized, :], 32, 2))
        np.testing.assert_allclose(np.array(got_k), ref_k.numpy(), atol=1e-5)
        np.testing.assert_allclose(np.array(got_v), ref_v.numpy(), atol=1e-5)
        view, ref_view = cache.introspect(), layer.introspect()
        assert (
            (view.tokens_held, view.quantized_tokens, view.offset)
            == (
                ref_view.tokens_held,
                ref_view.quantized_tokens,
                ref_view.offset,
            )
            == (n, view.quantized_tokens, n)
        )
        assert view.bytes_allocated == ref_view.bytes_allocated
        assert n - view.quantized_tokens < 5  # the residual never reaches residual_length
        quantized = view.quantized_tokens
    same.flush()
    assert cache.trim(3) == plain.trim(3) == 3
    assert cache.introspect().offset == 17
    same.check("mask", cache.make_mask(2, return_array=True), plain.make_mask(2, return_array=True))
    k, v = kv(rng, 1, 2, 1, 32)
    same.check("after trim", cache.update_and_fetch(k, v)[0][..., -1:, :], plain.update_and_fetch(k, v)[0][..., -1:, :])
    same.flush()
