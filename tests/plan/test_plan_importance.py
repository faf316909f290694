"""The planner's predicted bytes equal the measured bytes of the importance caches (knorm,
snapkv, tova, h2o) at every step and every layer of a real profile, on both backends: the
prompt is longer than every budget, so each one evicts (every step, or once after prefill)."""

from __future__ import annotations

import pytest

from cachelib.plan import arch_from_model_info, trace
from cachelib.profile import Probes, run_profile

STRATEGIES = [
    "knorm:budget=12",
    "tova:budget=16",
    "h2o:budget=16,recent=4",
    "snapkv:budget=16,window=4",
    "snapkv:budget=20,window=8,kernel=3,max_pool=1",
    "h2o:budget=200,recent=8",  # a budget above the context: nothing evicted
]
MEMORY_ONLY = Probes(memory=1, ring=0, quant_error=0, quality=0, masks=0, system=0)
PROMPT = "Summarise the rules of chess in a few short sentences, please."


def _check(loaded, steps: int):
    info = loaded.info
    profile = run_profile(loaded, STRATEGIES, prompt=PROMPT, max_tokens=steps, probes=MEMORY_ONLY)
    assert profile.complete, profile.meta["reason"]
    arch = arch_from_model_info(info)
    prompt_tokens = int(profile.meta["prompt_tokens"])
    assert prompt_tokens > 20  # every budget but the last is below the prompt
    layers = profile.frame("layers")
    measured = profile.frame("steps")
    for label in profile.strategies:
        predicted = trace(arch, label, info.backend, updates=[prompt_tokens] + [1] * (steps - 1), dtype=info.dtype)
        mine = measured[measured["strategy"] == label]["cache_bytes_allocated"].tolist()
        theirs = [s.bytes_allocated for s in predicted.steps]
        assert mine == theirs, f"{info.name} {info.backend} {label}: measured {mine} vs planned {theirs}"
        per_layer = layers[layers["strategy"] == label].pivot(index="step", columns="layer", values="bytes_allocated")
        for step, planned in zip(per_layer.index, predicted.steps):
            assert per_layer.loc[step].tolist() == list(planned.layer_bytes), (label, step)
        mine_layers = layers[(layers["strategy"] == label) & (layers["kind"] == label.partition(":")[0])]
        assert len(mine_layers)  # the full-attention layers carry the strategy
        held = mine_layers.groupby("step")["tokens_held"].max().tolist()
        assert held == [s for s in _expected_held(label, prompt_tokens, steps)], (label, held)


def _expected_held(label: str, prompt: int, steps: int) -> list[int]:
    """Tokens held after each step, from the strategy's definition (docs/importance.md)."""
    name, _, rest = label.partition(":")
    budget = int(dict(kv.split("=") for kv in rest.split(","))["budget"])
    if name == "snapkv":
        return [prompt] + [min(prompt, budget) + k for k in range(1, steps)]
    return [prompt] + [min(prompt + k, budget) for k in range(1, steps)]


@pytest.mark.parametrize("backend", ["mlx", "torch"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_importance_measured_bytes_equal_planned_bytes(name, backend, load_model):
    _check(load_model(name, backend), steps=24)
