"""PyramidKV (``pyramidkv``): SnapKV's scores with a budget per full-attention layer that
shrinks with depth. Its budgets are exact integers averaging ``budget``, each at least the
observation window; both backends build them from the layer's index among the full-attention
layers, keep the same positions per layer and head, and measure the bytes the planner predicts;
the Inspector's figure shows the layers holding different counts; bad knobs name the range."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from app import importance_charts as kc
from cachelib.core.importance import policy_of, pyramid_budgets
from cachelib.plan import arch_from_model_info, cache_layout, trace
from cachelib.profile import Probes, run_profile
from cachelib.spec import STRATEGIES, SpecError, parse_spec

PROMPT = "Summarise the rules of chess in a few short sentences, please."
PYRAMIDS = ["pyramidkv:budget=12,window=2,beta=4", "pyramidkv:budget=10,window=3,kernel=3,max_pool=1,beta=2"]
RING_PROBES = Probes(memory=1, ring=1, quant_error=0, quality=0, masks=0, system=0)


@pytest.mark.parametrize(
    "budget,window,beta,layers",
    [(256, 16, 16, 30), (320, 16, 20, 30), (100, 4, 3, 7), (17, 4, 4, 2), (12, 2, 4, 4), (9, 9, 1, 5), (1000, 1, 7, 1)],
)
def test_budgets_are_a_shrinking_sequence_of_integers_averaging_the_budget(budget, window, beta, layers):
    b = pyramid_budgets(budget, window, beta, layers)
    assert len(b) == layers and all(isinstance(x, int) for x in b)
    assert sum(b) == budget * layers
    assert list(b) == sorted(b, reverse=True) and b[-1] >= window
    if layers > 1:
        assert abs(b[-1] - budget / beta) < 1 and abs(b[0] - (2 * budget - budget / beta)) < 1
        steps = [x - y for x, y in zip(b, b[1:])]
        assert max(steps) - min(steps) <= 1  # arithmetic up to the rounding to integers


def test_beta_one_gives_every_layer_the_budget():
    assert pyramid_budgets(40, 16, 1, 6) == (40,) * 6


def test_the_layer_policy_follows_the_layer_index():
    spec = parse_spec("pyramidkv:budget=12,window=2,beta=4")
    assert [policy_of(spec, i, 4).budget for i in range(4)] == [21, 15, 9, 3]
    snapkv = STRATEGIES["snapkv"].importance  # PyramidKV scores as SnapKV does, on both backends
    assert {(policy_of(spec, i, 4).method.mlx, policy_of(spec, i, 4).method.torch) for i in range(4)} == {
        (snapkv.mlx, snapkv.torch)
    }
    with pytest.raises(ValueError, match=r"0\.\.3"):
        policy_of(spec, 4, 4)


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("pyramidkv:budget=0", "must be >= 1"),
        ("pyramidkv:budget=-3", "must be >= 1"),
        ("pyramidkv:budget=256", "allowed budget: 320.."),  # default window 16, beta 20: top layer 12.8 < 16
        ("pyramidkv:budget=30,window=8,beta=4", "allowed budget: 32.."),
        ("pyramidkv:budget=30,window=8,beta=4", "beta of at most 3"),
        ("pyramidkv:budget=64,beta=0", "must be >= 1"),
        ("pyramidkv:budget=2000000000,window=1,beta=2", "allowed budget: 2..1431655764"),
        ("pyramidkv:budget=64,window=4,kernel=2", "allowed: 1, 3, 5"),
        ("pyramidkv", "is required"),
    ],
)
def test_bad_knobs_name_the_allowed_range(text, fragment):
    with pytest.raises(SpecError, match=fragment.replace(".", r"\.")):
        parse_spec(text)


def test_a_budget_above_the_context_is_accepted():
    assert parse_spec("pyramidkv:budget=100000,window=16,beta=20").get("budget") == 100000


def test_strategies_command_lists_pyramidkv_and_its_beta():
    out = subprocess.run([sys.executable, "-m", "cachelib", "strategies"], capture_output=True, text=True, check=True)
    assert "pyramidkv" in out.stdout and "beta" in out.stdout


def test_the_planner_gives_each_full_attention_layer_its_depths_budget():
    from cachelib.plan import preset

    arch = preset("gemma-3-27b")  # 5 sliding layers per full one: the pyramid spans the full ones
    for backend in ("mlx", "torch"):
        layout = cache_layout(arch, "pyramidkv:budget=400,window=16,beta=20", backend)
        mine = [c.knob("budget") for c in layout if c.kind == "pyramidkv"]
        full = sum(k == "full" for k in arch.layer_kinds)
        assert mine == list(pyramid_budgets(400, 16, 20, full)) and len(set(mine)) == full


def _held(profile, label: str):
    layers = profile.frame("layers")
    mine = layers[(layers["strategy"] == label) & (layers["kind"] == "pyramidkv")]
    return mine.pivot(index="step", columns="layer", values="tokens_held")


@pytest.mark.parametrize("backend", ["mlx", "torch"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_measured_bytes_equal_planned_bytes_and_each_layer_keeps_its_budget(name, backend, load_model):
    loaded, steps = load_model(name, backend), 12
    profile = run_profile(loaded, PYRAMIDS, prompt=PROMPT, max_tokens=steps, probes=RING_PROBES)
    assert profile.complete, profile.meta["reason"]
    arch, info = arch_from_model_info(loaded.info), loaded.info
    prompt = int(profile.meta["prompt_tokens"])
    layers, measured = profile.frame("layers"), profile.frame("steps")
    for label in PYRAMIDS:
        predicted = trace(arch, label, info.backend, updates=[prompt] + [1] * (steps - 1), dtype=info.dtype)
        assert measured[measured["strategy"] == label]["cache_bytes_allocated"].tolist() == [
            s.bytes_allocated for s in predicted.steps
        ], label
        per_layer = layers[layers["strategy"] == label].pivot(index="step", columns="layer", values="bytes_allocated")
        for step, planned in zip(per_layer.index, predicted.steps):
            assert per_layer.loc[step].tolist() == list(planned.layer_bytes), (label, step)
        held = _held(profile, label)
        spec = parse_spec(label)
        budgets = pyramid_budgets(spec.get("budget"), spec.get("window"), spec.get("beta"), held.shape[1])
        assert held.iloc[0].tolist() == [prompt] * len(budgets)  # the prompt attended in full
        for k, step in enumerate(held.index[1:], start=1):  # compressed once, then appended
            assert held.loc[step].tolist() == [min(prompt, b) + k for b in budgets], (label, step)
        assert len(set(budgets)) > 1


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_both_backends_keep_the_same_positions_per_layer_and_head(name, kept_positions):
    mine, theirs = (kept_positions(name, b, PYRAMIDS, PROMPT, 8) for b in ("mlx", "torch"))
    assert len(mine) == len(theirs) > 0
    assert mine.equals(theirs), mine[mine.positions != theirs.positions].head()
    last = mine[mine.step == mine.step.max()]
    counts = {layer: len(g.positions.iloc[0].split()) for layer, g in last.groupby("layer")}
    assert len(set(counts.values())) > 1  # the layers hold different counts


def test_the_inspector_figure_shows_the_layers_differing_budgets(load_model):
    label = PYRAMIDS[0]
    profile = run_profile(load_model("tiny-llama", "mlx"), [label], prompt=PROMPT, max_tokens=4, probes=RING_PROBES)
    slots, layers = profile.frame("slots"), profile.frame("layers")
    step = int(slots["step"].max())
    fig = kc.kept_layers_figure(slots, layers, label, step)
    prompt = int(profile.meta["prompt_tokens"])
    budgets = pyramid_budgets(12, 2, 4, 4)
    held = [min(prompt, b) + step for b in budgets]
    assert f"{min(held)}–{max(held)} (by layer) of" in fig.layout.title.text
    share = np.asarray(fig.data[0].z, dtype=float)  # (layers, positions): share of KV heads holding each
    assert (np.nan_to_num(share) > 0).sum(axis=1).tolist() == held


@pytest.mark.parametrize("backend", ["mlx", "torch"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_a_chunk_after_the_compression_attends_as_its_tokens_one_by_one(name, backend, load_model):
    """transformers sizes one mask per layer type from the first layer; PyramidKV's layers hold
    different counts after compressing, so a multi-token update needs each layer's own mask
    (this raised a size mismatch in sdpa before the capture hook resized it)."""
    from cachelib.profile.backends import probe_for

    loaded = load_model(name, backend)
    probe = probe_for(loaded)
    prompt, chunk = list(range(3, 43)), [50, 51, 52]
    logits = []
    for pieces in ([chunk], [[t] for t in chunk]):
        cache = probe.make_cache(parse_spec(PYRAMIDS[0]))
        with probe.capture(cache):
            _step(loaded, cache, prompt)
            _step(loaded, cache, [7])  # the compression
            logits.append(np.concatenate([_step(loaded, cache, p) for p in pieces]))
        assert len({v.tokens_held for v in probe.views(cache) if v.kind == "pyramidkv"}) > 1
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4)


def _step(loaded, cache, ids):
    if loaded.info.backend == "mlx":
        import mlx.core as mx

        return np.array(loaded.model(mx.array([ids]), cache=cache)[0])
    import torch

    with torch.inference_mode():
        return loaded.model(input_ids=torch.tensor([ids]), cache=cache).logits[0].numpy()


KVPRESS_PYTHON = Path(__file__).resolve().parents[1] / ".venv-kvpress" / "bin" / "python"
KVPRESS_BUDGETS = """
import json, sys
from types import SimpleNamespace
from kvpress import PyramidKVPress
out = []
for q_len, ratio, window, beta, layers in json.loads(sys.argv[1]):
    press = PyramidKVPress(compression_ratio=ratio, window_size=window, beta=beta)
    config = SimpleNamespace(num_hidden_layers=layers)
    out.append([press.get_layer_budget(SimpleNamespace(config=config, layer_idx=i), q_len) for i in range(layers)])
