"""Randomized differential tests of the containers and batch caches against the installed
mlx-lm: ``BatchKVCache``, ``BatchRotatingKVCache``, ``ArraysCache`` and ``CacheList``.

Each sequence starts from the constructor or from ``merge`` of random single caches and makes
5-20 random calls, as mlx-lm's batch generator does: updates (blocks and single tokens),
right-padded prefills (``prepare`` / ``finalize``), trims, masks, ``filter``, ``extend`` with
another random batch, ``extract`` of a row, ``from_state`` round trips. Every returned array
and scalar, the full ``state`` and the per-row bookkeeping must be equal after every call.
"""

from __future__ import annotations

import mlx.core as mx
import mlx_lm.models.cache as ref
import numpy as np
import pytest

import cachelib.mlx as ours

SEQUENCES = 1000


class _Stop(Exception):
    pass


def both(fn, a, b, label: str):
    """``fn`` on ours and on mlx-lm's; both succeed, or both raise (which ends the sequence)."""
    try:
        x, x_err = fn(a), None
    except Exception as err:  # noqa: BLE001 - compared with mlx-lm below
        x, x_err = None, err
    try:
        y = fn(b)
    except Exception as err:  # noqa: BLE001
        if x_err is None:
            pytest.fail(f"{label}: mlx-lm raised {err!r} but ours returned")
        raise _Stop from None
    if x_err is not None:
        pytest.fail(f"{label}: ours raised {x_err!r} but mlx-lm returned")
    return x, y


def _ref_from_state(b):
    """mlx-lm's from_state skips __init__, so its batch caches lack the prefill bookkeeping
    that is not part of ``state`` (``_right_padding``, ``_lengths``); give them the value
    __init__ would (ours keep class-level defaults), so the sequence can go on."""
    out = type(b).from_state(b.state)
    for c in getattr(out, "caches", [out]):
        if isinstance(c, ref.BatchKVCache) and not hasattr(c, "_right_padding"):
            c._right_padding = None
        if isinstance(c, ref.BatchRotatingKVCache) and not hasattr(c, "_lengths"):
            c._lengths = None
    return out


def _rows(c) -> int:
    return c.offset.shape[0]


def _single_pair(rng, kv, rotating: bool, H: int, D: int, max_size: int):
    """A random single-sequence cache, ours and mlx-lm's, after the same few updates."""
    if rotating:
        keep = int(rng.integers(0, min(max_size, 3)))
        a, b = ours.RotatingKVCache(max_size, keep), ref.RotatingKVCache(max_size, keep)
    else:
        a, b = ours.KVCache(), ref.KVCache()
    for _ in range(int(rng.integers(0, 4))):
        S = 1 if rng.random() < 0.5 else int(rng.integers(2, 9))
        k, v = kv(rng, 1, H, S, D)
        a.update_and_fetch(k, v)
        b.update_and_fetch(k, v)
    return a, b


def _batch_pair(rng, kv, rotating: bool, H: int, D: int, max_size: int, same):
    if rng.random() < 0.3:
        singles = [_single_pair(rng, kv, rotating, H, D, max_size) for _ in range(int(rng.integers(1, 4)))]
        ours_cls = ours.RotatingKVCache if rotating else ours.KVCache
        ref_cls = ref.RotatingKVCache if rotating else ref.KVCache
        mine, theirs = (ours_cls, [s[0] for s in singles]), (ref_cls, [s[1] for s in singles])
        x, y = both(lambda m: m[0].merge(m[1]), mine, theirs, "merge")
        same.check("merge", x.state, y.state)
        return x, y
    pads = [int(p) for p in rng.integers(0, 4, int(rng.integers(1, 4)))]
    if rotating:
        return ours.BatchRotatingKVCache(max_size, pads), ref.BatchRotatingKVCache(max_size, pads)
    return ours.BatchKVCache(pads), ref.BatchKVCache(pads)


