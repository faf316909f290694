"""Introspection agrees with the arrays: for every class and random call sequence, each slot the
view says holds position p really holds the key written for position p (keys encode their
position), the slots it calls held are exactly the keys attention gets back, and
``bytes_allocated`` is the sum of ``nbytes`` of the stored arrays."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import cachelib.mlx as ours
from cachelib.introspect import quant_error

SEQUENCES = 150


def storage(cache) -> list[mx.array]:
    """Every K/V storage array a cache holds (quantized parts and residuals included)."""
    out = []
    for name in ("keys", "values", "residual_keys", "residual_values"):
        x = getattr(cache, name, None)
        if isinstance(x, (list, tuple)):
            out.extend(x)
        elif x is not None:
            out.append(x)
    return out


def slots_of(cache, read_slots) -> np.ndarray:
    """(B, T): the position each slot of ``cache`` holds, in the view's slot order."""
    if isinstance(cache, ours.KIVICache):
        parts = []
        if cache.keys is not None:
            parts.append(read_slots(cache.keys, cache.group_size, cache.key_bits))
        parts.append(read_slots(cache.residual_keys))
        return np.concatenate(parts, axis=1)
    return read_slots(cache.keys, getattr(cache, "group_size", None), getattr(cache, "key_bits", None))


def returned_positions(keys, cache, read_slots) -> np.ndarray:
    if isinstance(keys, (list, tuple)):
        return read_slots(keys, cache.group_size, cache.key_bits)
    return read_slots(keys)


def check_view(cache, read_slots, returned=None) -> None:
    view = cache.introspect()
    arrays = storage(cache)
    assert view.bytes_allocated == cache.nbytes == sum(a.nbytes for a in arrays)
    assert view.kind == type(cache).__name__
    if view.capacity:
        assert view.bytes_used * view.capacity == view.bytes_allocated * view.tokens_held
    if cache.empty():
        assert view.capacity == 0 and view.tokens_held == 0
        return
    table = view.slot_positions()
    stored = slots_of(cache, read_slots)
    assert table.shape[-1] == view.capacity == stored.shape[1], (table.shape, view.capacity, stored.shape)
    rows = np.broadcast_to(table, stored.shape) if table.ndim == 1 else table
    if isinstance(cache, ours.BatchRotatingKVCache):  # the ring view is on the padded timeline
        rows = cache.row_slot_positions()
    held = rows >= 0
    assert (stored[held] == rows[held]).all(), f"slot table {rows} but slots hold {stored}"
    if not view.left_padding:  # single sequence: the table counts exactly the held tokens
        assert held[0].sum() == view.tokens_held
        assert view.evicted == view.offset - view.tokens_held
        assert (table < view.offset).all()
    if returned is not None:
        got = returned_positions(returned, cache, read_slots)
        for r in range(got.shape[0]):
            visible = np.sort(got[r][got[r] >= 0])
            assert (visible == np.sort(rows[r][held[r]])).all(), f"attention sees {visible}, view says {rows[r]}"


def run(rng, cache, positions_kv, read_slots, *, trims=True, D=64, extra=None):
    B, H = int(rng.integers(1, 3)), int(rng.integers(1, 3))
    if hasattr(cache, "step") and rng.random() < 0.5:
        cache.step = int(rng.integers(1, 9))
    check_view(cache, read_slots)
    for _ in range(int(rng.integers(5, 21))):
        r = rng.random()
        if r < 0.6:
            S = 1 if rng.random() < 0.55 else int(rng.integers(2, 12))
            if isinstance(cache, ours.StaticKVCache) and cache.offset + S > cache.max_len:
                continue
            k, v = positions_kv(rng, B, H, cache.offset, S, D)
            out = cache.update_and_fetch(k, v)
            check_view(cache, read_slots, out[0])
            continue
        if r < 0.75 and trims and cache.is_trimmable():
            cache.trim(int(rng.integers(0, cache.offset + 1)))
        elif r < 0.88:
            cache = type(cache).from_state(cache.state)
        elif extra is not None:
            extra(cache)
        check_view(cache, read_slots)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda rng: ours.KVCache(), id="KVCache"),
        pytest.param(lambda rng: ours.StaticKVCache(int(rng.integers(20, 80))), id="StaticKVCache"),
        pytest.param(lambda rng: ours.QuantizedKVCache(32, int(rng.choice([2, 4, 8]))), id="QuantizedKVCache"),
        pytest.param(
            lambda rng: ours.QuantizedKVCache(64, 8, value_bits=4, start=int(rng.integers(0, 20))),
            id="QuantizedKVCache-start-mixed",
        ),
        pytest.param(lambda rng: ours.KIVICache(int(rng.integers(1, 12)), 32, 4), id="KIVICache"),
    ],
)
def test_linear_slot_table_is_true(make, positions_kv, read_slots):
    rng = np.random.default_rng(301)
    for _ in range(SEQUENCES):
        run(rng, make(rng), positions_kv, read_slots)


