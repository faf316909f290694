"""Randomized differential tests: our layers against the installed transformers classes.

Each test drives one of our layer classes and transformers' class of the same name through
1,000 seeded random call sequences (updates of 1..N tokens, crops, mask sizes, beam reorders,
batch select / repeat, resets, past recording) and requires every returned tensor and scalar
to be equal. The quantized layer is compared with transformers' bookkeeping over a lossless
stand-in quantizer: same counts and shapes, values within our quantizer's error bound.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch_helpers import rand_kv, same
from transformers import cache_utils as tf

import cachelib.torch as ct
from cachelib.torch.quantizer import Quantizer

SEQUENCES = 1000


def _check_update(ours, theirs, k, v):
    ok, ov = ours.update(k, v)
    tk, tv = theirs.update(k.clone(), v.clone())
    assert same(ok, tk) and same(ov, tv)


def _check_sizes(ours, theirs, rng):
    assert int(ours.get_seq_length()) == int(theirs.get_seq_length())
    assert ours.get_max_length() == theirs.get_max_length()
    q = int(rng.integers(1, 6))
    assert tuple(map(int, ours.get_mask_sizes(q))) == tuple(map(int, theirs.get_mask_sizes(q)))


def _batch_op(ours, theirs, rng, batch: int, allow_resize: bool) -> int:
    """A random beam reorder, or (where transformers has them) batch select / repeat."""
    # Both skip batch edits on an empty layer, and then the next update keeps the old batch.
    allow_resize = allow_resize and ours.get_seq_length() > 0 and ours.keys.shape[-2] > 0
    op = int(rng.integers(0, 3 if allow_resize else 1))
    if op == 0:
        idx = torch.from_numpy(rng.integers(0, batch, batch))
        ours.reorder_cache(idx)
        theirs.reorder_cache(idx.clone())
        return batch
    if op == 1 and batch < 4:
        ours.batch_repeat_interleave(2)
        theirs.batch_repeat_interleave(2)
        return batch * 2
    idx = torch.from_numpy(np.sort(rng.choice(batch, max(1, batch - 1), replace=False)))
    ours.batch_select_indices(idx)
    theirs.batch_select_indices(idx.clone())
    return len(idx)


def _run(make_pair, step, seed_base: int):
    """Drive SEQUENCES random sequences; ``step(ours, theirs, rng, state)`` does one call."""
    for seed in range(SEQUENCES):
        rng = np.random.default_rng(seed_base + seed)
        ours, theirs, state = make_pair(rng)
        for _ in range(int(rng.integers(3, 10))):
            step(ours, theirs, rng, state)
        _check_sizes(ours, theirs, rng)


def test_dynamic_layer_matches_transformers_on_random_sequences():
    def make(rng):
        return ct.DynamicLayer(), tf.DynamicLayer(), {"batch": int(rng.integers(1, 3)), "dim": int(rng.choice([4, 8]))}

    def step(ours, theirs, rng, st):
        r = rng.random()
        held = ours.get_seq_length()
        if r < 0.55 or held == 0:
            _check_update(ours, theirs, *rand_kv(rng, st["batch"], 2, int(rng.integers(1, 6)), st["dim"]))
        elif r < 0.7:
            n = int(rng.integers(0, held + 3))  # over-crops included: both empty the layer
            ours.crop(-n)
            theirs.crop(-n)
        elif r < 0.85:
            st["batch"] = _batch_op(ours, theirs, rng, st["batch"], allow_resize=True)
        elif r < 0.9:
            ours.reset()
            theirs.reset()
        _check_sizes(ours, theirs, rng)
        if ours.get_seq_length():
            assert same(ours.keys, theirs.keys) and same(ours.values, theirs.values)

    _run(make, step, 10_000)


def test_sliding_window_layer_matches_transformers_on_random_sequences():
    def make(rng):
        window = int(rng.integers(2, 9))
        ours, theirs = ct.DynamicSlidingWindowLayer(window), tf.DynamicSlidingWindowLayer(window)
        if rng.random() < 0.4:
            ours.activate_past_recording()
            theirs.activate_past_recording()
        return ours, theirs, {"batch": int(rng.integers(1, 3))}

    def step(ours, theirs, rng, st):
        r = rng.random()
        if r < 0.6 or not ours.is_initialized:
            _check_update(ours, theirs, *rand_kv(rng, st["batch"], 2, int(rng.integers(1, 7)), 4))
        elif r < 0.8:
            seen, window = ours.get_seq_length(), ours.sliding_window
            if seen >= window and not ours.record_past:
                with pytest.raises(ValueError, match="activate_past_recording"):
                    ours.crop(0)
                return
            n = int(rng.integers(0, ours.keys.shape[-2] + 1))
            ours.crop(-n)
            theirs.crop(-n)
            assert same(ours.keys, theirs.keys)
        elif r < 0.92:
            st["batch"] = _batch_op(ours, theirs, rng, st["batch"], allow_resize=True)
        else:
            ours.reset()
            theirs.reset()
        _check_sizes(ours, theirs, rng)

    _run(make, step, 20_000)


def test_static_layer_matches_transformers_on_random_sequences():
    def make(rng):
        size = int(rng.integers(4, 24))
        return ct.StaticLayer(size), tf.StaticLayer(size), {"batch": int(rng.integers(1, 3))}

    def step(ours, theirs, rng, st):
        r = rng.random()
        room = ours.max_cache_len - ours.get_seq_length()
        if (r < 0.6 or not ours.is_initialized) and room > 0:
            _check_update(ours, theirs, *rand_kv(rng, st["batch"], 2, int(rng.integers(1, min(room, 6) + 1)), 4))
        elif r < 0.75:
            n = int(rng.integers(0, ours.get_seq_length() + 1))
            ours.crop(-n)
            theirs.crop(-n)
        elif r < 0.9:
            _batch_op(ours, theirs, rng, st["batch"], allow_resize=False)
            if ours.is_initialized:
                assert same(ours.keys, theirs.keys)
        else:
            ours.reset()
            theirs.reset()
        _check_sizes(ours, theirs, rng)

    _run(make, step, 30_000)


def test_static_sliding_window_layer_matches_transformers_on_random_sequences():
    def make(rng):
        size, window = int(rng.integers(2, 16)), int(rng.integers(2, 12))
        return (
            ct.StaticSlidingWindowLayer(size, window),
            tf.StaticSlidingWindowLayer(size, window),
            {"batch": int(rng.integers(1, 3))},
        )

    def step(ours, theirs, rng, st):
        r = rng.random()
        assert ours.is_croppable == theirs.is_croppable
        if r < 0.7 or not ours.is_initialized:
            _check_update(ours, theirs, *rand_kv(rng, st["batch"], 2, int(rng.integers(1, 6)), 4))
        elif r < 0.8 and ours.is_croppable and ours.get_seq_length() <= ours.max_cache_len:
            n = int(rng.integers(0, ours.get_seq_length() + 1))
            ours.crop(-n)
            theirs.crop(-n)
        elif r < 0.9:
            _batch_op(ours, theirs, rng, st["batch"], allow_resize=False)
            assert same(ours.keys, theirs.keys)
        else:
            ours.reset()
            theirs.reset()
        _check_sizes(ours, theirs, rng)

    _run(make, step, 40_000)


class _LosslessQuantizedLayer(tf.QuantizedLayer):
    """transformers' KIVI bookkeeping with a quantizer that keeps values exactly."""

    def _quantize(self, tensor, axis):
        return tensor.clone()

    def _dequantize(self, q_tensor):
        return q_tensor


