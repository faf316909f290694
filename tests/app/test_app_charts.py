"""The app's figure builders on small hand-made tables: what each figure draws, read from its data."""

from __future__ import annotations

import numpy as np
import pytest

from app import charts, figures
from app_helpers import figure_json
from cachelib.introspect import ring_slot_positions
from cachelib.profile import Profile

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
            {**common, "strategy": A, "cache_bytes_used": (i + 1) * MIB, "cache_bytes_allocated": 4 * MIB,
             "kl": 0.0, "top1_agree": True, "tokens_per_second": 50.0 + step, "device_active_bytes": 900 * MIB}
        )  # fmt: skip
        rows.append(
            {**common, "strategy": B, "cache_bytes_used": MIB, "cache_bytes_allocated": MIB,
             "kl": [0.1, 0.2, 0.0][i], "top1_agree": [True, False, True][i], "tokens_per_second": 60.0 + step,
             "device_active_bytes": 901 * MIB}
        )  # fmt: skip
    return table("steps", rows)


def test_strategy_colors_follow_run_order_and_are_distinct():
    colors = figures.strategy_colors([A, B, C])
    assert list(colors) == [A, B, C]
    assert len(set(colors.values())) == 3
    assert colors[A] == figures.PALETTE[0]  # the baseline always gets the first colour
    many = figures.strategy_colors([f"s{i}" for i in range(len(figures.PALETTE) + 1)])
    assert many[f"s{len(figures.PALETTE)}"] == figures.PALETTE[0]  # cycles past the palette



def test_empty_figure_says_why_there_is_nothing_to_draw():
    fig = figure_json(figures.empty_figure("Slots", "nothing recorded", height=300))
    assert fig["layout"]["annotations"][0]["text"] == "nothing recorded" and fig["layout"]["height"] == 300
    assert fig["layout"]["xaxis"]["visible"] is False and not fig["data"]


def test_memory_figure_draws_used_and_allocated_per_strategy_in_mib():
    fig = figure_json(charts.cache_memory_figure(steps_table(), [A, B]))
    by_name = {t["name"]: t for t in fig["data"]}
    assert set(by_name) == {f"{A} · used", f"{A} · allocated", f"{B} · used", f"{B} · allocated"}
    np.testing.assert_allclose(by_name[f"{A} · used"]["y"], [1, 2, 3])
    np.testing.assert_allclose(by_name[f"{A} · allocated"]["y"], [4, 4, 4])
    np.testing.assert_allclose(by_name[f"{B} · used"]["customdata"], [MIB] * 3)  # exact bytes on hover
    colors = figures.strategy_colors([A, B])
    assert by_name[f"{B} · used"]["line"]["color"] == by_name[f"{B} · allocated"]["line"]["color"] == colors[B]
    assert by_name[f"{B} · allocated"]["line"]["dash"] == "dash"


def test_memory_figure_draws_the_full_cache_reference():
    import pandas as pd

    ref = pd.DataFrame({"step": [0, 1, 2], "bytes": [4 * MIB, 5 * MIB, 6 * MIB], "label": "full cache (exact fit)"})
    fig = figure_json(charts.cache_memory_figure(steps_table(), [A, B], ref))
    line = next(t for t in fig["data"] if t["name"] == "full cache (exact fit)")
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
                    {"strategy": s, "step": step, "layer": layer, "kind": "X", "offset": 4 + step,
                     "tokens_held": 4 + step, "capacity": 8, "bytes_used": per_layer * (layer + 1) * (step + 1),
                     "bytes_allocated": 2048 * (layer + 1) if s == A else 1024}
                )  # fmt: skip
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


def ring_tables():
    positions = ring_slot_positions(offset=9, write_index=3, keep=2, capacity=6)  # [0 1 8 5 6 7]
    text = " ".join(map(str, positions))
    slots = table("slots", [{"strategy": B, "step": 5, "layer": 0, "write_index": 3, "keep": 2, "positions": text}])
    layers = table(
        "layers",
        [
            {"strategy": B, "step": 5, "layer": 0, "kind": "ring", "offset": 9, "tokens_held": 6, "capacity": 6,
             "write_index": 3, "keep": 2, "evicted": 3},
            {"strategy": A, "step": 5, "layer": 0, "kind": "linear", "offset": 9, "tokens_held": 9, "capacity": 12,
             "write_index": 9, "keep": 0, "evicted": 0},
        ],
    )  # fmt: skip
    return slots, layers


