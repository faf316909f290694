"""Randomized differential tests: each single-sequence cache class of ours against the installed
mlx-lm's class of the same name, call for call.

Every sequence is 5-20 random calls (updates of 1..N tokens, trims, masks with and without a
window, ``keys_and_values``, ``from_state(state)`` round trips, maybe ``to_quantized``) made on
both caches; every returned array, mask and scalar and the full ``state`` must be equal after
every call. Shapes are tiny (B <= 2, H <= 2, D in {32, 64}) and the growth step is often made
small, so that buffer growth, wrap-around and step boundaries come up within a few tokens.
"""

from __future__ import annotations

import mlx_lm.models.cache as ref
import numpy as np
import pytest

import cachelib.mlx as ours
from cachelib.spec import QUANT_BITS

SEQUENCES = 1000


class _Stop(Exception):
    """Both caches refused the call (e.g. an mlx shape error after a trim past the ring):
    equal behaviour, and the rest of the sequence is moot."""


def both(fn, a, b, label: str):
    """``fn`` on ours and on mlx-lm's cache; both must succeed or both must raise."""
    try:
        x = fn(a)
    except Exception as err:  # noqa: BLE001 - compared against mlx-lm's behaviour below
        x_err = err
    else:
        x_err = None
    try:
        y = fn(b)
    except Exception as err:  # noqa: BLE001
        if x_err is None:
            pytest.fail(f"{label}: mlx-lm raised {err!r} but ours returned")
        raise _Stop from None
    if x_err is not None:
        pytest.fail(f"{label}: ours raised {x_err!r} but mlx-lm returned")
    return x, y


def compare_scalars(same, a, b, label: str) -> None:
    same.check(f"{label} offset", a.offset, b.offset)
    same.check(f"{label} size()", a.size(), b.size())
    same.check(f"{label} empty()", a.empty(), b.empty())
    same.check(f"{label} is_trimmable()", a.is_trimmable(), b.is_trimmable())
    if not b.empty():
        same.check(f"{label} nbytes", a.nbytes, b.nbytes)
        same.check(f"{label} keys_and_values()", a.keys_and_values(), b.keys_and_values())
    same.check(f"{label} state", a.state, b.state)


def run_sequence(rng, a, b, same, kv, dims, *, chunked: bool = False, quantize_to=None):
    """Random calls on ours (``a``) and mlx-lm's (``b``)."""
    B, H, D = dims
    if rng.random() < 0.5:
        a.step = b.step = int(rng.integers(1, 9))
    n_ops = int(rng.integers(5, 21))
    try:
        for i in range(n_ops):
            label = f"call {i}"
            r = rng.random()
            if r < 0.5:
                if rng.random() < 0.5:
                    S = 1
                else:
                    S = int(rng.integers(2, 14)) if rng.random() < 0.95 else int(rng.integers(200, 300))
                k, v = kv(rng, B, H, S, D)
                x, y = both(lambda c: c.update_and_fetch(k, v), a, b, label)
                same.check(f"{label} update_and_fetch(S={S})", x, y)
            elif r < 0.62:
                n = int(rng.integers(0, a.offset + 3))
                x, y = both(lambda c: c.trim(n), a, b, label)
                same.check(f"{label} trim({n})", x, y)
            elif r < 0.8:
                assert hasattr(a, "make_mask") == hasattr(b, "make_mask")
                if hasattr(b, "make_mask"):
                    N = int(rng.choice([1, 1, 2, 3, 7]))
                    w = None if rng.random() < 0.5 else int(rng.integers(1, 16))
                    arr = bool(rng.random() < 0.5)
                    x, y = both(lambda c: c.make_mask(N, window_size=w, return_array=arr), a, b, label)
                    same.check(f"{label} make_mask({N}, window_size={w}, return_array={arr})", x, y)
            elif r < 0.93:
                if not b.empty():
                    a, b = type(a).from_state(a.state), type(b).from_state(b.state)
            elif chunked:
                a.maybe_trim_front()
                b.maybe_trim_front()
            elif quantize_to is not None and hasattr(b, "to_quantized"):
                gs, bits = quantize_to
                a, b = a.to_quantized(group_size=gs, bits=bits), b.to_quantized(group_size=gs, bits=bits)
                assert type(a).__name__ == type(b).__name__
            compare_scalars(same, a, b, label)
    except _Stop:
        pass
    same.flush()