def test_quantized_layer_matches_transformers_bookkeeping_within_the_error_bound():
    def make(rng):
        bits, group = int(rng.choice([2, 4, 8])), int(rng.choice([32, 64]))
        residual = int(rng.integers(1, 9))
        ours = ct.QuantizedLayer(nbits=bits, q_group_size=group, residual_length=residual)
        theirs = _LosslessQuantizedLayer(nbits=bits, q_group_size=group, residual_length=residual)
        return ours, theirs, {"batch": int(rng.integers(1, 3)), "q": Quantizer(bits, group)}

    def step(ours, theirs, rng, st):
        r = rng.random()
        if r < 0.75 or not ours.is_initialized:
            k, v = rand_kv(rng, st["batch"], 2, int(rng.integers(1, 5)), 64)
            ok, ov = ours.update(k, v)
            tk, tv = theirs.update(k.clone(), v.clone())
            assert ok.shape == tk.shape and ov.shape == tv.shape
            assert ((ok - tk).abs() <= st["q"].error_bound(tk) + 1e-6).all()
            assert ((ov - tv).abs() <= st["q"].error_bound(tv) + 1e-6).all()
            # Same split between quantized tokens and the full-precision residual.
            assert ours.keys.shape[-2] == (theirs.keys.shape[-2] if theirs.keys.dim() == 4 else 0)
            assert ours.quantized_keys[0].shape[-2] == theirs._quantized_keys.shape[-2]
        elif r < 0.9:
            _batch_op(ours, theirs, rng, st["batch"], allow_resize=False)
        else:
            ours.reset()
            theirs.reset()
        _check_sizes(ours, theirs, rng)

    _run(make, step, 50_000)


