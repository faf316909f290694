"""The importance caches on PyTorch: ``score_keys`` against a plain loop-by-loop reading of what
its docstring says it computes, the layer's eviction timing and refusals, the capture hook
(transparent for every other cache, restored afterwards), and the strategies' spec errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cachelib.core.importance import policy_of, select
from cachelib.spec import SpecError, parse_spec
from cachelib.torch import hooks
from cachelib.torch.factory import make_cache
from cachelib.torch.importance import ImportanceLayer, score_keys


def _softmax_rows(keys, queries, b, hq, group):
    """Per query (last Tq positions), softmax over the keys it may see; (Tq, T)."""
    T, tq, D = keys.shape[2], queries.shape[2], keys.shape[3]
    out = np.zeros((tq, T))
    for i in range(tq):
        pos = T - tq + i
        logits = [float(queries[b, hq, i] @ keys[b, hq // group, j]) / math.sqrt(D) for j in range(pos + 1)]
        m = max(logits)
        e = [math.exp(x - m) for x in logits]
        out[i, : pos + 1] = [x / sum(e) for x in e]
    return out


def _reference(method, keys, queries, window=4, kernel=5, pooling="avg"):
    B, h_kv, T, _ = keys.shape
    h_q = queries.shape[1]
    group = h_q // h_kv
    out = np.zeros((B, h_kv, T))
    for b in range(B):
        if method == "tova":
            rows = [_softmax_rows(keys, queries[:, :, -1:], b, h, group)[0, :-1] for h in range(h_q)]
            s = np.mean(rows, axis=0)
            out[b, :, :-1] = s
            continue
        per_head = []
        for h in range(h_q):
            w = _softmax_rows(keys, queries[:, :, -window:], b, h, group)[:, : T - window].mean(0)
            pad = kernel // 2
            padded = np.concatenate(
                [
                    np.full(pad, 0.0 if pooling == "avg" else -np.inf),
                    w,
                    np.full(pad, 0.0 if pooling == "avg" else -np.inf),
                ]
            )
            win = [padded[j : j + kernel] for j in range(T - window)]
            per_head.append([x.sum() / kernel if pooling == "avg" else x.max() for x in win])
        for g in range(h_kv):
            out[b, g, : T - window] = np.mean(per_head[g * group : (g + 1) * group], axis=0)
    if method == "snapkv":  # the window's keys get the largest score of the whole tensor
        out[..., T - window :] = out[..., : T - window].max()
    if method == "tova":  # the last key too
        out[..., -1] = out[..., :-1].max()
    return out


@pytest.mark.parametrize(
    "method,kw", [("tova", {}), ("snapkv", {"window": 4}), ("snapkv", {"window": 5, "kernel": 3, "pooling": "max"})]
)
def test_score_keys_computes_what_its_docstring_says(method, kw):
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 2, 14, 8, generator=g)
    queries = torch.randn(2, 4, 6, 8, generator=g)
    got = score_keys(method, keys, queries, **kw).numpy()
    np.testing.assert_allclose(got, _reference(method, keys.numpy(), queries.numpy(), **kw), rtol=1e-5, atol=1e-7)


def test_knorm_scores_are_minus_the_key_norms():
    keys = torch.randn(1, 2, 9, 16)
    np.testing.assert_allclose(
        score_keys("knorm", keys, None).numpy(), -np.linalg.norm(keys.numpy(), axis=-1), rtol=1e-6
    )


def test_h2o_scores_sum_the_attention_of_every_query():
    keys, queries = torch.randn(1, 1, 7, 8), torch.randn(1, 2, 7, 8)
    s = score_keys("h2o", keys, queries).numpy()
    assert s.sum() == pytest.approx(7.0, rel=1e-5)  # each query's weights sum to 1; group mean keeps that
    assert s[0, 0, 0] > s[0, 0, -1]  # the first key is seen by all 7 queries, the last by one


def test_score_keys_refuses_bad_input():
    keys = torch.randn(1, 1, 6, 8)
    with pytest.raises(ValueError, match="choose one of"):
        score_keys("nope", keys, None)
    with pytest.raises(ValueError, match="needs queries"):
        score_keys("tova", keys, None)
    with pytest.raises(ValueError, match="more keys"):
        score_keys("snapkv", keys, torch.randn(1, 1, 8, 8), window=8)
    with pytest.raises(ValueError, match="odd"):
        score_keys("snapkv", keys, torch.randn(1, 1, 2, 8), window=2, kernel=4)


def test_select_keeps_the_protected_newest_and_the_best_older_slots_ties_to_the_older():
    scores = np.array([[[5.0, 1.0, 5.0, 3.0, 0.0, 0.0]]])
    assert select(scores, 3, 1).tolist() == [[[0, 2, 5]]]
    assert select(scores, 2, 0).tolist() == [[[0, 2]]]
    assert select(np.zeros((1, 1, 4)), 2, 0).tolist() == [[[0, 1]]]  # a tie: the older


def test_evicting_layer_attends_over_exactly_budget_tokens_during_decode():
    layer = ImportanceLayer(policy_of(parse_spec("knorm:budget=6")))
    k = torch.randn(1, 1, 10, 4)
    assert layer.get_mask_sizes(10) == (10, 0)
    assert layer.update(k, k)[0].shape[-2] == 10  # the prompt is attended in full
    for step in range(5):
        kv_length, kv_offset = layer.get_mask_sizes(1)
        out, _ = layer.update(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
        assert out.shape[-2] == kv_length == 6 and kv_offset == layer.offset - 1 - 5
    assert layer.get_seq_length() == 15
    view = layer.introspect()
    assert view.evicted == 9 and view.head_positions.shape == (1, 6) and view.head_positions[0, -1] == 14


def test_snapkv_compresses_once_then_appends():
    layer = ImportanceLayer(policy_of(parse_spec("snapkv:budget=6,window=2")))
    k = torch.randn(1, 1, 10, 4)
    layer.update(k, k)
    layer.observe(torch.randn(1, 2, 10, 4), None)
    held = []
    for _ in range(4):
        layer.update(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
        held.append(layer.held)
    assert held == [7, 8, 9, 10]
    assert layer.positions[0, 0, 4:6].tolist() == [8, 9]  # the observation window is kept


def test_methods_that_need_queries_refuse_to_evict_without_the_hook(load_model):
    model = load_model("tiny-llama", "torch").model
    cache = make_cache(model, "h2o:budget=8,recent=2")
    with torch.inference_mode():
        model(input_ids=torch.tensor([list(range(1, 21))]), cache=cache)
        with pytest.raises(ValueError, match="hooks.capture"):
            model(input_ids=torch.tensor([[5]]), cache=cache)


def test_capture_is_transparent_for_other_caches_and_restores_the_implementation(load_model):
    model = load_model("tiny-llama", "torch").model
    before = model.config._attn_implementation
    ids = torch.tensor([list(range(3, 30))])
    with torch.inference_mode():
        plain = model(input_ids=ids, cache=make_cache(model, "concat")).logits
        with hooks.capture(model):
            assert model.config._attn_implementation == hooks.PREFIX + before
            with hooks.capture(model):  # re-entrant
                pass
            captured = model(input_ids=ids, cache=make_cache(model, "concat")).logits
    assert model.config._attn_implementation == before
    torch.testing.assert_close(plain, captured, rtol=0, atol=0)


def test_an_importance_cache_under_the_hook_keeps_a_budget_and_logits_match_the_full_cache_at_prefill(load_model):
    model = load_model("tiny-llama", "torch").model
    ids = torch.tensor([list(range(3, 40))])
    with torch.inference_mode(), hooks.capture(model):
        cache = make_cache(model, "tova:budget=10")
        first = model(input_ids=ids, cache=cache).logits
        full = model(input_ids=ids, cache=make_cache(model, "concat")).logits
        model(input_ids=torch.tensor([[7]]), cache=cache)
    torch.testing.assert_close(first, full)  # prefill attends over the whole prompt
    assert {layer.held for layer in cache.layers} == {10}


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("knorm:budget=0", "must be >= 1"),
        ("snapkv:budget=8", "allowed budget: 17.."),  # below the default window of 16
        ("snapkv:budget=8,window=8", "allowed budget: 9.."),
        ("h2o:budget=4,recent=4", "allowed budget: 5.."),
        ("snapkv:budget=32,kernel=4", "allowed: 1, 3, 5"),
        ("tova", "is required"),
    ],
)
def test_bad_budgets_name_the_allowed_range(text, fragment):
    with pytest.raises(SpecError, match=fragment.replace(".", r"\.")):
        parse_spec(text)


def test_a_budget_above_the_context_is_accepted_at_build_time():
    assert parse_spec("tova:budget=100000").get("budget") == 100000
