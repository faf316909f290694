"""Shared fixtures: real models are loaded once per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2_mlx():
    from cachelib.models import load

    return load("smollm2", "mlx")


@pytest.fixture(scope="session")
def smollm2_torch():
    from cachelib.models import load

    return load("smollm2", "torch")


@pytest.fixture(scope="session")
def load_model():
    """``load_model(name, backend)``: a cached loader for presets and the bundled model."""
    from cachelib.models import load

    cache: dict = {}

    def get(name: str, backend: str):
        if (name, backend) not in cache:
            cache[name, backend] = load(name, backend)
        return cache[name, backend]

    return get


@pytest.fixture(scope="session")
def kept_positions(load_model):
    """``kept_positions(name, backend, strategies, prompt, max_tokens)``: the positions each
    layer and KV head of each strategy held at each step of a profile (the ``ring`` probe's slot
    table, rows with a head), as (strategy, step, layer, head, positions) rows."""
    from cachelib.profile import Probes, run_profile

    probes = Probes(memory=1, ring=1, quant_error=0, quality=0, masks=0, system=0)

    def get(name: str, backend: str, strategies: list[str], prompt: str, max_tokens: int):
        profile = run_profile(load_model(name, backend), strategies, prompt=prompt, max_tokens=max_tokens, probes=probes)
        assert profile.complete, profile.meta["reason"]
        slots = profile.frame("slots")
        slots = slots[slots["head"].notna()]
        return slots[["strategy", "step", "layer", "head", "positions"]].reset_index(drop=True)

    return get