def _conv_ops(ours, theirs, rng, st):
    """One random call on the recurrent-state side of a layer (ours and transformers')."""
    r = rng.random()
    batch, channels = st["batch"], 3
    if r < 0.45:
        t = int(rng.integers(1, 6))
        x = torch.from_numpy(rng.standard_normal((batch, channels, t)).astype(np.float32))
        kernel = st["kernel"]
        assert same(
            ours.update_conv_state(x, 0, conv_kernel_size=kernel),
            theirs.update_conv_state(x.clone(), 0, conv_kernel_size=kernel),
        )
    elif r < 0.65:
        x = torch.from_numpy(rng.standard_normal((batch, channels, 2)).astype(np.float32))
        assert same(ours.update_recurrent_state(x, 0), theirs.update_recurrent_state(x.clone(), 0))
    elif r < 0.75 and ours.is_conv_states_initialized[0] and not ours.record_past:
        # Decode: the model writes into the conv state it was given, in place.
        ours.conv_states[0].mul_(0.5)
        theirs.conv_states[0].mul_(0.5)
    elif r < 0.85 and ours.record_past and ours.is_conv_states_initialized[0]:
        n = int(rng.integers(0, ours.conv_states[0].shape[-1] + 1))
        ours.crop(-n)
        theirs.crop(-n)
    elif r < 0.92:
        idx = torch.from_numpy(rng.integers(0, batch, batch))
        ours.reorder_cache(idx)
        theirs.reorder_cache(idx.clone())
    else:
        ours.reset()
        theirs.reset()
    for i in range(1):
        assert same(ours.conv_states[i], theirs.conv_states[i])
        assert same(ours.recurrent_states[i], theirs.recurrent_states[i])
        assert ours.has_previous_state[i] == theirs.has_previous_state[i]
    assert ours.is_croppable == theirs.is_croppable
    assert ours.is_compileable == theirs.is_compileable
    assert ours.get_max_length() == theirs.get_max_length()


def test_linear_attention_layer_matches_transformers_on_random_sequences():
    def make(rng):
        ours, theirs = ct.LinearAttentionLayer(), tf.LinearAttentionLayer()
        if rng.random() < 0.4:
            ours.activate_past_recording()
            theirs.activate_past_recording()
        return ours, theirs, {"batch": int(rng.integers(1, 3)), "kernel": int(rng.integers(2, 5))}

    for seed in range(SEQUENCES):
        rng = np.random.default_rng(60_000 + seed)
        ours, theirs, st = make(rng)
        for _ in range(int(rng.integers(3, 10))):
            _conv_ops(ours, theirs, rng, st)