def test_concatenate_slot_table_is_true(positions_kv, read_slots):
    # mlx-lm's ConcatenateKVCache.trim only lowers offset (the tokens stay): no trims here.
    rng = np.random.default_rng(302)
    for _ in range(SEQUENCES):
        run(rng, ours.ConcatenateKVCache(), positions_kv, read_slots, trims=False)


def test_chunked_slot_table_is_true(positions_kv, read_slots):
    rng = np.random.default_rng(303)
    for _ in range(SEQUENCES):
        cache = ours.ChunkedKVCache(int(rng.integers(1, 20)))
        run(rng, cache, positions_kv, read_slots, extra=lambda c: c.maybe_trim_front())


@pytest.mark.parametrize("quantized", [False, True], ids=["RotatingKVCache", "QuantizedRotatingKVCache"])
def test_ring_slot_table_is_true_through_wraps_blocks_and_trims(quantized, positions_kv, read_slots):
    rng = np.random.default_rng(304)
    for _ in range(SEQUENCES * 2):
        max_size = int(rng.integers(1, 24))
        keep = int(rng.integers(0, min(max_size, 5)))
        if quantized:
            cache = ours.QuantizedRotatingKVCache(max_size, keep, 32, int(rng.choice([4, 8])))
        else:
            cache = ours.RotatingKVCache(max_size, keep)
        run(rng, cache, positions_kv, read_slots)


def _batch_update(rng, cache, H, D, right_padded: bool):
    """Each row gets keys for its own positions (padding slots: negative positions)."""
    rows = cache.offset.shape[0]
    offsets = np.array(cache.offset.tolist())
    S = 1 if rng.random() < 0.5 and not right_padded else int(rng.integers(2, 9))
    pos = offsets[:, None] + np.arange(S)[None, :]  # (B, S)
    if right_padded:
        lengths = rng.integers(1, S + 1, rows)
        cache.prepare(lengths=lengths.tolist(), right_padding=(S - lengths).tolist())
        pos = np.where(np.arange(S)[None, :] < lengths[:, None], pos, -100)
    ramp = np.linspace(0.0, 0.25, D, dtype=np.float32)
    k = np.broadcast_to((pos + 1).astype(np.float32)[:, None, :, None] + ramp, (rows, H, S, D)).copy()
    out = cache.update_and_fetch(mx.array(k), mx.array(np.zeros_like(k)))
    if right_padded:
        cache.finalize()
        return None
    return out[0]


@pytest.mark.parametrize("rotating", [False, True], ids=["BatchKVCache", "BatchRotatingKVCache"])
def test_batch_slot_tables_are_true_per_row(rotating, read_slots):
    rng = np.random.default_rng(305)
    H, D = 1, 32
    for _ in range(SEQUENCES):
        pads = rng.integers(0, 4, int(rng.integers(1, 4))).tolist()
        max_size = int(rng.integers(3, 20))
        cache = ours.BatchRotatingKVCache(max_size, pads) if rotating else ours.BatchKVCache(pads)
        check_view(cache, read_slots)
        for _ in range(int(rng.integers(3, 15))):
            r = rng.random()
            if r < 0.6:
                # A right-padded prefill into a ring that then overflows leaves the padding in
                # the window where mlx-lm's bookkeeping (and mask) counts it as tokens: such a
                # slot's content is unknowable from the state, so rings get them only when empty.
                padded = rng.random() < 0.2 and (not rotating or cache.empty())
                out = _batch_update(rng, cache, H, D, right_padded=padded)
                check_view(cache, read_slots, out)
                continue
            if r < 0.7 and cache.is_trimmable():
                cache.trim(int(rng.integers(0, 3)))
            elif r < 0.8 and cache.offset.shape[0] > 1 and not cache.empty():
                rows = cache.offset.shape[0]
                cache.filter(mx.array(sorted(rng.choice(rows, rows - 1, replace=False).tolist())))
            else:
                cache = type(cache).from_state(cache.state)
            if not cache.empty() and cache.size() > 0:
                check_view(cache, read_slots)


def test_recurrent_and_list_views_count_every_byte():
    arrays = ours.ArraysCache(2)
    assert arrays.introspect().bytes_allocated == 0
    arrays[0] = mx.zeros((2, 3, 8))
    arrays[1] = mx.zeros((2, 4), dtype=mx.float16)
    view = arrays.introspect()
    assert (view.layout, view.capacity, view.batch_size) == ("recurrent", 0, 2)
    assert view.bytes_allocated == view.bytes_used == 2 * 3 * 8 * 4 + 2 * 4 * 2 == arrays.nbytes
    assert view.slot_positions().shape == (0,)

    kv = ours.KVCache()
    kv.update_and_fetch(mx.ones((2, 1, 5, 32)), mx.ones((2, 1, 5, 32)))
    both = ours.CacheList(kv, arrays)
    view = both.introspect()
    assert view.kind == "CacheList(KVCache,ArraysCache)"
    assert view.bytes_allocated == kv.nbytes + arrays.nbytes == both.nbytes
    assert (view.layout, view.tokens_held, view.offset) == ("linear", 5, 5)
    assert [v.kind for v in ours.introspect([kv, arrays, both])] == ["KVCache", "ArraysCache", view.kind]