print(json.dumps(out))
"""


@pytest.mark.skipif(not KVPRESS_PYTHON.exists(), reason="no .venv-kvpress: run `bash scripts/kvpress_env.sh`")
def test_budgets_are_kvpress_pyramidkv_budgets_where_its_prompt_cap_does_not_bind():
    """kvpress 0.5.5's PyramidKVPress.get_layer_budget, in its own environment, on prompts long
    enough that it neither caps the bottom layer nor falls back to SnapKV, gives the same
    budgets (its rounding of each layer and our exact-sum integers could differ by one token
    where a term ends in .5; not on these)."""
    import json

    # (q_len, compression_ratio, window, beta, layers): kept = q_len * (1 - ratio) is an integer
    cases = [(1024, 0.75, 16, 16, 30), (1024, 0.6875, 8, 20, 7), (4096, 0.875, 16, 20, 32), (2000, 0.9, 4, 5, 12)]
    run = subprocess.run(
        [str(KVPRESS_PYTHON), "-c", KVPRESS_BUDGETS, json.dumps(cases)], capture_output=True, text=True, check=True
    )
    theirs = json.loads(run.stdout.strip().splitlines()[-1])
    for (q_len, ratio, window, beta, layers), budgets in zip(cases, theirs):
        ours = pyramid_budgets(round(q_len * (1 - ratio)), window, beta, layers)
        assert list(ours) == budgets, (q_len, ratio)