HYBRIDS = [
    (ct.LinearAttentionAndFullAttentionLayer, tf.LinearAttentionAndFullAttentionLayer, lambda rng: {}),
    (
        ct.LinearAttentionAndSlidingWindowAttentionLayer,
        tf.LinearAttentionAndSlidingWindowAttentionLayer,
        lambda rng: {"sliding_window": int(rng.integers(2, 8))},
    ),
    (
        ct.LinearAttentionAndStaticFullAttentionLayer,
        tf.LinearAttentionAndStaticFullAttentionLayer,
        lambda rng: {"max_cache_len": 64},
    ),
    (
        ct.LinearAttentionAndStaticSlidingWindowAttentionLayer,
        tf.LinearAttentionAndStaticSlidingWindowAttentionLayer,
        lambda rng: {"max_cache_len": 64, "sliding_window": int(rng.integers(2, 8))},
    ),
]


@pytest.mark.parametrize("ours_cls,theirs_cls,kwargs", HYBRIDS, ids=[h[0].__name__ for h in HYBRIDS])
def test_hybrid_layers_match_transformers_on_random_sequences(ours_cls, theirs_cls, kwargs):
    """Recurrent-state and attention calls interleaved, as a hybrid model layer makes them."""
    for seed in range(SEQUENCES):
        rng = np.random.default_rng(70_000 + seed)
        kw = kwargs(rng)
        ours, theirs = ours_cls(**kw), theirs_cls(**kw)
        st = {"batch": int(rng.integers(1, 3)), "kernel": 3}
        assert ours.is_sliding == theirs.is_sliding and ours.supports_early_init == theirs.supports_early_init
        for _ in range(int(rng.integers(3, 10))):
            if rng.random() < 0.5:
                if ours.get_seq_length() + 5 <= kw.get("max_cache_len", 10**6):
                    _check_update(ours, theirs, *rand_kv(rng, st["batch"], 2, int(rng.integers(1, 5)), 4))
            else:
                # No crops: transformers' hybrid crop needs recorded past on both halves.
                if ours.record_past:
                    continue
                _conv_ops(ours, theirs, rng, st)
            _check_sizes(ours, theirs, rng)


@pytest.mark.parametrize("preset", ["tiny-gemma3", "tiny-llama"])
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_whole_caches_match_transformers_per_layer(tiny, preset, kind):
    """DynamicCache / StaticCache from a config: same layer classes, and every cache-level
    answer equal along random per-layer update sequences."""
    config = tiny(preset).config
    text = config.get_text_config(decoder=True)
    for seed in range(200):
        rng = np.random.default_rng(80_000 + seed)
        if kind == "dynamic":
            ours, theirs = ct.DynamicCache(config=config), tf.DynamicCache(config=config)
        else:
            ours, theirs = ct.StaticCache(config, max_cache_len=48), tf.StaticCache(config, max_cache_len=48)
        assert [type(x).__name__ for x in ours.layers] == [type(x).__name__ for x in theirs.layers]
        assert ours.is_sliding == theirs.is_sliding and ours.is_compileable == theirs.is_compileable
        seen = 0
        for _ in range(int(rng.integers(1, 5))):
            n = int(rng.integers(1, 9))
            if seen + n > 48:
                break
            for q in (1, n):
                for i in range(len(ours)):
                    assert ours.get_mask_sizes(q, i) == tuple(int(x) for x in theirs.get_mask_sizes(q, i))
            for i in range(len(ours)):
                k, v = rand_kv(rng, 1, text.num_key_value_heads, n, 8)
                a, b = ours.update(k, v, i), theirs.update(k.clone(), v.clone(), i)
                assert same(a[0], b[0]) and same(a[1], b[1])
            seen += n
            assert ours.get_seq_length() == int(theirs.get_seq_length())
            assert ours.get_max_length() == theirs.get_max_length()
        if kind == "dynamic" and rng.random() < 0.5 and seen:
            ours.crop(-1)
            theirs.crop(-1)
            assert ours.get_seq_length() == int(theirs.get_seq_length())