def test_ring_figure_colours_slots_by_position_and_marks_pointer_and_keep():
    slots, layers = ring_tables()
    fig = figure_json(charts.ring_figure(slots, layers, B, 5, 0))
    heat, keep, pointer = fig["data"]
    np.testing.assert_allclose(np.asarray(heat["z"], dtype=float).ravel(), [0, 1, 8, 5, 6, 7])
    assert list(keep["x"]) == [0, 1]  # the two sink slots
    assert pointer["x"] == [3] and "slot 3" in pointer["name"]
    assert "evicted 3" in fig["layout"]["title"]["text"]


def test_ring_figure_draws_an_append_only_cache_from_its_layers_row():
    slots, layers = ring_tables()
    info = charts._ring_info(slots, layers, A, 5, 0)
    assert info.layout == "linear"
    assert info.positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, -1, -1, -1]
    fig = figure_json(charts.ring_figure(slots, layers, A, 5, 0))
    z = np.asarray(fig["data"][0]["z"], dtype=float).ravel()
    assert np.isnan(z[9:]).all()  # empty slots stay uncoloured
    assert "nothing recorded" in figure_json(charts.ring_figure(slots, layers, C, 5, 0))["layout"]["annotations"][0]["text"]


def masks_table():
    # A ring of 4 slots that has wrapped once: slot order [0 1 4 3] (keep=2), one query at position 4,
    # and a prefill-like step with an empty slot.
    return table(
        "masks",
        [
            {"strategy": B, "step": 4, "layer": 1, "query": 0, "query_position": 4, "mask": "1101",
             "key_positions": "0 1 4 3"},
            {"strategy": B, "step": 0, "layer": 1, "query": 0, "query_position": 0, "mask": "1000",
             "key_positions": "0 1 2 -1"},
            {"strategy": B, "step": 0, "layer": 1, "query": 1, "query_position": 1, "mask": "1100",
             "key_positions": "0 1 2 -1"},
        ],
    )  # fmt: skip


def test_mask_figure_in_slot_order_keeps_the_cache_order():
    fig = figure_json(charts.mask_figure(masks_table(), [A, B], B, 4, 1, "slot"))
    heat = fig["data"][0]
    assert list(heat["x"]) == [0, 1, 2, 3]
    assert np.asarray(heat["z"]).tolist() == [[1, 1, 0, 1]]
    assert heat["colorscale"][1][1] == figures.strategy_colors([A, B])[B]


def test_mask_figure_in_temporal_order_sorts_keys_by_position_and_drops_empty_slots():
    info = charts._mask_info(masks_table(), [A, B], B, 4, 1, "temporal")
    assert info.key_positions.tolist() == [0, 1, 3, 4]
    assert info.key_slots.tolist() == [0, 1, 3, 2]
    assert info.visible.astype(int).tolist() == [[1, 1, 1, 0]]
    prefill = charts._mask_info(masks_table(), [A, B], B, 0, 1, "temporal")
    assert prefill.key_positions.tolist() == [0, 1, 2]  # the empty slot holds no position
    assert prefill.visible.astype(int).tolist() == [[1, 0, 0], [1, 1, 0]]
    assert prefill.query_positions.tolist() == [0, 1]


def test_mask_figure_refuses_an_unknown_order_and_says_when_no_mask_was_recorded():
    with pytest.raises(ValueError, match="order must be"):
        charts.mask_figure(masks_table(), [A, B], B, 4, 1, "time")
    fig = figure_json(charts.mask_figure(masks_table(), [A, B], B, 3, 1))
    assert "no mask recorded" in fig["layout"]["annotations"][0]["text"]


def error_layers():
    rows = []
    for step in (0, 4):
        for layer in (0, 1):
            rows.append(
                {"strategy": C, "step": step, "layer": layer, "kind": "q", "offset": 3, "tokens_held": 3, "capacity": 64,
                 "key_rel_rms": 0.1 * (layer + 1) + step / 100, "value_rel_rms": 0.05 * (layer + 1)}
            )  # fmt: skip
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
    at4 = figure_json(charts.quant_error_bars(error_layers(), [A, C], C, 4))
    np.testing.assert_allclose(at4["data"][0]["y"], [0.14, 0.24])
    assert keys["marker"]["color"] == figures.strategy_colors([A, C])[C]
