"""An importance method added to the strategy table alone (plus one scorer per backend, here in
this file) runs end to end, as docs/adding-a-strategy.md says: both backends' caches keep the same
positions on the same arrays and on a tiny model, the profiler captures the queries it needs, and
the planner's bytes are the measured ones. Nothing else in cachelib names it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from cachelib.core.importance import Method, policy_of
from cachelib.mlx import importance as mlx_importance
from cachelib.plan import arch_from_model_info, trace
from cachelib.profile import Probes, run_profile
from cachelib.spec import STRATEGIES, Knob, Strategy, importance_layer, parse_spec
from cachelib.torch import importance as torch_importance

PROMPT = "Summarise the rules of chess in a few short sentences, please."

# --- the added method: TOVA's last-query attention, but each KV head chooses by its own query group


class MlxLastQuery(mlx_importance.Scorer):
    @staticmethod
    def score(keys, queries, *, window, kernel, pooling, scale):
        B, h_kv, T, _ = keys.shape
        w = mlx_importance.attention_weights(keys, queries[..., -1:, :], scale)[..., 0, :]  # (B, H_q, T)
        return w.reshape(B, h_kv, -1, T).mean(2)


class TorchLastQuery(torch_importance.Scorer):
    @staticmethod
    def score(keys, queries, *, window, kernel, pooling, scale):
        B, h_kv, T, _ = keys.shape
        w = torch_importance.attention_weights(keys, queries[..., -1:, :], scale)[..., 0, :]  # (B, H_q, T)
        return w.reshape(B, h_kv, -1, T).mean(2)


ADDED = Strategy(
    "lastq",
    "keeps `budget` tokens by the last query's attention, each KV head its own (test-only)",
    (Knob("budget", "tokens each full-attention layer keeps", required=True, min=2),),
    plan=importance_layer,
    mlx="cachelib.mlx.importance:build_importance",
    torch="cachelib.torch.importance:build_importance",
    window="budget",
    importance=Method(f"{__name__}:MlxLastQuery", f"{__name__}:TorchLastQuery", protect_newest=1),
)


@pytest.fixture
def added(monkeypatch):
    monkeypatch.setitem(STRATEGIES, ADDED.name, ADDED)
    return parse_spec("lastq:budget=12")


def test_an_added_importance_method_keeps_the_same_positions_on_both_backends_call_for_call(added):
    policy = policy_of(added)
    ours, twin = mlx_importance.ImportanceKVCache(policy), torch_importance.ImportanceLayer(policy)
    assert (ours.scorer, twin.scorer) == (MlxLastQuery, TorchLastQuery)
    rng = np.random.default_rng(5)
    B, h_kv, h_q, D = 2, 2, 4, 16
    for n in [23] + [1] * 12 + [3] + [1] * 4:
        k = rng.standard_normal((B, h_kv, n, D)).astype(np.float32)
        q = rng.standard_normal((B, h_q, n, D)).astype(np.float32)
        ka, _ = ours.update_and_fetch(mx.array(k), mx.array(k))
        kb, _ = twin.update(torch.from_numpy(k), torch.from_numpy(k))
        np.testing.assert_array_equal(np.array(ka), kb.numpy())
        ours.observe(mx.array(q), None)
        twin.observe(torch.from_numpy(q), None)
        np.testing.assert_array_equal(np.array(ours.positions), twin.positions)
    view = ours.introspect()
    assert view.kind == "lastq" and view.tokens_held == 12 and view.offset == 42
    kept = np.array(ours.positions)
    assert (kept[:, :, -1] == 41).all()  # the newest token is protected
    assert not (kept[:, 0] == kept[:, 1]).all()  # each KV head chose its own


def test_an_added_importance_method_profiles_on_both_backends_with_exact_planned_bytes(added, load_model):
    probes = Probes(memory=1, ring=1, quant_error=0, quality=0, masks=0, system=0)
    kept = {}
    for backend in ("mlx", "torch"):
        loaded = load_model("tiny-llama", backend)  # one folder of weights: the same model on both
        profile = run_profile(loaded, ["standard", added], prompt=PROMPT, max_tokens=16, probes=probes)
        assert profile.complete, profile.meta["reason"]
        steps = profile.frame("steps")
        mine = steps[steps["strategy"] == str(added)]
        arch = arch_from_model_info(loaded.info)
        planned = trace(
            arch, added, backend, updates=[int(profile.meta["prompt_tokens"])] + [1] * 15, dtype=loaded.info.dtype
        )
        assert mine["cache_bytes_allocated"].tolist() == [s.bytes_allocated for s in planned.steps]
        slots = profile.frame("slots")
        slots = slots[(slots["strategy"] == str(added)) & slots["head"].notna()]
        kept[backend] = slots[["step", "layer", "head", "positions"]].reset_index(drop=True)
        layers = profile.frame("layers")
        last = layers[(layers["strategy"] == str(added)) & (layers["step"] == layers["step"].max())]
        assert set(last["tokens_held"]) == {12}  # every (full-attention) layer holds its budget
    assert len(kept["mlx"]) > 0 and kept["mlx"].equals(kept["torch"])
