"""Fixtures for the cachelib.torch tests (helpers live in ``torch_helpers``)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny(load_model):
    """``tiny(name)``: a preset model (tiny-llama / tiny-gemma3 / tiny-mamba) on torch."""

    def get(name: str):
        return load_model(name, "torch").model

    return get