def _update(rng, kv, a, b, H, D, same, label):
    rows = _rows(b)
    if rng.random() < 0.25 and not (b.keys is None and rng.random() < 0.5):
        # A right-padded block, as the batch generator sends prompts of different lengths.
        S = int(rng.integers(2, 9))
        lengths = [int(n) for n in rng.integers(1, S + 1, rows)]
        padding = [S - n for n in lengths]
        both(lambda c: c.prepare(lengths=lengths, right_padding=padding), a, b, label)
        k, v = kv(rng, rows, H, S, D)
        x, y = both(lambda c: c.update_and_fetch(k, v), a, b, label)
        same.check(f"{label} update_and_fetch(right-padded S={S})", x, y)
        both(lambda c: c.finalize(), a, b, label)
        return
    S = 1 if rng.random() < 0.5 else int(rng.integers(2, 12))
    k, v = kv(rng, rows, H, S, D)
    x, y = both(lambda c: c.update_and_fetch(k, v), a, b, label)
    same.check(f"{label} update_and_fetch(S={S})", x, y)


def run_batch_sequence(rng, kv, same, rotating: bool):
    H, D = int(rng.integers(1, 3)), int(rng.choice([32, 64]))
    max_size = int(rng.integers(2, 24))
    a, b = _batch_pair(rng, kv, rotating, H, D, max_size, same)
    if rng.random() < 0.5:
        a.step = b.step = int(rng.integers(1, 9))
    if b.keys is None and rng.random() < 0.3:
        extra = [int(p) for p in rng.integers(0, 3, _rows(b))]
        both(lambda c: c.prepare(left_padding=extra), a, b, "prepare(left_padding)")
    try:
        for i in range(int(rng.integers(5, 21))):
            label = f"call {i}"
            r = rng.random()
            if r < 0.45:
                _update(rng, kv, a, b, H, D, same, label)
            elif r < 0.55:
                n = int(rng.integers(0, 4))
                x, y = both(lambda c: c.trim(n), a, b, label)
                same.check(f"{label} trim({n})", x, y)
            elif r < 0.68:
                N = int(rng.choice([1, 1, 2, 5]))
                w = None if rng.random() < 0.5 else int(rng.integers(1, 12))
                arr = bool(rng.random() < 0.5)
                x, y = both(lambda c: c.make_mask(N, window_size=w, return_array=arr), a, b, label)
                same.check(f"{label} make_mask({N}, window_size={w})", x, y)
            elif r < 0.75:
                rows = _rows(b)
                keep = sorted(rng.choice(rows, int(rng.integers(1, rows + 1)), replace=False).tolist())
                both(lambda c: c.filter(mx.array(keep)), a, b, f"{label} filter({keep})")
            elif r < 0.83:
                c_ours, c_ref = _batch_pair(rng, kv, rotating, H, D, max_size, same)
                for _ in range(int(rng.integers(0, 3))):
                    _update(rng, kv, c_ours, c_ref, H, D, same, f"{label} (other)")
                both(lambda c: c[0].extend(c[1]), (a, c_ours), (b, c_ref), f"{label} extend")
            elif r < 0.9:
                if b.keys is not None:
                    idx = int(rng.integers(0, _rows(b)))
                    x, y = both(lambda c: c.extract(idx), a, b, f"{label} extract({idx})")
                    assert type(x).__name__ == type(y).__name__
                    same.check(f"{label} extract({idx}).state", x.state, y.state)
            else:
                a, b = type(a).from_state(a.state), _ref_from_state(b)
            same.check(f"{label} state", a.state, b.state)
            same.check(f"{label} size()", a.size(), b.size())
            same.check(f"{label} empty()", a.empty(), b.empty())
            same.check(f"{label} is_trimmable()", a.is_trimmable(), b.is_trimmable())
            same.check(f"{label} nbytes", a.nbytes, b.nbytes)
    except _Stop:
        pass
    same.flush()


def test_batch_kvcache_matches_mlx_lm_call_for_call(same, kv):
    rng = np.random.default_rng(201)
    for _ in range(SEQUENCES):
        run_batch_sequence(rng, kv, same, rotating=False)


