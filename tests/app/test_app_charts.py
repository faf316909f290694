"""The app's figure builders on small hand-made tables: what each figure draws, read from its data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from app_helpers import figure_json

from app import charts, figures
from cachelib.profile import Profile, figure_data

MIB = 2**20
A, B, C = "standard", "rotating:max_size=6,keep=2", "quantized:bits=4"


def table(name: str, rows: list[dict]):
    """Rows typed exactly as a loaded profile types them."""
    p = Profile()
    p.add(name, rows)
    return p.frame(name)


def steps_table():
    rows = []
    for i, step in enumerate((0, 1, 2)):
        phase = "prefill" if step == 0 else "decode"
        common = {"step": step, "phase": phase, "position": 3 + step, "rss_bytes": (500 + step) * MIB}
        rows.append(
            {
                **common,
                "strategy": A,
                "cache_bytes_used": (i + 1) * MIB,
                "cache_bytes_allocated": 4 * MIB,
                "kl": 0.0,
                "top1_agree": True,
                "tokens_per_second": 50.0 + step,
                "device_active_bytes": 900 * MIB,
            }
        )
        rows.append(
            {
                **common,
                "strategy": B,
                "cache_bytes_used": MIB,
                "cache_bytes_allocated": MIB,
                "kl": [0.1, 0.2, 0.0][i],
                "top1_agree": [True, False, True][i],
                "tokens_per_second": 60.0 + step,
                "device_active_bytes": 901 * MIB,
            }
        )
    return table("steps", rows)


def test_strategy_colors_follow_run_order_and_are_distinct():
    colors = figures.strategy_colors([A, B, C])
    assert list(colors) == [A, B, C]
    assert len(set(colors.values())) == 3
    assert colors[A] == figures.PALETTE[0]  # the baseline always gets the first colour
    many = figures.strategy_colors([f"s{i}" for i in range(len(figures.PALETTE) + 1)])
    assert many[f"s{len(figures.PALETTE)}"] == figures.PALETTE[0]  # cycles past the palette


def test_twelve_strategies_get_twelve_distinct_colours_that_stay_with_them_in_a_subset():
    twelve = [f"strategy-{i}" for i in range(12)]
    colors = figures.strategy_colors(twelve)
    assert len(set(colors.values())) == 12
    assert len({c.lower() for c in figures.PALETTE}) == len(figures.PALETTE) >= 12
    # A figure drawing a subset with the run's colours draws each strategy in its own colour.
    steps = table(
        "steps",
        [
            {
                "strategy": s,
                "step": t,
                "phase": "decode",
                "position": t,
                "cache_bytes_used": MIB,
                "cache_bytes_allocated": MIB,
            }
            for s in twelve
            for t in (1, 2)
        ],
    )
    info = figure_data.memory_info(steps, twelve[5:8], None, colors)
    assert [s.color for s in info.series] == [colors[s] for s in twelve[5:8]]


def test_sampling_period_is_read_from_the_recorded_steps():
    assert figure_data.sampling_period([0, 4, 8, 12, 14]) == 4  # every 4th and the last
    assert figure_data.sampling_period([0, 1, 2]) == 1
    assert figure_data.sampling_period([5]) is None


def test_empty_figure_says_why_there_is_nothing_to_draw():
    fig = figure_json(figures.empty_figure("Slots", "nothing recorded", height=300))
    assert fig["layout"]["annotations"][0]["text"] == "nothing recorded" and fig["layout"]["height"] == 300
    assert fig["layout"]["xaxis"]["visible"] is False and not fig["data"]


def _by_strategy_and_kind(fig: dict) -> dict:
    return {(t["name"], t.get("meta")): t for t in fig["data"]}


def test_memory_figure_draws_used_and_allocated_per_strategy_in_mib():
    fig = figure_json(charts.cache_memory_figure(steps_table(), [A, B]))
    by = _by_strategy_and_kind(fig)
    assert set(by) == {(A, "used"), (A, "allocated"), (B, "used"), (B, "allocated")}
    np.testing.assert_allclose(by[A, "used"]["y"], [1, 2, 3])
    np.testing.assert_allclose(by[A, "allocated"]["y"], [4, 4, 4])
    np.testing.assert_allclose(by[B, "used"]["customdata"], [MIB] * 3)  # exact bytes on hover
    colors = figures.strategy_colors([A, B])
    assert by[B, "used"]["line"]["color"] == by[B, "allocated"]["line"]["color"] == colors[B]
    assert by[B, "allocated"]["line"]["dash"] == "dash"
    # One legend entry per strategy (not one per line), in a legend under the plot area that
    # grows the figure (the plot keeps its height, however many entries).
    assert [t["name"] for t in fig["data"] if t.get("showlegend") is not False] == [A, B]
    legend, margin = fig["layout"]["legend"], fig["layout"]["margin"]
    assert legend["yref"] == "container" and legend["y"] == 0 and legend["yanchor"] == "bottom"
    assert fig["layout"]["height"] - margin["t"] - margin["b"] == charts.PLOT_PX


def sampled_steps_table(every: int = 4, last: int = 9):
    """A run whose memory probe recorded every ``every``-th step and the last (system every step)."""
    rows = []
    for s in (A, B):
        for step in range(last + 1):
            row = {
                "strategy": s,
                "step": step,
                "phase": "prefill" if step == 0 else "decode",
                "position": 3 + step,
                "tokens_per_second": 10.0,
            }
            if step % every == 0 or step == last:
                row.update(cache_bytes_used=(step + 1) * MIB, cache_bytes_allocated=16 * MIB)
            rows.append(row)
    return table("steps", rows)


def test_sampled_memory_lines_join_the_recorded_steps_and_say_the_period():
    info = figure_data.memory_info(sampled_steps_table(), [A, B], None)
    assert info.every == 4
    for s in info.series:
        assert s.step.tolist() == [0, 4, 8, 9]  # the recorded steps only: no gaps to break the line
        np.testing.assert_allclose(s.values["used"], np.array([1, 5, 9, 10]) * MIB)
    fig = figure_json(charts.cache_memory_figure(sampled_steps_table(), [A, B]))
    assert "memory recorded every 4 steps" in fig["layout"]["title"]["text"]
    drawn = [t for t in fig["data"] if t.get("meta") == "used"]
    assert all(t["mode"] == "lines+markers" and np.isfinite(np.asarray(t["y"], dtype=float)).all() for t in drawn)


def test_committed_example_recorded_with_memory_4_draws_its_memory_lines():
    from cachelib.profile import load_profile

    path = Path(__file__).resolve().parents[2] / "profiles" / "examples" / "smollm2-mlx-256t.csv"
    profile = load_profile(path)
    assert json.loads(profile.meta["probes"])["memory"] == 4
    info = figure_data.memory_info(profile.frame("steps"), profile.strategies, None)
    assert [s.strategy for s in info.series] == profile.strategies
    assert info.every == 4
    for s in info.series:
        assert len(s.step) >= 60 and np.isfinite(s.values["used"]).all() and (s.values["used"] > 0).all()


@pytest.mark.parametrize("n", [7, 12])
def test_memory_figure_draws_one_panel_per_strategy_from_seven_on_shared_axes(n):
    many = [f"rotating:max_size={16 * (i + 1)},keep=4" for i in range(n)]
    rows = [
        {
            "strategy": s,
            "step": t,
            "phase": "decode",
            "position": t,
            "cache_bytes_used": (i + 1) * MIB,
            "cache_bytes_allocated": (i + 2) * MIB,
        }
        for i, s in enumerate(many)
        for t in (1, 2, 3)
    ]
    steps = table("steps", rows)
    ref = pd.DataFrame({"step": [1, 2, 3], "bytes": [MIB, 2 * MIB, 3 * MIB], "label": "full cache (exact fit)"})
    fig = figure_json(charts.cache_memory_figure(steps, many, ref))
    axes = {t["xaxis"] for t in fig["data"]}
    assert len(axes) == n  # one panel each
    assert [a["text"] for a in fig["layout"]["annotations"]] == [charts._panel_title(s) for s in many]
    assert fig["layout"]["yaxis2"]["matches"] == "y" and fig["layout"][f"xaxis{n}"]["matches"] == "x"
    domains = [fig["layout"][name]["domain"] for name in ["yaxis", *(f"yaxis{i}" for i in range(2, n + 1))]]
    assert all(0 <= lo < hi <= 1 for lo, hi in domains)  # panels stay inside the figure
    assert sum(t.get("meta") == "reference" for t in fig["data"]) == n  # the full cache in every panel
    assert fig["layout"]["showlegend"] is False
    one = figure_json(charts.cache_memory_figure(steps, many, ref, small_multiples=False))
    assert {t.get("xaxis", "x") for t in one["data"]} == {"x"}


def test_memory_figure_draws_the_full_cache_reference():
    import pandas as pd

    ref = pd.DataFrame({"step": [0, 1, 2], "bytes": [4 * MIB, 5 * MIB, 6 * MIB], "label": "full cache (exact fit)"})
    fig = figure_json(charts.cache_memory_figure(steps_table(), [A, B], ref))
    line = next(t for t in fig["data"] if t["name"] == "full cache (exact fit)" and t["meta"] == "reference")
    np.testing.assert_allclose(line["y"], [4, 5, 6])
    assert line["line"]["color"] == charts.REFERENCE_COLOR


def test_memory_figure_without_steps_says_so():
    fig = figure_json(charts.cache_memory_figure(steps_table().iloc[0:0], [A]))
    assert fig["data"] == []
    assert "no steps recorded" in fig["layout"]["annotations"][0]["text"]


def layers_table():
    rows = []
    for s, per_layer in ((A, 1000), (B, 100)):
        for step in (0, 1):
            for layer in (0, 1, 2):
                rows.append(
                    {
                        "strategy": s,
                        "step": step,
                        "layer": layer,
                        "kind": "X",
                        "offset": 4 + step,
                        "tokens_held": 4 + step,
                        "capacity": 8,
                        "bytes_used": per_layer * (layer + 1) * (step + 1),
                        "bytes_allocated": 2048 * (layer + 1) if s == A else 1024,
                    }
                )
    return table("layers", rows)


def test_layer_heatmap_is_layer_by_step_on_one_scale_for_all_strategies():
    fig = figure_json(charts.layer_heatmap_figure(layers_table(), B, "bytes_allocated"))
    heat = fig["data"][0]
    assert heat["type"] == "heatmap"
    z = np.asarray(heat["z"], dtype=float)
    assert z.shape == (3, 2)  # layers x steps
    np.testing.assert_allclose(z, 1.0)  # 1024 B = 1 KiB everywhere
    assert list(heat["y"]) == [0, 1, 2] and list(heat["x"]) == [0, 1]
    assert heat["zmax"] == pytest.approx(6.0)  # the largest cell of any strategy (A, layer 2): 6 KiB
    used_fig = figure_json(charts.layer_heatmap_figure(layers_table(), A, "bytes_used"))
    used = np.asarray(used_fig["data"][0]["z"], dtype=float)
    np.testing.assert_allclose(used[:, 1] * charts.KIB, [2000, 4000, 6000])  # layer-major, step 1


def test_layer_heatmap_refuses_an_unknown_value_and_says_when_nothing_was_recorded():
    with pytest.raises(ValueError, match="value must be one of"):
        charts.layer_heatmap_figure(layers_table(), A, "bytes")
    empty = figure_json(charts.layer_heatmap_figure(layers_table(), C))
    assert "memory probe was off" in empty["layout"]["annotations"][0]["text"]


def test_quality_figure_leaves_out_the_baseline_and_accumulates_agreement():
    fig = figure_json(charts.quality_figure(steps_table(), [A, B]))
    assert {t["name"] for t in fig["data"]} == {B}
    kl, agree = fig["data"]
    np.testing.assert_allclose(kl["y"], [0.1, 0.2, 0.0])
    np.testing.assert_allclose(agree["y"], [100, 50, 200 / 3])  # running share of agreeing steps, %
    assert (kl["yaxis"], agree["yaxis"]) == ("y", "y2")


def test_quality_figure_with_only_the_baseline_says_there_is_nothing_to_compare():
    fig = figure_json(charts.quality_figure(steps_table(), [A, B], baselines=[A, B]))
    assert "nothing to compare" in fig["layout"]["annotations"][0]["text"]


def test_speed_figure_plots_decode_steps_and_process_memory_once_per_step():
    fig = figure_json(charts.speed_figure(steps_table(), [A, B]))
    by_name = {t["name"]: t for t in fig["data"]}
    assert list(by_name[A]["x"]) == [1, 2]  # the prefill's prompt tokens/s would dwarf the decode
    np.testing.assert_allclose(by_name[B]["y"], [61, 62])
    np.testing.assert_allclose(by_name["process RSS"]["y"], [500, 501, 502])
    np.testing.assert_allclose(by_name["device active memory"]["y"], [901, 901, 901])  # max over strategies


def test_speed_figure_without_timings_says_the_probe_was_off():
    steps = steps_table().assign(tokens_per_second=np.nan, rss_bytes=None, device_active_bytes=None)
    fig = figure_json(charts.speed_figure(steps, [A, B]))
    assert "system probe was off" in fig["layout"]["annotations"][0]["text"]


def error_layers():
    rows = []
    for step in (0, 4):
        for layer in (0, 1):
            rows.append(
                {
                    "strategy": C,
                    "step": step,
                    "layer": layer,
                    "kind": "q",
                    "offset": 3,
                    "tokens_held": 3,
                    "capacity": 64,
                    "key_rel_rms": 0.1 * (layer + 1) + step / 100,
                    "value_rel_rms": 0.05 * (layer + 1),
                }
            )
    rows.append({"strategy": A, "step": 0, "layer": 0, "kind": "kv", "offset": 3, "tokens_held": 3, "capacity": 64})
    return table("layers", rows)


def test_quant_error_heatmap_is_layer_by_step():
    fig = figure_json(charts.quant_error_heatmap(error_layers(), C, "key_rel_rms"))
    z = np.asarray(fig["data"][0]["z"], dtype=float)
    np.testing.assert_allclose(z, [[0.1, 0.14], [0.2, 0.24]])
    unquantized = figure_json(charts.quant_error_heatmap(error_layers(), A))
    assert "no quantization error recorded" in unquantized["layout"]["annotations"][0]["text"]
    with pytest.raises(ValueError, match="column must be one of"):
        charts.quant_error_heatmap(error_layers(), C, "rms")


def test_quant_error_bars_show_the_nearest_recorded_step_at_or_before():
    fig = figure_json(charts.quant_error_bars(error_layers(), [A, C], C, 3))
    keys, values = fig["data"]
    np.testing.assert_allclose(keys["y"], [0.1, 0.2])  # step 0: the error probe is sampled
    np.testing.assert_allclose(values["y"], [0.05, 0.1])
    assert "step 0 (nearest recorded step to 3)" in fig["layout"]["title"]["text"]
    assert fig["layout"]["title"]["text"].startswith(f"{C}<br>")  # two lines: nothing cut off at half width
    at4 = figure_json(charts.quant_error_bars(error_layers(), [A, C], C, 4))
    np.testing.assert_allclose(at4["data"][0]["y"], [0.14, 0.24])
    assert keys["marker"]["color"] == figures.strategy_colors([A, C])[C]


def test_sampled_speed_lines_keep_only_the_timed_steps():
    steps = sampled_steps_table().assign(tokens_per_second=lambda f: f["step"].where(f["step"] % 2 == 0) * 1.0)
    steps.loc[steps["strategy"] == B, "tokens_per_second"] *= 2  # each strategy timed on its own
    info = figure_data.speed_info(steps, [A, B])
    assert [s.step.tolist() for s in info.series] == [[2, 4, 6, 8]] * 2  # decode steps the probe timed


def test_strategies_of_one_batch_share_one_speed_line():
    steps = sampled_steps_table().assign(tokens_per_second=lambda f: f["step"].where(f["step"] % 2 == 0) * 1.0)
    info = figure_data.speed_info(steps, [A, B])  # the same tokens/s at every step: one forward for both
    assert [s.strategy for s in info.series] == [f"one batch of 2: {A}, {B}"]


def test_the_sampling_caption_names_the_charted_probes_that_were_sampled():
    from app import panels
    from app.data import RunView

    def view(probes: dict) -> RunView:
        return RunView("run", {"probes": json.dumps(probes)}, [A], [A], "complete", "", {})

    note = panels.sampling_note(view({"memory": 4, "quality": 1, "system": 1, "masks": 128}))
    assert note.startswith("Sampled probes in this run: memory every 4 steps (and the last step).")
    assert "masks" not in note  # the Inspector says its own sampling
    assert panels.sampling_note(view({"memory": 1, "quality": 1, "system": 1, "masks": 16})) == ""
