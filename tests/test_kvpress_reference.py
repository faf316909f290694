"""Our importance scores against NVIDIA's kvpress 0.5.5 (issue 14's reference check).

kvpress pins transformers < 5.3, so its half runs in the side environment ``.venv-kvpress``
(``bash scripts/kvpress_env.sh`` creates it; CI does not); without it the test is skipped.
The check itself is ``bench/check_kvpress.py``: kvpress's presses score random GQA keys and
queries (fixed seed) in the side environment, ours score the same inputs here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIDE_PYTHON = ROOT / ".venv-kvpress" / "bin" / "python"

pytestmark = pytest.mark.skipif(
    not SIDE_PYTHON.exists(),
    reason="no .venv-kvpress: run `bash scripts/kvpress_env.sh` to create kvpress's environment",
)


def _check():
    spec = importlib.util.spec_from_file_location("check_kvpress", ROOT / "bench" / "check_kvpress.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_knorm_snapkv_and_tova_scores_and_kept_positions_match_kvpress(tmp_path):
    check = _check()
    npz = tmp_path / "kvpress.npz"
    check.run_reference(npz, SIDE_PYTHON)
    rows = check.compare(npz)
    assert {r["method"] for r in rows} == {"knorm", "snapkv", "tova"} and len(rows) == 3 * len(check.CASES)
    for r in rows:
        assert r["max_abs_diff"] <= check.RTOL * r["scale"], r
        assert r["rows_identical"] == r["rows"], r
