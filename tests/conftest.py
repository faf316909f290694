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