# --- drop-in parity beyond the random sequences (issue 17, item 17) ----------------------------


def _both(ours, theirs, *calls):
    """Make the same calls on both layers: ("update", n) or ("crop", n)."""
    rng = np.random.default_rng(0)
    for op, n in calls:
        for layer in (ours, theirs):
            if op == "update":
                layer.update(*rand_kv(np.random.default_rng(rng.integers(1 << 30)), 1, 2, n, 4))
            elif op == "record":
                layer.activate_past_recording()
            else:
                layer.crop(n)


@pytest.mark.parametrize(
    "make",
    [
        lambda m: m.DynamicLayer(),
        lambda m: m.DynamicSlidingWindowLayer(8),  # the window not yet full
    ],
    ids=["DynamicLayer", "DynamicSlidingWindowLayer"],
)
def test_cropping_more_than_is_held_empties_the_layer_as_in_transformers(make):
    # ours raised ValueError ("would remove more than the 5 tokens held")
    ours, theirs = make(ct), make(tf)
    _both(ours, theirs, ("update", 3), ("update", 2), ("crop", -9))
    assert ours.get_seq_length() == int(theirs.get_seq_length()) == 0
    assert same(ours.keys, theirs.keys) and ours.keys.shape[-2] == 0
    assert tuple(ours.get_mask_sizes(2)) == tuple(int(x) for x in theirs.get_mask_sizes(2))
    k, v = rand_kv(np.random.default_rng(1), 1, 2, 2, 4)
    a, b = ours.update(k, v), theirs.update(k.clone(), v.clone())
    assert same(a[0], b[0]) and ours.get_seq_length() == int(theirs.get_seq_length()) == 2


def test_where_transformers_state_goes_invalid_ours_stays_valid():
    """Over-crops and overflows that leave transformers' layer with a negative or impossible
    length: ours empty the layer (or refuse and change nothing) and keep answering correctly.
    docs/library.md lists these."""
    # StaticLayer over-crop: theirs -2 tokens, ours empty; the next write lands at position 0.
    ours, theirs = ct.StaticLayer(8), tf.StaticLayer(8)
    _both(ours, theirs, ("update", 3), ("crop", -5))
    assert int(theirs.get_seq_length()) == -2
    assert ours.get_seq_length() == 0
    k, v = rand_kv(np.random.default_rng(2), 1, 2, 2, 4)
    ours.update(k, v)
    assert ours.get_seq_length() == 2 and same(ours.keys[..., :2, :], k)

    # StaticSlidingWindowLayer over-crop (croppable: the window never passed): theirs -2, ours 0.
    ours, theirs = ct.StaticSlidingWindowLayer(4, 8), tf.StaticSlidingWindowLayer(4, 8)
    _both(ours, theirs, ("update", 3), ("crop", -5))
    assert theirs.get_seq_length() == -2 and ours.get_seq_length() == 0
    assert ours.get_mask_sizes(1) == (4, 0)

    # A recorded sliding window cropped past everything it saw: theirs -1, ours empty.
    ours, theirs = ct.DynamicSlidingWindowLayer(3), tf.DynamicSlidingWindowLayer(3)
    _both(ours, theirs, ("record", 0), ("update", 3), ("update", 2), ("crop", -6))
    assert theirs.get_seq_length() == -1
    assert ours.get_seq_length() == 0 and ours.keys.shape[-2] == 0 and ours.get_mask_sizes(1) == (1, 0)

    # Writing past a static cache: theirs raises IndexError after counting the tokens (6 of 4),
    # ours raises an IndexError that is also our ValueError, before changing anything.
    ours, theirs = ct.StaticLayer(4), tf.StaticLayer(4)
    _both(ours, theirs, ("update", 3))
    k, v = rand_kv(np.random.default_rng(3), 1, 2, 3, 4)
    with pytest.raises(IndexError):
        theirs.update(k, v)
    with pytest.raises(IndexError, match=r"3 new tokens at position 3 do not fit in max_cache_len=4 \(room for 1\)"):
        ours.update(k, v)
    assert int(theirs.get_seq_length()) == 6 and ours.get_seq_length() == 3

    # QuantizedLayer: transformers' is not croppable (its crop fails on the emptied residual);
    # ours removes tokens exactly, and an over-crop empties it.
    ours = ct.QuantizedLayer(nbits=4, q_group_size=32, residual_length=4)
    theirs = _LosslessQuantizedLayer(nbits=4, q_group_size=32, residual_length=4)
    k, v = rand_kv(np.random.default_rng(4), 1, 2, 5, 32)
    ours.update(k, v)
    theirs.update(k.clone(), v.clone())
    with pytest.raises(IndexError):
        theirs.crop(-2)
    ours.crop(-2)
    assert ours.get_seq_length() == 3
    ours.crop(-7)
    assert ours.get_seq_length() == 0 and ours.introspect().tokens_held == 0