def test_batch_rotating_kvcache_matches_mlx_lm_call_for_call(same, kv):
    rng = np.random.default_rng(202)
    for _ in range(SEQUENCES):
        run_batch_sequence(rng, kv, same, rotating=True)


def _arrays_pair(rng, n: int, rows: int, shapes, fill: float = 0.7):
    pads = None if rng.random() < 0.5 else [int(p) for p in rng.integers(0, 3, rows)]
    a, b = ours.ArraysCache(n, left_padding=pads), ref.ArraysCache(n, left_padding=pads)
    for e in range(n):
        if rng.random() < fill:
            x = mx.array(rng.standard_normal((rows, *shapes[e]), dtype=np.float32))
            a[e], b[e] = x, x
    return a, b


def test_arrays_cache_matches_mlx_lm_call_for_call(same):
    rng = np.random.default_rng(203)
    for _ in range(SEQUENCES):
        n = int(rng.integers(1, 4))
        shapes = [tuple(int(s) for s in rng.integers(1, 5, int(rng.integers(1, 3)))) for _ in range(n)]
        rows = int(rng.integers(1, 4))
        if rng.random() < 0.2:
            # mlx-lm's merge needs each slot filled in some cache (or every cache empty).
            fill = float(rng.choice([0.0, 1.0]))
            singles = [_arrays_pair(rng, n, 1, shapes, fill) for _ in range(int(rng.integers(1, 4)))]
            a = ours.ArraysCache.merge([s[0] for s in singles])
            b = ref.ArraysCache.merge([s[1] for s in singles])
        else:
            a, b = _arrays_pair(rng, n, rows, shapes)
        try:
            for i in range(int(rng.integers(5, 21))):
                label = f"call {i}"
                rows = b.batch_size
                r = rng.random()
                if r < 0.3:
                    e = int(rng.integers(0, n))
                    x = mx.array(rng.standard_normal((rows, *shapes[e]), dtype=np.float32))
                    a[e], b[e] = x, x
                    same.check(f"{label} [{e}]", a[e], b[e])
                elif r < 0.4:
                    keep = sorted(rng.choice(rows, int(rng.integers(1, rows + 1)), replace=False).tolist())
                    both(lambda c: c.filter(mx.array(keep)), a, b, label)
                elif r < 0.5:
                    c_ours, c_ref = _arrays_pair(rng, n, int(rng.integers(1, 3)), shapes)
                    both(lambda c: c[0].extend(c[1]), (a, c_ours), (b, c_ref), label)
                elif r < 0.57:
                    if all(c is not None for c in b.cache):
                        idx = int(rng.integers(0, rows))
                        x, y = both(lambda c: c.extract(idx), a, b, label)
                        same.check(f"{label} extract({idx}).state", x.state, y.state)
                elif r < 0.67:
                    lengths = [int(x) for x in rng.integers(0, 6, rows)]
                    both(lambda c: c.prepare(lengths=lengths), a, b, label)
                elif r < 0.72:
                    both(lambda c: c.finalize(), a, b, label)
                elif r < 0.8:
                    N = int(rng.integers(1, 4))
                    both(lambda c: c.advance(N), a, b, label)
                elif r < 0.92:
                    N = int(rng.integers(1, 6))
                    x, y = both(lambda c: c.make_mask(N), a, b, label)
                    same.check(f"{label} make_mask({N})", x, y)
                else:
                    a, b = type(a).from_state(a.state), type(b).from_state(b.state)
                same.check(f"{label} state", a.state, b.state)
                same.check(f"{label} batch_size", a.batch_size, b.batch_size)
                same.check(f"{label} empty()", a.empty(), b.empty())
                same.check(f"{label} nbytes", a.nbytes, b.nbytes)
                same.check(f"{label} size()", a.size(), b.size())
        except _Stop:
            pass
        same.flush()


