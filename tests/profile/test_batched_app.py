"""The Live page runs its strategies as one strategy batch by default and one by one when
*One by one* is ticked; the saved profile's metadata says which."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from streamlit.testing.v1 import AppTest  # noqa: E402

from cachelib.profile import load_profile  # noqa: E402

MAIN = ROOT / "app" / "main.py"
TIMEOUT = 180


@pytest.mark.parametrize("one_by_one", [False, True])
def test_the_live_page_batches_its_strategies_unless_told_one_by_one(one_by_one, tmp_path, monkeypatch):
    from app.keys import Keys

    monkeypatch.setenv("CACHELIB_PROFILES_DIR", str(tmp_path))
    at = AppTest.from_file(str(MAIN), default_timeout=TIMEOUT)
    at.run()
    at.selectbox(key="model").set_value("tiny-llama").run()
    at.slider(key="max_tokens").set_value(3)
    at.checkbox(key=Keys.ONE_BY_ONE).set_value(one_by_one)
    at.button(key="run").click().run()
    assert not at.exception and not at.error
    assert at.session_state[Keys.LIVE].done.wait(240)
    at.run()
    assert not at.exception and not at.error
    saved = load_profile(next(tmp_path.glob("*.csv")))
    assert saved.complete and len(saved.strategies) >= 2
    assert saved.meta["batch"] == ("one by one" if one_by_one else "strategy batch")
    caption = " ".join(c.value for c in at.caption)
    assert ("one by one" if one_by_one else f"{len(saved.strategies)} strategies in one batch") in caption
