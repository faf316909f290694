"""Prompt-cache files move both ways between mlx-lm and us, and bad files are refused by name."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm.models.cache as ref
import numpy as np
import pytest

import cachelib.mlx as ours


def _filled(rng, kv):
    """The same layer caches in mlx-lm's classes and ours, after the same updates."""
    pairs = [
        (ref.KVCache(), ours.KVCache()),
        (ref.RotatingKVCache(6, 2), ours.RotatingKVCache(6, 2)),
        (ref.QuantizedKVCache(32, 4), ours.QuantizedKVCache(32, 4)),
        (ref.ChunkedKVCache(5), ours.ChunkedKVCache(5)),
        (ref.ConcatenateKVCache(), ours.ConcatenateKVCache()),
        (ref.CacheList(ref.KVCache(), ref.RotatingKVCache(4)), ours.CacheList(ours.KVCache(), ours.RotatingKVCache(4))),
    ]
    for S in (3, 1, 1, 4, 1):
        k, v = kv(rng, 1, 2, S, 32)
        for theirs, mine in pairs:
            for a in (theirs, mine):
                if isinstance(a, (ref.CacheList, ours.CacheList)):
                    a[0].update_and_fetch(k, v)
                    a[1].update_and_fetch(k, v)
                else:
                    a.update_and_fetch(k, v)
    arrays_ref, arrays_ours = ref.ArraysCache(2), ours.ArraysCache(2)
    conv = mx.array(rng.standard_normal((1, 3, 8), dtype=np.float32))
    arrays_ref[0] = arrays_ours[0] = conv
    pairs.append((arrays_ref, arrays_ours))
    batch_ref, batch_ours = ref.BatchKVCache([1, 0]), ours.BatchKVCache([1, 0])
    rot_ref, rot_ours = ref.BatchRotatingKVCache(4, [2, 0]), ours.BatchRotatingKVCache(4, [2, 0])
    for S in (3, 1, 1, 1):
        k, v = kv(rng, 2, 1, S, 32)
        for a in (batch_ref, batch_ours, rot_ref, rot_ours):
            a.update_and_fetch(k, v)
    pairs += [(batch_ref, batch_ours), (rot_ref, rot_ours)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _assert_same_states(same, got, want):
    assert [type(c).__name__ for c in got] == [type(c).__name__ for c in want]
    for i, (a, b) in enumerate(zip(got, want)):
        same.check(f"layer {i} state", a.state, b.state)
        same.check(f"layer {i} nbytes", a.nbytes, b.nbytes)
    same.flush()


def test_a_file_saved_by_us_loads_in_mlx_lm_and_back(tmp_path, kv, same):
    theirs, mine = _filled(np.random.default_rng(401), kv)
    path = str(tmp_path / "ours.safetensors")
    ours.save_prompt_cache(path, mine, {"model": "smollm2", "note": "x.y"})
    loaded, meta = ref.load_prompt_cache(path, return_metadata=True)
    assert meta == {"model": "smollm2", "note": "x.y"}
    assert all(type(c).__module__ == "mlx_lm.models.cache" for c in loaded)
    _assert_same_states(same, loaded, theirs)
    again = ours.load_prompt_cache(path)
    assert all(isinstance(c, ours.LayerCache) for c in again)
    _assert_same_states(same, again, theirs)


def test_a_file_saved_by_mlx_lm_loads_in_ours_and_decodes_on(tmp_path, kv, same):
    rng = np.random.default_rng(402)
    theirs, _ = _filled(rng, kv)
    path = str(tmp_path / "theirs.safetensors")
    ref.save_prompt_cache(path, theirs, {"k": "v"})
    mine, meta = ours.load_prompt_cache(path, return_metadata=True)
    assert meta == {"k": "v"}
    assert [type(c) for c in mine] == [ours.CACHE_CLASSES[type(c).__name__] for c in theirs]
    _assert_same_states(same, mine, theirs)
    for step in range(3):  # the loaded caches carry on exactly like mlx-lm's
        k, v = kv(rng, 1, 2, 1, 32)
        for i in (0, 1, 2, 3):
            same.check(f"step {step} layer {i}", mine[i].update_and_fetch(k, v), theirs[i].update_and_fetch(k, v))
    same.flush()


def test_our_own_classes_round_trip_through_our_files(tmp_path, kv, same):
    rng = np.random.default_rng(403)
    caches = [
        ours.QuantizedRotatingKVCache(6, 1, 32, 4, value_bits=8),
        ours.QuantizedKVCache(32, 8, value_bits=4),
        ours.QuantizedKVCache(32, 4, start=50),
        ours.StaticKVCache(20),
        ours.KIVICache(3, 32, 2),
        ours.MambaCache(),
        ours.KVCache(),  # empty
    ]
    for S in (4, 1, 1, 5):
        k, v = kv(rng, 1, 1, S, 32)
        for c in caches[:5]:
            c.update_and_fetch(k, v)
    caches[5][1] = k
    path = str(tmp_path / "extras.safetensors")
    ours.save_prompt_cache(path, caches)
    loaded = ours.load_prompt_cache(path)
    _assert_same_states(same, loaded, caches)
    assert not hasattr(loaded[1], "bits") and not hasattr(loaded[2], "bits")  # mixed widths, not yet quantized
    k, v = kv(rng, 1, 1, 1, 32)
    for i in range(5):
        same.check(f"layer {i} after load", loaded[i].update_and_fetch(k, v), caches[i].update_and_fetch(k, v))
    same.flush()


def _save_raw(path, tensors, header):
    """A doctored copy next to ``path`` (mx.load reads lazily, so never overwrite the source)."""
    _save_raw.count = getattr(_save_raw, "count", 0) + 1
    out = path.with_name(f"{path.stem}-{_save_raw.count}.safetensors")
    mx.save_safetensors(str(out), tensors, header)
    return str(out)


def test_a_file_naming_an_unknown_class_is_refused(tmp_path):
    path = tmp_path / "evil.safetensors"
    ref.save_prompt_cache(str(path), [ref.KVCache()])
    tensors, header = mx.load(str(path), return_metadata=True)
    header["1.0"] = "os.system"
    with pytest.raises(ValueError, match=r"layer 0 \(os.system\): unknown cache class 'os.system'; .*KVCache"):
        ours.load_prompt_cache(_save_raw(path, tensors, header))


def test_a_file_with_a_missing_tensor_is_refused(tmp_path, kv):
    cache = ours.KVCache()
    cache.update_and_fetch(*kv(np.random.default_rng(404), 1, 1, 2, 32))
    path = tmp_path / "partial.safetensors"
    ours.save_prompt_cache(str(path), [cache, ours.RotatingKVCache(4)])
    tensors, header = mx.load(str(path), return_metadata=True)
    with pytest.raises(ValueError, match=r"layer 0 \(KVCache\) is missing state entries"):
        ours.load_prompt_cache(_save_raw(path, {k: v for k, v in tensors.items() if k != "0.1"}, header))
    with pytest.raises(ValueError, match=r"lists tensor '0.2' \(scalar\) but the file has no such tensor"):
        ours.load_prompt_cache(_save_raw(path, {k: v for k, v in tensors.items() if k != "0.2"}, header))
    single = tmp_path / "single.safetensors"
    ours.save_prompt_cache(str(single), [cache])
    tensors, header = mx.load(str(single), return_metadata=True)
    with pytest.raises(ValueError, match=r"2 layer classes but holds tensors for layers \[0\] \(missing: \[1\]\)"):
        ours.load_prompt_cache(_save_raw(single, tensors, dict(header, **{"1.1": "KVCache"})))


def test_a_file_with_inconsistent_metadata_is_refused(tmp_path, kv):
    cache = ours.RotatingKVCache(8, 2)
    cache.update_and_fetch(*kv(np.random.default_rng(405), 1, 1, 3, 32))
    path = tmp_path / "bad.safetensors"
    ours.save_prompt_cache(str(path), [cache])
    tensors, header = mx.load(str(path), return_metadata=True)
    bad_kind = dict(header, **{"2.1.1": "pickle"})
    with pytest.raises(ValueError, match=r"kind 'pickle'; allowed: scalar, string, none"):
        ours.load_prompt_cache(_save_raw(path, tensors, bad_kind))
    dangling = dict(header, **{"2.1.0": "9.9"})
    with pytest.raises(ValueError, match=r"lists tensor '9.9' .* no such tensor"):
        ours.load_prompt_cache(_save_raw(path, tensors, dangling))
    keep_too_big = dict(tensors, **{"0.3": mx.array(8)})  # keep == max_size
    with pytest.raises(ValueError, match=r"layer 0 \(RotatingKVCache\): .*keep=8 must be < max_size=8"):
        ours.load_prompt_cache(_save_raw(path, keep_too_big, header))
    gap = dict(header, **{"1.3": "KVCache"})
    with pytest.raises(ValueError, match=r"class names are listed for layers \[0, 3\]"):
        ours.load_prompt_cache(_save_raw(path, tensors, gap))
    with pytest.raises(ValueError, match=r"no cache class names"):
        ours.load_prompt_cache(_save_raw(path, tensors, {}))


def test_a_batch_file_mlx_lm_writes_with_one_padding_entry_for_all_rows_loads_with_a_warning(tmp_path, kv):
    # mlx-lm writes and reads back a batch cache whose left_padding (and offset) has one entry
    # for several rows, and decodes on it (the entry broadcasts); ours refused it (issue 17, item 18)
    rng = np.random.default_rng(406)
    theirs = [ref.BatchKVCache([1]), ref.BatchRotatingKVCache(4, [1])]
    for S in (3, 1):
        k, v = kv(rng, 2, 1, S, 32)
        for c in theirs:
            c.update_and_fetch(k, v)
    path = str(tmp_path / "batch.safetensors")
    ref.save_prompt_cache(path, theirs)
    back = ref.load_prompt_cache(path)  # mlx-lm reads it without complaint
    assert [c.left_padding.shape for c in back] == [(1,), (1,)] and back[0].keys.shape[0] == 2

    with pytest.warns(UserWarning) as warned:
        mine = ours.load_prompt_cache(path)
    said = [str(w.message) for w in warned]
    assert len(said) == 2 and all("batch.safetensors" in m for m in said)
    assert "layer 0 (BatchKVCache)" in said[0] and "layer 1 (BatchRotatingKVCache)" in said[1]
    assert all("1 offset and 1 left_padding entries for 2 batch rows" in m for m in said)
    assert [c.left_padding.tolist() for c in mine] == [[1, 1], [1, 1]]
    # and decodes on exactly as mlx-lm's caches that wrote it (mlx-lm's own loaded
    # BatchRotatingKVCache cannot: from_state leaves out its _lengths)
    for step in range(3):
        k, v = kv(rng, 2, 1, 1, 32)
        for i, (a, b) in enumerate(zip(mine, theirs)):
            mask_a, mask_b = a.make_mask(1, return_array=True), b.make_mask(1, return_array=True)
            np.testing.assert_array_equal(np.array(mask_a), np.broadcast_to(np.array(mask_b), mask_a.shape))
            got, want = a.update_and_fetch(k, v), b.update_and_fetch(k, v)
            for x, y in zip(got, want):
                np.testing.assert_array_equal(np.array(x), np.array(y), err_msg=f"step {step} layer {i}")


def test_a_batch_file_whose_padding_cannot_cover_its_rows_is_refused_by_name(tmp_path, kv):
    # two left_padding entries for three rows: mlx-lm loads it, but its first mask fails to broadcast
    cache = ref.BatchKVCache([1, 0])
    cache.update_and_fetch(*kv(np.random.default_rng(407), 3, 1, 2, 32))
    path = str(tmp_path / "rows.safetensors")
    ref.save_prompt_cache(path, [cache])
    refused = r"rows.safetensors.*layer 0 \(BatchKVCache\).*keys hold 3 batch rows but left_padding has 2 entries"
    with pytest.raises(ValueError, match=refused):
        ours.load_prompt_cache(path)
