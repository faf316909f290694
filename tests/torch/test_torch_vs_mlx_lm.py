"""Randomized differential tests: our PyTorch ports of mlx-lm's strategies against the installed
``mlx_lm.models.cache`` classes, 1,000 seeded random call sequences each.

Arrays cross over through numpy. After every call: the returned keys and values (dequantized
for quantized caches, where ours must equal ``mx.dequantize`` of mlx-lm's triples), ``offset``,
the ring pointer, ``trim`` results and the allocated storage (token slots and bytes: our packed
uint8 codes take exactly the bytes of mlx-lm's uint32 words) are equal.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx_lm.models import cache as mc

import cachelib.torch as ct
from cachelib.torch.base import nbytes, tokens

SEQUENCES = 1000
STEP = 4  # small growth steps so that growth, wrap-around and trims all happen in short sequences


def _kv(rng, batch, n, dim):
    k = rng.standard_normal((batch, 2, n, dim)).astype(np.float32)
    v = rng.standard_normal((batch, 2, n, dim)).astype(np.float32)
    return k, v


def _mlx_dense(x):
    if isinstance(x, (tuple, list)):
        return np.array(mx.dequantize(*x, group_size=_mlx_dense.group, bits=_mlx_dense.bits))
    return np.array(x)


def _mlx_bytes(c) -> int:
    if c.keys is None:
        return 0
    parts = list(c.keys) + list(c.values) if isinstance(c.keys, (tuple, list)) else [c.keys, c.values]
    return sum(p.nbytes for p in parts)


def _mlx_slots(c) -> int:
    if c.keys is None:
        return 0
    return (c.keys[0] if isinstance(c.keys, (tuple, list)) else c.keys).shape[2]


def _compare(ours_out, mlx_out, ours, theirs):
    quantized = isinstance(theirs.keys, (tuple, list))
    for a, b in zip(ours_out, mlx_out):
        b = _mlx_dense(b)
        assert a.shape == b.shape
        if quantized:  # same codes, scales and biases (below); dequantizing may differ by an ulp
            assert np.allclose(a.numpy(), b, rtol=1e-6, atol=1e-6)
        else:
            assert np.array_equal(a.numpy(), b)
    if quantized:
        for ours_part, mlx_part in zip(ours.keys + ours.values, list(theirs.keys) + list(theirs.values)):
            mlx_part = np.array(mlx_part)
            if mlx_part.dtype == np.uint32:  # packed codes: compare the bytes
                mlx_part = mlx_part.view(np.uint8)
            assert np.array_equal(ours_part.numpy(), mlx_part)
    assert ours.offset == theirs.offset
    assert tokens(ours.keys) == _mlx_slots(theirs)
    assert ours.nbytes == _mlx_bytes(theirs)


def _drive(make, seed_base, update_sizes, before_update=lambda c: None, dim=8):
    for seed in range(SEQUENCES):
        rng = np.random.default_rng(seed_base + seed)
        ours, theirs = make(rng)
        batch = int(rng.integers(1, 3))
        for _ in range(int(rng.integers(3, 10))):
            if rng.random() < 0.85 or ours.offset == 0:
                k, v = _kv(rng, batch, update_sizes(rng), dim)
                before_update(theirs)
                got = ours.update(torch.from_numpy(k), torch.from_numpy(v))
                want = theirs.update_and_fetch(mx.array(k), mx.array(v))
                _compare(got, want, ours, theirs)
            else:
                n = int(rng.integers(0, ours.offset + 2))
                assert ours.trim(n) == theirs.trim(n)
                assert ours.offset == theirs.offset
            assert ours.get_seq_length() == theirs.offset


def _one_or_many(rng):
    return 1 if rng.random() < 0.6 else int(rng.integers(2, 9))


def test_kv_cache_matches_mlx_lm():
    def make(rng):
        theirs = mc.KVCache()
        theirs.step = STEP
        return ct.KVCacheLayer(step=STEP), theirs

    _drive(make, 100_000, _one_or_many)


def test_rotating_kv_cache_matches_mlx_lm_ring_and_concat_paths():
    def make(rng):
        max_size = int(rng.integers(2, 12))
        keep = int(rng.integers(0, max_size))
        theirs = mc.RotatingKVCache(max_size=max_size, keep=keep)
        theirs.step = STEP
        return ct.RotatingKVCacheLayer(max_size, keep, step=STEP), theirs

    for seed in range(SEQUENCES):
        rng = np.random.default_rng(200_000 + seed)
        ours, theirs = make(rng)
        for _ in range(int(rng.integers(3, 12))):
            if rng.random() < 0.85 or ours.offset == 0:
                k, v = _kv(rng, 1, _one_or_many(rng), 4)
                got = ours.update(torch.from_numpy(k), torch.from_numpy(v))
                want = theirs.update_and_fetch(mx.array(k), mx.array(v))
                _compare(got, want, ours, theirs)
                assert ours.write_index == theirs._idx
            elif ours.is_trimmable():
                assert theirs.is_trimmable()
                n = int(rng.integers(0, ours.offset + 1))
                assert ours.trim(n) == theirs.trim(n)
                assert (ours.offset, ours.write_index) == (theirs.offset, theirs._idx)


def test_chunked_kv_cache_matches_mlx_lm_with_front_trims():
    def make(rng):
        chunk = int(rng.integers(2, 12))
        theirs = mc.ChunkedKVCache(chunk)
        theirs.step = STEP
        return ct.ChunkedKVCacheLayer(chunk, step=STEP), theirs

    # mlx-lm leaves the front trim to the model (llama4 calls it before each forward); ours
    # does it at the start of every update.
    _drive(make, 300_000, _one_or_many, before_update=lambda c: c.maybe_trim_front())


@pytest.mark.parametrize("bits,group", [(8, 32), (4, 64), (2, 32)])
def test_quantized_kv_cache_matches_mlx_lm_dequantized(bits, group):
    _mlx_dense.bits, _mlx_dense.group = bits, group

    def make(rng):
        theirs = mc.QuantizedKVCache(group_size=group, bits=bits)
        theirs.step = STEP
        return ct.QuantizedKVCacheLayer(group, bits, step=STEP), theirs

    global SEQUENCES
    n, SEQUENCES = SEQUENCES, SEQUENCES // 3 + 1  # three parametrizations share the 1,000
    try:
        _drive(make, 400_000 + bits * 1000, _one_or_many, dim=64)
    finally:
        SEQUENCES = n


def test_quantize_after_start_matches_mlx_lm_to_quantized():
    """``start=N``: full precision until N tokens were seen, then everything quantized: what
    mlx-lm's generate does with ``--quantized-kv-start`` (KVCache.to_quantized)."""
    _mlx_dense.bits, _mlx_dense.group = 4, 32
    for seed in range(200):
        rng = np.random.default_rng(500_000 + seed)
        start = int(rng.integers(0, 12))
        ours = ct.QuantizedKVCacheLayer(32, 4, start=start, step=STEP)
        theirs = mc.KVCache()
        theirs.step = STEP
        for _ in range(int(rng.integers(2, 10))):
            if isinstance(theirs, mc.KVCache) and theirs.offset >= start:
                theirs = theirs.to_quantized(group_size=32, bits=4)
                theirs.step = STEP
            k, v = _kv(rng, 1, _one_or_many(rng), 32)
            got = ours.update(torch.from_numpy(k), torch.from_numpy(v))
            want = theirs.update_and_fetch(mx.array(k), mx.array(v))
            _compare(got, want, ours, theirs)
            assert ours.introspect().quantized_tokens == (ours.offset if isinstance(theirs, mc.QuantizedKVCache) else 0)


def test_returned_arrays_are_views_of_the_storage_not_copies():
    """The point of step growth: a one-token update writes in place and returns a view."""
    layer = ct.KVCacheLayer(step=8)
    k = torch.zeros(1, 1, 1, 4)
    layer.update(k, k)
    keys, _ = layer.update(k + 1, k + 1)
    assert keys.untyped_storage().data_ptr() == layer.keys.untyped_storage().data_ptr()
    ring = ct.RotatingKVCacheLayer(4, 1, step=8)
    for i in range(9):
        keys, _ = ring.update(k + i, k + i)
    assert keys.untyped_storage().data_ptr() == ring.keys.untyped_storage().data_ptr()
    assert nbytes(ring.keys) == 4 * 4 * 4  # max_size slots, never more