def _cache_list_pair(rng, kv, H, D, max_size, recurrent: bool):
    if recurrent:
        return ours.CacheList(ours.KVCache(), ours.ArraysCache(2)), ref.CacheList(ref.KVCache(), ref.ArraysCache(2))
    keep = int(rng.integers(0, min(3, max_size)))
    return (
        ours.CacheList(ours.KVCache(), ours.RotatingKVCache(max_size, keep)),
        ref.CacheList(ref.KVCache(), ref.RotatingKVCache(max_size, keep)),
    )


def _cache_list_update(rng, kv, a, b, H, D, same, label, rows=1):
    S = 1 if rng.random() < 0.5 else int(rng.integers(2, 9))
    k, v = kv(rng, rows, H, S, D)
    x, y = both(lambda c: c[0].update_and_fetch(k, v), a, b, label)
    same.check(f"{label} [0].update_and_fetch", x, y)
    if isinstance(b[1], ref.ArraysCache):
        x = mx.array(rng.standard_normal((rows, 3), dtype=np.float32))
        a[1][0], b[1][0] = x, x
    else:
        x, y = both(lambda c: c[1].update_and_fetch(k, v), a, b, label)
        same.check(f"{label} [1].update_and_fetch", x, y)


def test_cache_list_matches_mlx_lm_call_for_call(same, kv):
    rng = np.random.default_rng(204)
    for _ in range(SEQUENCES):
        H, D = int(rng.integers(1, 3)), int(rng.choice([32, 64]))
        max_size = int(rng.integers(2, 16))
        recurrent = bool(rng.random() < 0.4)
        a, b = _cache_list_pair(rng, kv, H, D, max_size, recurrent)
        try:
            for i in range(int(rng.integers(5, 21))):
                label = f"call {i}"
                r = rng.random()
                batched = isinstance(b[0], ref.BatchKVCache)
                rows = b[0].offset.shape[0] if batched else 1
                if r < 0.5:
                    _cache_list_update(rng, kv, a, b, H, D, same, label, rows)
                elif r < 0.62:
                    if b.is_trimmable():
                        n = int(rng.integers(0, 4))
                        x, y = both(lambda c: c.trim(n), a, b, label)
                        same.check(f"{label} trim({n})", x, y)
                elif r < 0.75:
                    if not b.empty():
                        a, b = type(a).from_state(a.state), _ref_from_state(b)
                elif r < 0.85 and not batched and not recurrent:
                    keep = b[1].keep
                    pairs = []
                    for _ in range(int(rng.integers(1, 3))):
                        p_ours = ours.CacheList(ours.KVCache(), ours.RotatingKVCache(max_size, keep))
                        p_ref = ref.CacheList(ref.KVCache(), ref.RotatingKVCache(max_size, keep))
                        _cache_list_update(rng, kv, p_ours, p_ref, H, D, same, f"{label} (other)")
                        pairs.append((p_ours, p_ref))
                    x, y = both(
                        lambda m: m[0].merge(m[1]),
                        (ours.CacheList, [a] + [p[0] for p in pairs]),
                        (ref.CacheList, [b] + [p[1] for p in pairs]),
                        f"{label} merge",
                    )
                    a, b = x, y
                elif batched:
                    idx = int(rng.integers(0, rows))
                    if b[0].keys is not None and b[1].keys is not None:
                        x, y = both(lambda c: c.extract(idx), a, b, f"{label} extract")
                        same.check(f"{label} extract({idx}).state", x.state, y.state)
                    keep = sorted(rng.choice(rows, int(rng.integers(1, rows + 1)), replace=False).tolist())
                    both(lambda c: c.filter(mx.array(keep)), a, b, f"{label} filter")
                same.check(f"{label} state", a.state, b.state)
                same.check(f"{label} size()", a.size(), b.size())
                same.check(f"{label} empty()", a.empty(), b.empty())
                same.check(f"{label} is_trimmable()", a.is_trimmable(), b.is_trimmable())
                same.check(f"{label} nbytes", a.nbytes, b.nbytes)
        except _Stop:
            pass
        same.flush()
