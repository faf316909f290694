"""Whole-model caches: make_prompt_cache rebuilds the model's own layout with our classes,
make_cache puts a strategy on the full-attention layers only, and the preset models with
sliding-window and recurrent layers decode through them exactly as through mlx-lm's caches."""

from __future__ import annotations

from types import SimpleNamespace

import mlx_lm.models.cache as ref
import pytest

import cachelib.mlx as ours
from cachelib.decode import greedy_decode

PROMPT = "The quick brown fox jumps over the lazy dog. Then it"  # 42 tokens: past gemma3's window of 32


def _decode(loaded, cache, n: int) -> list[int]:
    return greedy_decode(loaded, PROMPT, cache=cache, max_tokens=n, stop_at_eos=False).ids


@pytest.fixture(scope="module")
def gemma3(load_model):
    return load_model("tiny-gemma3", "mlx")


@pytest.fixture(scope="module")
def mamba(load_model):
    return load_model("tiny-mamba", "mlx")


def _layout(cache):
    out = []
    for c in cache:
        if isinstance(c, (ours.RotatingKVCache, ref.RotatingKVCache)):
            out.append(("RotatingKVCache", c.max_size, c.keep))
        elif isinstance(c, (ours.ArraysCache, ref.ArraysCache)):
            out.append(("ArraysCache", len(c.cache)))
        else:
            out.append((type(c).__name__,))
    return out


def test_make_prompt_cache_rebuilds_the_models_own_layout_with_our_classes(gemma3, mamba):
    for loaded in (gemma3, mamba):
        mine, theirs = ours.make_prompt_cache(loaded.model), ref.make_prompt_cache(loaded.model)
        assert _layout(mine) == _layout(theirs)
        assert all(isinstance(c, ours.LayerCache) for c in mine)
    assert _layout(ours.make_prompt_cache(gemma3.model))[:3] == [
        ("RotatingKVCache", 32, 0),
        ("RotatingKVCache", 32, 0),
        ("KVCache",),
    ]


def test_make_prompt_cache_without_a_model_layout_takes_max_kv_size_and_keep():
    model = SimpleNamespace(layers=[None] * 3)
    assert _layout(ours.make_prompt_cache(model)) == _layout(ref.make_prompt_cache(model)) == [("KVCache",)] * 3
    assert _layout(ours.make_prompt_cache(model, 16)) == _layout(ref.make_prompt_cache(model, 16))
    assert _layout(ours.make_prompt_cache(model, 16, keep=0)) == [("RotatingKVCache", 16, 0)] * 3
    with pytest.raises(ValueError, match="max_kv_size must be >= 1"):
        ours.make_prompt_cache(model, 0)
    with pytest.raises(ValueError, match="keep=16 must be < max_size=16"):
        ours.make_prompt_cache(model, 16, keep=16)


@pytest.mark.parametrize("name", ["gemma3", "mamba"])
def test_presets_decode_through_our_prompt_cache_as_through_mlx_lms(name, request):
    """Sliding-window + global attention (gemma3) and recurrent state (mamba)."""
    loaded = request.getfixturevalue(name)
    mine = _decode(loaded, ours.make_prompt_cache(loaded.model), 40)
    assert mine == _decode(loaded, ref.make_prompt_cache(loaded.model), 40)


def test_our_arrays_cache_uses_mlx_lms_class_only_as_an_isinstance_marker(mamba):
    """mamba stores its state only into an isinstance(mlx_lm ArraysCache): ours must pass that
    check, and yet no attribute may resolve to mlx-lm's code."""
    assert issubclass(ours.ArraysCache, ref.ArraysCache)
    for name in set(dir(ref.ArraysCache)) - set(dir(object)):
        owner = next(k for k in ours.ArraysCache.__mro__ if name in vars(k))
        assert owner.__module__.startswith("cachelib.mlx"), f"{name} comes from {owner}"
    cache = ours.make_prompt_cache(mamba.model)
    _decode(mamba, cache, 2)
    assert all(c[0] is not None and c[1] is not None for c in cache)
    assert all(v.bytes_allocated > 0 and v.layout == "recurrent" for v in ours.introspect(cache))


