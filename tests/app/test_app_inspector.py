"""The Inspector's masks on a real run of the tiny-llama preset: what the figures say a ring holds
is what the ring's own slot table recorded, and evicted positions are never drawn as visible."""

from __future__ import annotations

import numpy as np
from app_helpers import MAIN, plotly_figures
from streamlit.testing.v1 import AppTest

from app import inspector_charts as ic
from app.data import run_view
from app.keys import Keys
from cachelib.profile import load_profile

RING = "rotating:max_size=16,keep=2"
TIMEOUT = 120


def test_temporal_mask_of_a_real_ring_past_its_size_has_the_three_states(tiny_profiles):
    profile = load_profile(tiny_profiles / "tiny-complete.csv")
    masks, steps = profile.frame("masks"), profile.frame("steps")
    step = 16  # masks every 8 steps: 0, 8, 16, 23
    query = int(steps[(steps["strategy"] == RING) & (steps["step"] == step)]["position"].item())
    assert query > 16  # the ring is past its size
    for layer in range(int(profile.meta["num_layers"])):
        info = ic._mask_info(masks, RING, step, layer, "temporal")
        row = info.state[-1]
        # keep=2 sinks, then the newest 14 positions; everything between was evicted.
        assert np.flatnonzero(row == ic.VISIBLE).tolist() == [0, 1, *range(query - 13, query + 1)]
        assert np.flatnonzero(row == ic.EVICTED).tolist() == list(range(2, query - 13))
        assert info.key_positions.tolist() == list(range(query + 1))
    prefill = ic._mask_info(masks, RING, 0, 0, "temporal")
    # The prefill's earlier queries cannot see later prompt positions: masked by causality.
    assert (prefill.state[0, prefill.query_positions[0] + 1 :] != ic.VISIBLE).all()
    assert (prefill.state == ic.CAUSAL).any()


def test_mask_over_a_real_run_agrees_with_every_recorded_mask(tiny_profiles):
    profile = load_profile(tiny_profiles / "tiny-complete.csv")
    tables = {t: profile.frame(t) for t in ("steps", "layers", "slots", "masks")}
    masks = tables["masks"]
    no_masks = masks.iloc[0:0]
    for strategy in profile.strategies:
        info = ic._mask_run_info(tables["steps"], tables["layers"], tables["slots"], no_masks, strategy, 0, 23)
        assert info.steps.tolist() == list(range(1, 24))  # every decode step (memory and ring every step)
        for step in (8, 16, 23):  # the held sets drawn from slots or layers rows match what the mask saw
            recorded = ic._mask_info(masks, strategy, step, 0, "temporal")
            drawn = info.state[info.steps.tolist().index(step)]
            n = recorded.state.shape[1]  # positions up to this step's query; later ones are the future
            assert drawn[:n].tolist() == recorded.state[-1].tolist(), (strategy, step)
            assert (drawn[n:] == ic.CAUSAL).all()
    ring = ic._mask_run_info(tables["steps"], tables["layers"], tables["slots"], masks, RING, 0, 23)
    assert ring.source == "slots" and ring.masked_steps == [8, 16, 23]
    assert (ring.state[:, :2] == ic.VISIBLE).all()  # the sink columns
    evicted = (ring.state == ic.EVICTED).sum(axis=1)
    assert (np.diff(evicted) == 1).all()  # the window slides: one more position evicted per step


def test_inspector_page_draws_the_mask_over_the_run(profiles_dir, tiny_profiles):
    at = AppTest.from_file(str(MAIN), default_timeout=TIMEOUT)
    profile = load_profile(tiny_profiles / "tiny-complete.csv")
    at.session_state[Keys.CURRENT] = (profile, run_view(profile, "tiny-complete"))
    at.run()
    at.switch_page("views/inspector.py").run()
    at.selectbox(key=Keys.INSP_STRATEGY).set_value(RING).run()
    at.select_slider(key=Keys.INSP_STEP).set_value(20).run()
    assert not at.exception
    figures = plotly_figures(at)
    titles = [f["layout"]["title"]["text"] for f in figures]
    run = figures[next(i for i, t in enumerate(titles) if t.startswith("what the cache holds"))]
    assert "steps 1–20" in run["layout"]["title"]["text"]
    assert {t["name"] for t in run["data"][1:]} >= {"visible", "evicted", "masked by causality"}
    z = np.asarray(run["data"][0]["z"])
    assert z.shape[0] == 20 and (z[-1] == ic.EVICTED).sum() > 0
    at.select_slider(key=Keys.INSP_SPAN).set_value(16).run()
    run = next(f for f in plotly_figures(at) if f["layout"]["title"]["text"].startswith("what the cache holds"))
    assert "steps 5–20" in run["layout"]["title"]["text"]
