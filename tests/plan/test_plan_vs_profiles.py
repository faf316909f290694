"""The planner's predicted bytes equal the measured bytes of our own caches, at every step and
every layer of a real profile, for every strategy, on both backends: zero bytes difference."""

from __future__ import annotations

import pytest

from cachelib.plan import arch_from_model_info, trace
from cachelib.profile import Probes, run_profile

# Small knobs so that every allocation rule changes state within a short run: growth steps, ring
# wrap-around after a prompt longer than the ring, chunk boundaries, the KIVI residual flush,
# quantize-after-N, a static preallocation, windows on every layer.
STRATEGIES = [
    "standard:step=16",
    "concat",
    "rotating:max_size=16,keep=4",
    "rotating:max_size=24,keep=2,bits=4,group_size=32",
    "quantized:bits=8,group_size=32",
    "quantized:bits=4,group_size=64,start=24",
    "quantized:key_bits=8,value_bits=4,group_size=32",
    "kivi:bits=4,group_size=32,residual=8",
    "chunked:chunk_size=16",
    "static:max_len=96",
    "sliding:window=12",
    "fp8",
    "q8_0",
    "q4_0",
]
TORCH_ONLY = ["offloaded"]
MEMORY_ONLY = Probes(memory=1, ring=0, quant_error=0, quality=0, masks=0, system=0)
PROMPT = "Summarise the rules of chess in a few short sentences, please."


def _check(loaded, steps: int):
    info = loaded.info
    specs = STRATEGIES + (TORCH_ONLY if info.backend == "torch" else [])
    profile = run_profile(loaded, specs, prompt=PROMPT, max_tokens=steps, probes=MEMORY_ONLY)
    assert profile.complete, profile.meta["reason"]
    arch = arch_from_model_info(info)
    prompt_tokens = int(profile.meta["prompt_tokens"])
    assert prompt_tokens > 24  # the rings see a prompt longer than themselves
    layers = profile.frame("layers")
    measured_steps = profile.frame("steps")
    for label in profile.strategies:
        predicted = trace(arch, label, info.backend, updates=[prompt_tokens] + [1] * (steps - 1), dtype=info.dtype)
        mine = measured_steps[measured_steps["strategy"] == label]["cache_bytes_allocated"].tolist()
        theirs = [s.bytes_allocated for s in predicted.steps]
        assert mine == theirs, f"{info.name} {info.backend} {label}: measured {mine} vs planned {theirs}"
        per_layer = layers[layers["strategy"] == label].pivot(index="step", columns="layer", values="bytes_allocated")
        for step, planned in zip(per_layer.index, predicted.steps):
            assert per_layer.loc[step].tolist() == list(planned.layer_bytes), (label, step)


@pytest.mark.parametrize("backend", ["mlx", "torch"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-mamba"])
def test_presets_measured_bytes_equal_planned_bytes(name, backend, load_model):
    _check(load_model(name, backend), steps=40)


@pytest.mark.bundled
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_bundled_model_measured_bytes_equal_planned_bytes(backend, smollm2_mlx, smollm2_torch):
    _check(smollm2_mlx if backend == "mlx" else smollm2_torch, steps=20)