SPECS = [
    ("standard:step=64", ("KVCache",)),
    ("concat", ("ConcatenateKVCache",)),
    ("rotating:max_size=24,keep=2", ("RotatingKVCache", 24, 2)),
    ("rotating:max_size=24,keep=2,bits=4", ("QuantizedRotatingKVCache",)),
    ("quantized:bits=4,group_size=32,start=8", ("QuantizedKVCache",)),
    ("quantized:key_bits=8,value_bits=4", ("QuantizedKVCache",)),
    ("kivi:bits=2,residual=8", ("KIVICache",)),
    ("chunked:chunk_size=16", ("ChunkedKVCache",)),
    ("static:max_len=128", ("StaticKVCache",)),
]


@pytest.mark.parametrize("spec, full", SPECS, ids=[s for s, _ in SPECS])
def test_make_cache_puts_the_strategy_on_full_attention_layers_only(gemma3, spec, full):
    cache = ours.make_cache(gemma3.model, spec)
    assert _layout(cache) == [("RotatingKVCache", 32, 0), ("RotatingKVCache", 32, 0), full] * 2
    prompt = len(greedy_decode(gemma3, PROMPT, cache=cache, max_tokens=6, stop_at_eos=False).prompt_ids)
    views = ours.introspect(cache)
    assert views[0].offset == views[2].offset == prompt + 5
    assert views[0].tokens_held == 32  # the model's own window, untouched
    assert all(v.bytes_allocated == c.nbytes > 0 for v, c in zip(views, cache))


def test_make_cache_sliding_puts_the_window_on_every_attention_layer(gemma3):
    cache = ours.make_cache(gemma3.model, "sliding:window=20")
    assert _layout(cache) == [("RotatingKVCache", 20, 0)] * 6
    _decode(gemma3, cache, 4)
    assert {v.tokens_held for v in ours.introspect(cache)} == {20}


def test_make_cache_keeps_recurrent_state_caches(mamba):
    for spec in ("quantized:bits=4", "rotating:max_size=8", "sliding:window=4"):
        assert _layout(ours.make_cache(mamba.model, spec)) == [("ArraysCache", 2)] * 4
    mine = _decode(mamba, ours.make_cache(mamba.model, "quantized:bits=4"), 12)
    assert mine == _decode(mamba, ref.make_prompt_cache(mamba.model), 12)


def test_make_cache_standard_decodes_like_mlx_lms_default_cache(gemma3):
    mine = _decode(gemma3, ours.make_cache(gemma3.model, "standard"), 40)
    assert mine == _decode(gemma3, ref.make_prompt_cache(gemma3.model), 40)


def test_make_cache_refuses_what_mlx_cannot_do(gemma3):
    with pytest.raises(ValueError, match=r"'offloaded' is not available on mlx"):
        ours.make_cache(gemma3.model, "offloaded")
    with pytest.raises(ValueError, match=r"group_size=128 does not divide the head dimension head_dim=64"):
        ours.make_cache(gemma3.model, "quantized:bits=4,group_size=128")
    with pytest.raises(ValueError, match=r"unknown knob 'window'"):
        ours.make_cache(gemma3.model, "rotating:max_size=8,window=4")


def test_trim_helpers_agree_with_mlx_lm(kv):
    import numpy as np

    rng = np.random.default_rng(501)
    mine = [ours.KVCache(), ours.RotatingKVCache(10, 2)]
    theirs = [ref.KVCache(), ref.RotatingKVCache(10, 2)]
    k, v = kv(rng, 1, 1, 6, 32)
    for c in mine + theirs:
        c.update_and_fetch(k, v)
    assert ours.can_trim_prompt_cache(mine) == ref.can_trim_prompt_cache(theirs) is True
    assert ours.trim_prompt_cache(mine, 4) == ref.trim_prompt_cache(theirs, 4) == 4
    assert [c.offset for c in mine] == [c.offset for c in theirs] == [2, 2]
    k, v = kv(rng, 1, 1, 12, 32)
    for c in mine + theirs:
        c.update_and_fetch(k, v)
    assert ours.can_trim_prompt_cache(mine) == ref.can_trim_prompt_cache(theirs) is False
    assert ours.trim_prompt_cache(mine, 1) == ref.trim_prompt_cache(theirs, 1) == 0
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        ours.trim_prompt_cache(mine, -1)
