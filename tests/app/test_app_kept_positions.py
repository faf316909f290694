"""The Inspector's kept-positions figures on real profiles of the tiny-llama preset: a ring holds
its sinks plus the newest window, SnapKV's prompt positions are chosen once and stay, the
per-head shares are what the slot rows say, and the page draws both figures."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from app_helpers import MAIN, figure_json, plain, plotly_figures
from streamlit.testing.v1 import AppTest

from app import importance_charts as kc
from app.data import run_view
from app.keys import Keys
from cachelib.profile import Probes, load_profile, run_profile

PROMPT = "Summarise the rules of chess in a few short sentences, please."
RING = "rotating:max_size=16,keep=2"
SNAPKV = "snapkv:budget=12,window=4"
H2O = "h2o:budget=12,recent=4"
STRATEGIES = ["standard", RING, SNAPKV, H2O]
STEPS = 16
TIMEOUT = 120


@pytest.fixture(scope="module")
def kept_profile(tmp_path_factory, load_model):
    out = tmp_path_factory.mktemp("kept") / "kept.csv"
    probes = Probes(memory=1, ring=1, quant_error=0, quality=0, masks=0, system=0)
    run_profile(
        load_model("tiny-llama", "mlx"),
        STRATEGIES,
        prompt=PROMPT,
        max_tokens=STEPS,
        probes=probes,
        out=out,
        name="kept",
    )
    profile = load_profile(out)
    assert profile.complete, profile.meta["reason"]
    return profile


def _tables(profile):
    return profile.frame("slots"), profile.frame("layers")


def _offset(layers, strategy, step, layer) -> int:
    row = layers[(layers["strategy"] == strategy) & (layers["step"] == step) & (layers["layer"] == layer)]
    return int(row["offset"].item())


def test_a_ring_holds_its_sinks_and_the_newest_window_at_every_step(kept_profile):
    slots, layers = _tables(kept_profile)
    num_layers = int(kept_profile.meta["num_layers"])
    for step in range(1, STEPS):
        info = kc._kept_layers_info(slots, layers, RING, step)
        assert info.layers.tolist() == list(range(num_layers)) and (info.heads == 1).all()
        for layer in range(num_layers):
            offset = _offset(layers, RING, step, layer)
            assert offset > 16  # past the ring's size: it has evicted
            assert info.held(layer).tolist() == [0, 1, *range(offset - 14, offset)], (step, layer)
            assert np.isnan(info.share[info.layers.tolist().index(layer), offset:]).all()  # not yet seen
    run = kc._kept_steps_info(slots, layers, RING, 0, STEPS - 1)
    assert run.steps.tolist() == list(range(STEPS))
    for step in range(1, STEPS):
        offset = _offset(layers, RING, step, 0)
        assert run.held(step).tolist() == [0, 1, *range(offset - 14, offset)]
    assert run.kept_throughout.tolist()[:2] == [0, 1]  # the sinks stay; the window moves
    assert len(run.kept_throughout) < 16


def test_snapkv_chooses_its_prompt_positions_once(kept_profile):
    slots, layers = _tables(kept_profile)
    prompt = kc._prompt_tokens(slots, layers, SNAPKV)
    assert prompt == _offset(layers, SNAPKV, 0, 0) and prompt > 12
    for layer in range(int(kept_profile.meta["num_layers"])):
        run = kc._kept_steps_info(slots, layers, SNAPKV, layer, STEPS - 1)
        assert run.prompt_tokens == prompt
        first = run.held(0)
        assert first.tolist() == list(range(prompt))  # the prefill is attended in full
        chosen = [run.held(s)[run.held(s) < prompt].tolist() for s in range(1, STEPS)]
        assert len(chosen[0]) == 12 and all(c == chosen[0] for c in chosen), layer  # chosen once, then kept
        for s in range(1, STEPS):  # decode tokens are appended, never evicted
            offset = _offset(layers, SNAPKV, s, layer)
            assert run.held(s)[run.held(s) >= prompt].tolist() == list(range(prompt, offset))
        assert set(chosen[0]) <= set(run.kept_throughout.tolist())
    # unlike a ring, not the newest window: some kept prompt positions are far from the end
    h2o = kc._kept_steps_info(slots, layers, H2O, 0, STEPS - 1)
    assert h2o.held(STEPS - 1).min() < _offset(layers, H2O, STEPS - 1, 0) - 16


def _check_shares(slots, layers, strategy, step):
    info = kc._kept_layers_info(slots, layers, strategy, step)
    seen = ~np.isnan(info.share)
    assert ((info.share[seen] >= 0) & (info.share[seen] <= 1)).all()
    for i, layer in enumerate(info.layers):
        rows = slots[(slots["strategy"] == strategy) & (slots["step"] == step) & (slots["layer"] == layer)]
        held = [{int(p) for p in str(t).split() if int(p) >= 0} for t in rows["positions"]]
        assert info.heads[i] == len(rows)
        expected = [sum(p in h for h in held) / len(held) for p in range(info.seen[i])]
        np.testing.assert_allclose(info.share[i, : info.seen[i]], expected)
    return info


def test_per_head_shares_are_in_0_1_and_match_the_slot_rows(kept_profile):
    slots, layers = _tables(kept_profile)
    for strategy in (SNAPKV, H2O):
        assert slots.loc[slots["strategy"] == strategy, "head"].notna().all()
        for step in (0, 1, STEPS - 1):
            _check_shares(slots, layers, strategy, step)
    # tiny-llama has one KV head: a second head made of H2O's rows gives shares of 0, 1/2 and 1
    a = slots[slots["strategy"] == SNAPKV]
    b = slots[slots["strategy"] == H2O].assign(strategy=SNAPKV, head=1)
    two = pd.concat([a, b], ignore_index=True)
    info = _check_shares(two, layers, SNAPKV, STEPS - 1)
    assert info.per_head and (info.heads == 2).all()
    assert {0.0, 0.5, 1.0} <= set(np.unique(info.share[~np.isnan(info.share)]).tolist())
    run = kc._kept_steps_info(two, layers, SNAPKV, 0, STEPS - 1)
    col = run.steps.tolist().index(STEPS - 1)
    np.testing.assert_allclose(run.share[:, col], info.share[0, : len(run.positions)])
    words = figure_json(kc._kept_layers_plot(info))["data"][0]["customdata"]
    assert "1 of 2 KV heads hold it" in {w for row in words for w in row}


def test_the_figures_draw(kept_profile):
    slots, layers = _tables(kept_profile)
    for strategy in (RING, SNAPKV, H2O):
        fig = plain(kc.kept_layers_figure(slots, layers, strategy, 5).to_dict())
        assert fig["layout"]["title"]["text"].startswith(f"kept positions per layer<br><sup>{strategy} · step 5")
        assert np.asarray(fig["data"][0]["z"]).shape == (4, _offset(layers, strategy, 5, 0))
        assert any(str(t.get("name", "")).startswith("end of the prompt") for t in fig["data"])
        fig = plain(kc.kept_steps_figure(slots, layers, strategy, 1, STEPS - 1).to_dict())
        assert fig["layout"]["title"]["text"].startswith(f"kept positions over the run<br><sup>{strategy} · layer 1")
        assert np.asarray(fig["data"][0]["z"]).shape == (_offset(layers, strategy, STEPS - 1, 1), STEPS)
    empty = kc.kept_layers_figure(slots, layers, "standard", 5).to_dict()
    assert "no slot table" in empty["layout"]["annotations"][0]["text"]
    assert "no slot table" in kc.kept_steps_figure(slots, layers, "standard", 0, 5).layout.annotations[0].text


def test_inspector_draws_the_kept_positions(profiles_dir, kept_profile):
    at = AppTest.from_file(str(MAIN), default_timeout=TIMEOUT)
    at.session_state[Keys.CURRENT] = (kept_profile, run_view(kept_profile, "kept"))
    at.run()
    at.switch_page("views/inspector.py").run()
    for strategy in (SNAPKV, RING, H2O):
        at.selectbox(key=Keys.INSP_STRATEGY).set_value(strategy).run()
        at.select_slider(key=Keys.INSP_STEP).set_value(8).run()
        assert not at.exception
        titles = [f["layout"]["title"]["text"] for f in plotly_figures(at)]
        assert any(t.startswith(f"kept positions per layer<br><sup>{strategy} · step 8") for t in titles), titles
        assert any(
            t.startswith(f"kept positions over the run<br><sup>{strategy} · layer 0 · steps 0–8") for t in titles
        )
    at.selectbox(key=Keys.INSP_STRATEGY).set_value("standard").run()
    assert not at.exception
    assert any("recorded no slot table" in c.value for c in at.caption)