def _dims(rng, D=None):
    return int(rng.integers(1, 3)), int(rng.integers(1, 3)), D or int(rng.choice([32, 64]))


def test_kvcache_matches_mlx_lm_call_for_call(same, kv):
    rng = np.random.default_rng(101)
    for _ in range(SEQUENCES):
        dims = _dims(rng)
        quant = (int(rng.choice([32, dims[2]])), int(rng.choice(QUANT_BITS)))
        run_sequence(rng, ours.KVCache(), ref.KVCache(), same, kv, dims, quantize_to=quant)


def test_concatenate_kvcache_matches_mlx_lm_call_for_call(same, kv):
    rng = np.random.default_rng(102)
    for _ in range(SEQUENCES):
        run_sequence(rng, ours.ConcatenateKVCache(), ref.ConcatenateKVCache(), same, kv, _dims(rng))


def test_rotating_kvcache_matches_mlx_lm_call_for_call(same, kv):
    rng = np.random.default_rng(103)
    for _ in range(SEQUENCES):
        max_size = int(rng.integers(1, 21)) if rng.random() < 0.85 else int(rng.integers(21, 70))
        keep = int(rng.integers(0, min(max_size, 6)))
        pair = ours.RotatingKVCache(max_size, keep), ref.RotatingKVCache(max_size, keep)
        run_sequence(rng, *pair, same, kv, _dims(rng))


def test_quantized_kvcache_matches_mlx_lm_call_for_call(same, kv):
    rng = np.random.default_rng(104)
    for _ in range(SEQUENCES):
        dims = _dims(rng)
        gs = int(rng.choice([32, dims[2]]))
        bits = int(rng.choice(QUANT_BITS))
        run_sequence(rng, ours.QuantizedKVCache(gs, bits), ref.QuantizedKVCache(gs, bits), same, kv, dims)


def test_chunked_kvcache_matches_mlx_lm_call_for_call(same, kv):
    rng = np.random.default_rng(105)
    for _ in range(SEQUENCES):
        chunk = int(rng.integers(1, 30))
        run_sequence(rng, ours.ChunkedKVCache(chunk), ref.ChunkedKVCache(chunk), same, kv, _dims(rng), chunked=True)


def test_quantize_after_start_converts_when_mlx_lm_generate_would(same, kv):
    """QuantizedKVCache(start=N) against mlx-lm's own flow: a KVCache swapped for
    ``to_quantized`` once it holds N tokens (maybe_quantize_kv_cache, --quantized-kv-start):
    same arrays from every update, before and after the switch, and the same ``bits``
    visibility to mlx-lm's attention."""
    rng = np.random.default_rng(106)
    for _ in range(SEQUENCES // 4):
        B, H, D = _dims(rng)
        gs, bits = int(rng.choice([32, D])), int(rng.choice(QUANT_BITS))
        start = int(rng.integers(1, 40))
        a, b = ours.QuantizedKVCache(gs, bits, start=start), ref.KVCache()
        for i in range(int(rng.integers(5, 21))):
            if isinstance(b, ref.KVCache) and b.offset >= start:  # generate_step's check
                b = b.to_quantized(group_size=gs, bits=bits)
            S = 1 if rng.random() < 0.6 else int(rng.integers(2, 12))
            k, v = kv(rng, B, H, S, D)
            same.check(f"update {i}", a.update_and_fetch(k, v), b.update_and_fetch(k, v))
            assert hasattr(a, "bits") == hasattr(b, "bits"), f"update {i}: bits visibility differs"
            if rng.random() < 0.2:
                n = int(rng.integers(0, 3))
                same.check(f"trim {i}", a.trim(n), b.trim(n))
            same.check(f"offset {i}", a.offset, b.offset)
            same.check(f"nbytes {i}", a.nbytes, b.nbytes)
        same.flush()
