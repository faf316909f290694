"""The capture hook hands TOVA and H2O the softmax weights of the model's own attention (issue #34:
no second attention pass per layer per decode step on the CPU): the attention it runs instead of
MLX's is MLX's to the bit, and the kept positions and the logits are those of the scoring pass."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cachelib.mlx import hooks
from cachelib.mlx.factory import make_cache
from cachelib.mlx.importance import ImportanceKVCache


@pytest.mark.parametrize("h_q,h_kv,d", [(9, 3, 64), (4, 4, 16), (8, 2, 80), (2, 1, 128)])
def test_last_query_attention_is_mlx_cpu_attention_to_the_bit(h_q, h_kv, d):
    mx.random.seed(d + h_q)
    q, k, v = (mx.random.normal((2, h, n, d)) for h, n in ((h_q, 1), (h_kv, 37), (h_kv, 37)))
    scale = d**-0.5
    out, weights = hooks.last_query_attention(q, k, v, scale)
    with mx.stream(mx.cpu):
        reference = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=None)
    assert mx.array_equal(out, reference).item()
    logits = (q * scale).reshape(2, h_kv, h_q // h_kv, 1, d) @ mx.expand_dims(k, 2).swapaxes(-1, -2)
    expected = np.array(mx.softmax(logits, axis=-1)).reshape(2, h_q, 37)
    np.testing.assert_allclose(np.array(weights).reshape(2, h_q, 37), expected, rtol=1e-6)


def _decode(model, spec: str, steps: int, hand_weights: bool, monkeypatch):
    """Per decode step: the logits and the first importance layer's held positions (sorted per head)."""
    if not hand_weights:
        monkeypatch.setattr(hooks, "_hands_weights", lambda cache, call: False)
    cache = make_cache(model, spec)
    layer = next(c for c in cache if isinstance(c, ImportanceKVCache))  # gemma3: after sliding layers
    out = []
    with hooks.capture(model):
        model(mx.array([list(range(3, 33))]), cache=cache)  # a 30-token prompt; decode evicts from here
        for t in range(steps):
            logits = model(mx.array([[40 + 7 * t]]), cache=cache)
            mx.eval(logits)
            source = layer._pending[0] if layer._pending else None
            assert source == ("weights" if hand_weights else "queries")
            out.append((np.array(logits), np.sort(np.array(layer.positions), axis=-1)))
    monkeypatch.undo()
    return out


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
@pytest.mark.parametrize("spec", ["tova:budget=16", "h2o:budget=16,recent=4"])
def test_handed_weights_keep_the_positions_and_logits_of_the_scoring_pass(name, spec, load_model, monkeypatch):
    """The bug this pins: weights are by slot, and a first version sorted the slots back into
    position order before scoring them (a decode step after a grouped-query step)."""
    model = load_model(name, "mlx").model
    handed = _decode(model, spec, 12, True, monkeypatch)
    scored = _decode(model, spec, 12, False, monkeypatch)
    for (la, pa), (lb, pb) in zip(handed, scored):
        np.testing.assert_array_equal(pa, pb)
        np.testing.assert_array_equal(la, lb)


def test_a_chunk_after_handed_weights_scores_them_by_the_slots_they_came_in(load_model, monkeypatch):
    """Weights left pending when a several-token update comes (no one-slot ring write) score the
    held keys in their slot order before the slots are sorted and evicted."""
    model = load_model("tiny-llama", "mlx").model
    results = []
    for hand in (True, False):
        if not hand:
            monkeypatch.setattr(hooks, "_hands_weights", lambda cache, call: False)
        cache = make_cache(model, "h2o:budget=16,recent=4")
        with hooks.capture(model):
            model(mx.array([list(range(3, 33))]), cache=cache)
            for t in range(5):
                mx.eval(model(mx.array([[40 + t]]), cache=cache))
            mx.eval(model(mx.array([[50, 51, 52]]), cache=cache))  # a chunk
            mx.eval(model(mx.array([[60]]), cache=cache))
        results.append(np.sort(np.array(cache[0].positions), axis=-1))
        monkeypatch.undo()
    np.testing.assert_array_equal(results[0], results[1])


def test_capture_walks_the_model_once(load_model, monkeypatch):
    model = load_model("tiny-llama", "mlx").model
    walks = []
    walk = type(model).named_modules
    monkeypatch.setattr(type(model), "named_modules", lambda self: walks.append(1) or walk(self))
    hooks._modules.pop(id(model), None)
    for _ in range(3):
        with hooks.capture(model):
            pass
    assert len(walks) == 1


def test_a_cache_without_queries_to_score_takes_no_weights():
    from cachelib.core.importance import policy_of
    from cachelib.spec import parse_spec

    knorm = ImportanceKVCache(policy_of(parse_spec("knorm:budget=4")))
    knorm.update_and_fetch(mx.zeros((1, 1, 6, 8)), mx.zeros((1, 1, 6, 8)))
    assert not knorm.takes_weights
    tova = ImportanceKVCache(policy_of(parse_spec("tova:budget=4")))
    tova.update_and_fetch(mx.zeros((1, 1, 6, 8)), mx.zeros((1, 1, 6, 8)))
    assert tova.takes_weights
    tova.observe_weights(mx.zeros((1, 1, 1, 1, 6)))
    assert not tova.takes_weights and tova._pending[0] == "weights"