def test_quantized_bytes_follow_the_planner_formula():
    """Per token and kv head: head_dim * bits / 8 packed bytes + 2 * head_dim / group_size
    scales and biases in the incoming dtype (both backends promise this to the planner)."""
    B, H, D, gs = 2, 3, 64, 32
    for kb, vb in ((8, 8), (4, 4), (8, 4), (3, 6), (2, 5)):
        cache = ours.QuantizedKVCache(gs, kb, value_bits=vb)
        cache.update_and_fetch(mx.ones((B, H, 7, D), mx.float16), mx.ones((B, H, 7, D), mx.float16))
        view = cache.introspect()
        per_token = {b: D * b // 8 + 2 * (D // gs) * 2 for b in (kb, vb)}
        assert view.bytes_allocated == B * H * view.capacity * (per_token[kb] + per_token[vb])
        assert view.bytes_used == B * H * 7 * (per_token[kb] + per_token[vb])
        assert (view.key_bits, view.value_bits, view.group_size, view.quantized_tokens, view.dtype) == (
            kb,
            vb,
            gs,
            7,
            "float16",
        )


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: ours.QuantizedKVCache(32, 4, value_bits=8), id="QuantizedKVCache"),
        pytest.param(lambda: ours.QuantizedRotatingKVCache(16, 2, 32, 4, value_bits=8), id="QuantizedRotatingKVCache"),
    ],
)
def test_quantization_error_probe_measures_the_update_and_is_off_by_default(make, kv):
    rng = np.random.default_rng(306)
    cache = make()
    k, v = kv(rng, 1, 2, 5, 64)
    cache.update_and_fetch(k, v)
    assert cache.track_error is False and cache.introspect().quant_error is None
    assert cache._error is None  # nothing computed while off
    cache.track_error = True
    k, v = kv(rng, 1, 2, 3, 64)
    cache.update_and_fetch(k, v)
    err = cache.introspect().quant_error
    deq_k = mx.dequantize(*mx.quantize(k, group_size=32, bits=4), group_size=32, bits=4)
    deq_v = mx.dequantize(*mx.quantize(v, group_size=32, bits=8), group_size=32, bits=8)
    want_k, want_v = quant_error(np.array(k), np.array(deq_k)), quant_error(np.array(v), np.array(deq_v))
    assert err.key_rel_rms == pytest.approx(want_k[0], rel=1e-4) and err.key_max_abs == pytest.approx(want_k[1])
    assert err.value_rel_rms == pytest.approx(want_v[0], rel=1e-4) and err.value_max_abs == pytest.approx(want_v[1])
    assert err.key_rel_rms > err.value_rel_rms > 0  # 4-bit keys lose more than 8-bit values
    cache.track_error = False
    assert cache.introspect().quant_error is None


def test_error_probe_covers_the_start_conversion_and_kivi_flushes(kv):
    rng = np.random.default_rng(307)
    cache = ours.QuantizedKVCache(32, 4, start=4)
    cache.track_error = True
    held, _ = kv(rng, 1, 1, 4, 32)
    cache.update_and_fetch(held, held)
    assert cache.introspect().quant_error is None  # still full precision: nothing quantized
    new, _ = kv(rng, 1, 1, 1, 32)
    cache.update_and_fetch(new, new)
    both = mx.concatenate([held, new], axis=2)
    deq = mx.dequantize(*mx.quantize(both, group_size=32, bits=4), group_size=32, bits=4)
    rel, worst = quant_error(np.array(both), np.array(deq))
    err = cache.introspect().quant_error
    assert err.key_rel_rms == pytest.approx(rel, rel=1e-4) and err.key_max_abs == pytest.approx(worst)

    kivi = ours.KIVICache(residual=3, group_size=32, bits=2)
    kivi.track_error = True
    k, v = kv(rng, 1, 1, 4, 32)
    kivi.update_and_fetch(k, v)  # the prompt is quantized at once
    assert kivi.introspect().quant_error is not None
    k1, v1 = kv(rng, 1, 1, 1, 32)
    kivi.update_and_fetch(k1, v1)
    assert kivi.introspect().quant_error is None  # waits in the residual: nothing quantized
    k2, v2 = kv(rng, 1, 1, 2, 32)
    kivi.update_and_fetch(k2, v2)  # 1 + 2 >= 3: the residual and the new tokens are flushed
    flushed = mx.concatenate([k1, k2], axis=2)
    deq = mx.dequantize(*mx.quantize(flushed, group_size=32, bits=2), group_size=32, bits=2)
    rel, _ = quant_error(np.array(flushed), np.array(deq))
    assert kivi.introspect().quant_error.key_rel_rms == pytest.approx(rel, rel=1e-4)
    assert not math.isnan(kivi.introspect().quant_error.value_rel_rms)
