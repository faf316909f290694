"""The importance caches on MLX against their PyTorch twins: the same scores on the same arrays,
the same kept positions on the same inputs (cache calls, and real profiles of the tiny presets
whose weights both backends load from one folder), and the attention-capture hook."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm.models.llama as llama
import numpy as np
import pytest
import torch

from cachelib.core.importance import policy_of
from cachelib.mlx import hooks
from cachelib.mlx.factory import make_cache
from cachelib.mlx.importance import ImportanceKVCache
from cachelib.mlx.importance import score_keys as mlx_scores
from cachelib.spec import parse_spec
from cachelib.torch.importance import ImportanceLayer
from cachelib.torch.importance import score_keys as torch_scores

PROMPT = "Summarise the rules of chess in a few short sentences, please."
SPECS = [
    "knorm:budget=12",
    "tova:budget=16",
    "h2o:budget=16,recent=4",
    "snapkv:budget=16,window=4",
    "snapkv:budget=20,window=8,kernel=3,max_pool=1",
]


def _arrays(rng, B, h_kv, h_q, T, tq, D):
    k = rng.standard_normal((B, h_kv, T, D)).astype(np.float32)
    q = rng.standard_normal((B, h_q, tq, D)).astype(np.float32)
    return k, q


@pytest.mark.parametrize(
    "method,kw",
    [
        ("knorm", {}),
        ("tova", {}),
        ("h2o", {}),
        ("snapkv", {"window": 4}),
        ("snapkv", {"window": 6, "kernel": 3, "pooling": "max"}),
        ("snapkv", {"window": 3, "kernel": 1}),
    ],
)
def test_scores_equal_on_both_backends(method, kw):
    rng = np.random.default_rng(0)
    for B, h_kv, h_q, T, tq, D in [(1, 1, 2, 20, 8, 32), (2, 2, 6, 33, 6, 16)]:
        k, q = _arrays(rng, B, h_kv, h_q, T, tq, D)
        a = np.array(mlx_scores(method, mx.array(k), mx.array(q), **kw))
        b = torch_scores(method, torch.from_numpy(k), torch.from_numpy(q), **kw).numpy()
        assert a.shape == (B, h_kv, T)
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize(
    "spec",
    [
        "knorm:budget=9",
        "tova:budget=10",
        "h2o:budget=10,recent=3",
        "snapkv:budget=10,window=4",
        "snapkv:budget=12,window=5,kernel=3,max_pool=1",
    ],
)
def test_cache_calls_keep_the_same_positions_on_both_backends(spec):
    """Same keys, values and queries, call for call: the same positions kept, the same arrays."""
    policy = policy_of(parse_spec(spec))
    rng = np.random.default_rng(1)
    B, h_kv, h_q, D = 2, 2, 4, 16
    ours, twin = ImportanceKVCache(policy), ImportanceLayer(policy)
    for n in [23] + [1] * 15 + [3] + [1] * 4:
        k, q = _arrays(rng, B, h_kv, h_q, n, n, D)
        v = rng.standard_normal((B, h_kv, n, D)).astype(np.float32)
        ka, va = ours.update_and_fetch(mx.array(k), mx.array(v))
        kb, vb = twin.update(torch.from_numpy(k), torch.from_numpy(v))
        order = np.argsort(np.array(ours.positions), axis=-1)[..., None]  # a decode step writes in place
        np.testing.assert_array_equal(np.take_along_axis(np.array(ka), order, axis=2), kb.numpy())
        np.testing.assert_array_equal(np.take_along_axis(np.array(va), order, axis=2), vb.numpy())
        ours.observe(mx.array(q), None)
        twin.observe(torch.from_numpy(q), None)
        a, b = ours.introspect(), twin.introspect()
        np.testing.assert_array_equal(a.head_positions, b.head_positions)
        assert (a.tokens_held, a.offset, a.bytes_allocated) == (b.tokens_held, b.offset, b.bytes_allocated)
        held = ours.by_position()
        np.testing.assert_array_equal(held[2], twin.positions)  # every batch row too
        np.testing.assert_array_equal(held[0], kb.numpy())
    assert ours.offset == 45 and ours.held < 45  # it did evict


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_profiles_keep_the_same_positions_on_both_backends(name, kept_positions):
    mine, theirs = (kept_positions(name, b, ["standard"] + SPECS, PROMPT, 24) for b in ("mlx", "torch"))
    assert len(mine) == len(theirs) > 0
    assert mine.equals(theirs), mine[mine.positions != theirs.positions].head()
    # and the positions are a real choice: after prefill, not a window of the newest tokens
    last = mine[mine.step == mine.step.max()]
    for text in last.positions:
        kept = [int(p) for p in text.split()]
        assert kept != list(range(kept[-1] - len(kept) + 1, kept[-1] + 1))


def test_methods_that_need_queries_refuse_to_evict_without_the_hook(load_model):
    model = load_model("tiny-llama", "mlx").model
    cache = make_cache(model, "tova:budget=8")
    model(mx.array([list(range(1, 21))]), cache=cache)
    with pytest.raises(ValueError, match="hooks.capture"):
        model(mx.array([[5]]), cache=cache)


def test_capture_wraps_the_model_module_function_and_restores_it(load_model):
    model = load_model("tiny-llama", "mlx").model
    original = llama.scaled_dot_product_attention
    with hooks.capture(model):
        assert llama.scaled_dot_product_attention is not original
        with hooks.capture(model):  # re-entrant
            pass
        assert llama.scaled_dot_product_attention.__wrapped__ is original
    assert llama.scaled_dot_product_attention is original


def test_capture_leaves_other_caches_unchanged(load_model):
    model = load_model("tiny-llama", "mlx").model
    ids = mx.array([list(range(3, 30))])
    plain = model(ids, cache=make_cache(model, "standard"))
    with hooks.capture(model):
        captured = model(ids, cache=make_cache(model, "standard"))
    np.testing.assert_array_equal(np.array(plain), np.array(captured))


def _scores_hard_to_rank(rng, B, H, T):
    """float32 scores with exact ties, ties only after rounding to 12 bits, subnormals and signed zeros."""
    s = rng.standard_normal((B, H, T)).astype(np.float32)
    kind = rng.integers(0, 4)
    if kind == 1:
        s = np.round(s * 2) / 2  # exact ties
    elif kind == 2:
        s = s * np.float32(1e-3) * (1 + rng.integers(0, 3, s.shape) * 2.0**-14)  # differ below 12 bits
    elif kind == 3:
        s = np.ldexp(rng.integers(-(1 << 14), 1 << 14, s.shape).astype(np.float64), -149)  # subnormals, +-0
    return s.astype(np.float32)


def test_device_selection_keeps_the_slots_of_the_host_rule():
    """select_slots (MLX, issue #34) and a decode step's one-slot eviction choose the slots
    cachelib.core.importance.select chooses: the same 12-bit rounding, ties to the older slot."""
    from cachelib.core.importance import select
    from cachelib.mlx.importance import TOVA, _decode_update, select_slots

    rng = np.random.default_rng(34)
    for _ in range(150):
        B, H, T = int(rng.integers(1, 3)), int(rng.integers(1, 4)), int(rng.integers(2, 40))
        s = _scores_hard_to_rank(rng, B, H, T)
        keep = int(rng.integers(0, T + 1))
        protect = int(rng.integers(0, keep + 1))
        np.testing.assert_array_equal(np.array(select_slots(mx.array(s), keep, protect)), select(s, keep, protect))
        protect = int(rng.integers(0, T))  # evicting one slot
        kept = select(s, T - 1, protect)
        k = rng.standard_normal((B, H, T, 4)).astype(np.float32)
        pos = np.broadcast_to(np.arange(T, dtype=np.int64) * 3, (B, H, T))
        new = mx.zeros((B, H, 0, 4))
        update = _decode_update(TOVA, policy_of(parse_spec("tova:budget=2")), False, protect)
        out = update(mx.array(k), mx.array(-k), mx.array(pos), mx.array(s), new, new, mx.array(0, mx.int64))
        np.testing.assert_array_equal(np.array(out[0]), np.take_along_axis(k, kept[..., None], axis=2))
        np.testing.assert_array_equal(np.array(out[1]), np.take_along_axis(-k, kept[..., None], axis=2))
        np.testing.assert_array_equal(np.array(out[2]), np.take_along_axis(pos, kept, axis=-1))
        np.testing.assert_array_equal(np.array(out[3]), np.take_along_axis(s, kept, axis=-1))


class _NoHost:
    def __getattr__(self, name):
        raise AssertionError(f"numpy.{name} called: an MLX decode step brought scores to the host")


@pytest.mark.parametrize("spec", ["knorm:budget=12", "tova:budget=12", "h2o:budget=12,recent=4"])
def test_decode_steps_score_and_evict_without_the_host(spec, load_model, monkeypatch):
    """Issue #34: scores, positions and the selection stay MLX arrays during decode (no numpy in
    the cache's code while the model decodes); the cache still evicts down to its budget."""
    import cachelib.mlx.importance as importance

    model = load_model("tiny-llama", "mlx").model
    cache = make_cache(model, spec)
    with hooks.capture(model):
        model(mx.array([list(range(3, 23))]), cache=cache)  # a 20-token prompt; decode evicts from here
        monkeypatch.setattr(importance, "np", _NoHost())
        for t in range(6):
            mx.eval(model(mx.array([[30 + t]]), cache=cache))
    monkeypatch.undo()
    layer = cache[0]
    assert isinstance(layer.positions, mx.array) and isinstance(layer.scores, mx.array)
    view = layer.introspect()
    assert view.tokens_held == 12 and view.offset == 26 and view.head_positions.max() == 25