REFUSALS = [
    # (what, make the layer and bring it to the refusal's state, the call that is refused)
    ("full window crop without recording", lambda m: m.DynamicSlidingWindowLayer(3), [("update", 4)], ("crop", -1)),
    (
        "recorded full window crop(+1)",
        lambda m: m.DynamicSlidingWindowLayer(3),
        [("record", 0), ("update", 4)],
        ("crop", 1),
    ),
    ("static crop(+1)", lambda m: m.StaticLayer(8), [("update", 2)], ("crop", 1)),
    ("dynamic crop(+1)", lambda m: m.DynamicLayer(), [("update", 2)], ("crop", 1)),
    ("static write past the end", lambda m: m.StaticLayer(4), [("update", 3)], ("update", 2)),
    ("linear crop without recording", lambda m: m.LinearAttentionLayer(), [], ("crop", -1)),
]


@pytest.mark.parametrize("what,make,before,call", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_raise_instances_of_the_class_transformers_raises(what, make, before, call):
    """Ours keeps its own message (and stays a ValueError); the exception is also an instance
    of what transformers raises for the same call, so `except RuntimeError` / `except
    IndexError` written for transformers still catches it."""
    ours, theirs = make(ct), make(tf)
    _both(ours, theirs, *before)
    with pytest.raises(Exception) as theirs_raised:
        _one(theirs, call)
    with pytest.raises(ValueError) as ours_raised:
        _one(ours, call)
    assert isinstance(ours_raised.value, type(theirs_raised.value)), (
        type(ours_raised.value),
        type(theirs_raised.value),
    )
    assert type(ours).__name__ in str(ours_raised.value)  # our message names the layer and the limit


def _one(layer, call):
    op, n = call
    if op == "update":
        layer.update(*rand_kv(np.random.default_rng(5), 1, 2, n, 4))
    else:
        layer.crop(n)


# The keywords transformers' caches pass to layers they build from a config
# (get_layer_types_and_kwargs, StaticCache): every layer class takes them, using or ignoring them.
KEYWORDS = [
    ("DynamicLayer", {"sliding_window": 4}),
    ("DynamicLayer", {"max_cache_len": 16, "config": None}),
    ("DynamicSlidingWindowLayer", {"sliding_window": 4, "max_cache_len": 16}),
    ("StaticLayer", {"max_cache_len": 16, "sliding_window": 4}),
    ("StaticSlidingWindowLayer", {"max_cache_len": 16, "sliding_window": 4, "number_of_states": 1}),
    ("LinearAttentionLayer", {"number_of_states": 2, "max_cache_len": 16}),
    ("LinearAttentionAndFullAttentionLayer", {"number_of_states": 2, "sliding_window": 4}),
    ("LinearAttentionAndSlidingWindowAttentionLayer", {"sliding_window": 4, "number_of_states": 2}),
    ("LinearAttentionAndStaticFullAttentionLayer", {"max_cache_len": 16, "number_of_states": 1, "sliding_window": 4}),
    ("LinearAttentionAndStaticSlidingWindowAttentionLayer", {"max_cache_len": 16, "sliding_window": 4}),
    ("DummyLayer", {"sliding_window": 4}),
]


@pytest.mark.parametrize("name,kwargs", KEYWORDS, ids=[f"{n}-{'-'.join(k)}" for n, k in KEYWORDS])
def test_layer_constructors_accept_the_keywords_transformers_layers_accept(name, kwargs):
    ours, theirs = getattr(ct, name)(**kwargs), getattr(tf, name)(**kwargs)
    for attr in ("sliding_window", "max_cache_len", "number_of_states", "is_sliding"):
        if hasattr(theirs, attr):
            assert getattr(ours, attr) == getattr(theirs, attr), attr
    if hasattr(theirs, "get_max_length"):
        assert ours.get_max_length() == theirs.get_max_length()
    if name.startswith(("Dynamic", "Static", "LinearAttentionAnd")):
        for _ in range(3):  # an ignored keyword changes nothing: same answers as theirs
            _both(ours, theirs, ("update", 3))
            assert ours.get_seq_length() == int(theirs.get_seq_length())
            assert tuple(ours.get_mask_sizes(1)) == tuple(int(x) for x in theirs.get_mask_sizes(1))


def test_a_misspelt_keyword_is_refused_not_swallowed():
    with pytest.raises(TypeError, match="sliding_windw"):
        ct.DynamicLayer(sliding_windw=4)


def test_quantized_layer_takes_transformers_axis_keywords():
    ours = ct.QuantizedLayer(nbits=2, axis_key=0, axis_value=0, q_group_size=32, residual_length=8)
    assert (ours.nbits, ours.axis_key, ours.axis_value, ours.q_group_size, ours.residual_length) == (2, 0, 0, 32, 8)


def test_hybrid_sliding_layer_exposes_sliding_window_as_transformers_does():
    ours = ct.LinearAttentionAndSlidingWindowAttentionLayer(sliding_window=5)
    theirs = tf.LinearAttentionAndSlidingWindowAttentionLayer(sliding_window=5)
    assert ours.sliding_window == theirs.sliding_window == 5
    _both(ours, theirs, ("update", 2))
    assert same(ours._sliding_window_tensor, theirs._sliding_window_tensor)


def test_a_cache_built_by_transformers_dispatch_table_from_our_classes_matches(tiny):
    """transformers' own recipe (its layer-type table, get_layer_types_and_kwargs) with our
    classes of the same names builds a cache that answers like transformers' DynamicCache."""
    config = tiny("tiny-gemma3").config.get_text_config(decoder=True)
    types, per_layer = tf.get_layer_types_and_kwargs(config)
    for table in (tf.DYNAMIC_LAYER_TYPE_MAPPING, tf.STATIC_LAYER_TYPE_MAPPING):
        extra = {"max_cache_len": 32} if table is tf.STATIC_LAYER_TYPE_MAPPING else {}
        ours = [getattr(ct, table[t].__name__)(**extra, **kw) for t, kw in zip(types, per_layer)]
        theirs = [table[t](**extra, **kw) for t, kw in zip(types, per_layer)]
        assert [type(x).__name__ for x in ours] == [type(x).__name__ for x in theirs]
        for a, b in zip(ours, theirs):
            _both(a, b, ("update", 5), ("update", 1))
            assert a.get_seq_length() == int(b.get_seq_length())
            assert tuple(a.get_mask_sizes(1)) == tuple(int(x) for x in b.get_mask_sizes(1))
