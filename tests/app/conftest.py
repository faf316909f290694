"""Fixtures of the app tests: the repository root on the path (the app is a folder, not a
package of cachelib), a temporary profiles folder, and small real profiles from a preset."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from app_helpers import TINY_STRATEGIES  # noqa: E402


@pytest.fixture
def profiles_dir(tmp_path, monkeypatch):
    """The app reads and writes profiles here instead of the repository's profiles/."""
    folder = tmp_path / "profiles"
    folder.mkdir()
    monkeypatch.setenv("CACHELIB_PROFILES_DIR", str(folder))
    return folder


@pytest.fixture(scope="session")
def tiny_profiles(tmp_path_factory, load_model):
    """Two real profiles of the tiny-llama preset: one complete, one stopped after 5 steps."""
    from cachelib.profile import Probes, run_profile

    folder = tmp_path_factory.mktemp("tiny-profiles")
    model = load_model("tiny-llama", "mlx")
    probes = Probes(masks=8)
    run_profile(
        model,
        TINY_STRATEGIES,
        prompt="Hello there",
        max_tokens=24,
        probes=probes,
        out=folder / "tiny-complete.csv",
        name="tiny-complete",
    )
    steps = iter(range(10**6))
    run_profile(
        model,
        TINY_STRATEGIES[:2],
        prompt="Hello there",
        max_tokens=24,
        probes=probes,
        out=folder / "tiny-stopped.csv",
        name="tiny-stopped",
        should_stop=lambda: next(steps) >= 5,
    )
    return folder
