"""The Inspector's figures (:mod:`app.inspector_charts`) on small hand-made tables: slots, the
attention mask's states in slot and temporal order, and what a cache held over a block of steps."""

from __future__ import annotations

import numpy as np
import pytest
from app_helpers import figure_json

from app import inspector_charts as ic
from cachelib.introspect import ring_slot_positions
from cachelib.profile import Profile

A, B, C = "standard", "rotating:max_size=6,keep=2", "quantized:bits=4"


def table(name: str, rows: list[dict]):
    """Rows typed exactly as a loaded profile types them."""
    p = Profile()
    p.add(name, rows)
    return p.frame(name)


def ring_tables():
    positions = ring_slot_positions(offset=9, write_index=3, keep=2, capacity=6)  # [0 1 8 5 6 7]
    text = " ".join(map(str, positions))
    slots = table("slots", [{"strategy": B, "step": 5, "layer": 0, "write_index": 3, "keep": 2, "positions": text}])
    layers = table(
        "layers",
        [
            {
                "strategy": B,
                "step": 5,
                "layer": 0,
                "kind": "ring",
                "offset": 9,
                "tokens_held": 6,
                "capacity": 6,
                "write_index": 3,
                "keep": 2,
                "evicted": 3,
            },
            {
                "strategy": A,
                "step": 5,
                "layer": 0,
                "kind": "linear",
                "offset": 9,
                "tokens_held": 9,
                "capacity": 12,
                "write_index": 9,
                "keep": 0,
                "evicted": 0,
            },
        ],
    )
    return slots, layers


def test_ring_figure_colours_slots_by_position_and_marks_pointer_and_keep():
    slots, layers = ring_tables()
    fig = figure_json(ic.ring_figure(slots, layers, B, 5, 0))
    heat, keep, pointer = fig["data"]
    np.testing.assert_allclose(np.asarray(heat["z"], dtype=float).ravel(), [0, 1, 8, 5, 6, 7])
    assert list(keep["x"]) == [0, 1]  # the two sink slots
    assert pointer["x"] == [3] and "slot 3" in pointer["name"]
    assert "evicted 3" in fig["layout"]["title"]["text"]
    # The legend sits above the plot area (clear of the axis titles below and the colour bar).
    assert fig["layout"]["legend"]["y"] > 1 and fig["layout"]["legend"]["yanchor"] == "bottom"


def test_ring_figure_labels_empty_slots_empty_and_keeps_a_one_row_colour_bar_readable():
    layers = table(
        "layers",
        [
            {
                "strategy": B,
                "step": 0,
                "layer": 0,
                "kind": "ring",
                "offset": 3,
                "tokens_held": 3,
                "capacity": 6,
                "write_index": 3,
                "keep": 2,
                "evicted": 0,
            }
        ],
    )
    slots = table(
        "slots", [{"strategy": B, "step": 0, "layer": 0, "write_index": 3, "keep": 2, "positions": "0 1 2 -1 -1 -1"}]
    )
    fig = figure_json(ic.ring_figure(slots, layers, B, 0, 0))
    heat = fig["data"][0]
    assert np.asarray(heat["text"]).tolist() == [["0", "1", "2", "empty", "empty", "empty"]]
    hover = [c[1] for c in np.asarray(heat["customdata"]).tolist()[0]]
    assert hover == ["0", "1", "2", "empty", "empty", "empty"]
    assert "empty slot" in {t["name"] for t in fig["data"][1:]}
    assert fig["layout"]["height"] >= 330  # one row of slots: the plot area stays tall enough to read the scale


def test_ring_figure_draws_an_append_only_cache_from_its_layers_row():
    slots, layers = ring_tables()
    info = ic._ring_info(slots, layers, A, 5, 0)
    assert info.layout == "linear"
    assert info.positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, -1, -1, -1]
    fig = figure_json(ic.ring_figure(slots, layers, A, 5, 0))
    z = np.asarray(fig["data"][0]["z"], dtype=float).ravel()
    assert np.isnan(z[9:]).all()  # empty slots stay uncoloured
    assert "nothing recorded" in figure_json(ic.ring_figure(slots, layers, C, 5, 0))["layout"]["annotations"][0]["text"]


def masks_table():
    # A ring of 4 slots that has wrapped once: slot order [0 1 4 3] (keep=2), one query at position 4,
    # and a prefill-like step with an empty slot.
    return table(
        "masks",
        [
            {
                "strategy": B,
                "step": 4,
                "layer": 1,
                "query": 0,
                "query_position": 4,
                "mask": "1101",
                "key_positions": "0 1 4 3",
            },
            {
                "strategy": B,
                "step": 0,
                "layer": 1,
                "query": 0,
                "query_position": 0,
                "mask": "1000",
                "key_positions": "0 1 2 -1",
            },
            {
                "strategy": B,
                "step": 0,
                "layer": 1,
                "query": 1,
                "query_position": 1,
                "mask": "1100",
                "key_positions": "0 1 2 -1",
            },
        ],
    )


def test_mask_figure_in_slot_order_keeps_the_cache_order():
    fig = figure_json(ic.mask_figure(masks_table(), B, 4, 1, "slot"))
    heat = fig["data"][0]
    assert list(heat["x"]) == [0, 1, 2, 3]
    assert np.asarray(heat["z"]).tolist() == [[ic.VISIBLE, ic.VISIBLE, ic.HIDDEN, ic.VISIBLE]]
    prefill = ic._mask_info(masks_table(), B, 0, 1, "slot")
    assert prefill.state.tolist() == [
        [ic.VISIBLE, ic.CAUSAL, ic.CAUSAL, ic.EMPTY],
        [ic.VISIBLE, ic.VISIBLE, ic.CAUSAL, ic.EMPTY],
    ]
    # The legend names the states drawn (a heatmap has no legend of its own).
    assert {t["name"] for t in fig["data"][1:]} == {"visible", "held, masked"}
    assert fig["layout"]["legend"]["x"] >= 1


def test_mask_figure_in_temporal_order_lays_out_every_position_and_drops_empty_slots():
    info = ic._mask_info(masks_table(), B, 4, 1, "temporal")
    assert info.key_positions.tolist() == [0, 1, 2, 3, 4]  # every position up to the query's
    assert info.key_slots.tolist() == [0, 1, -1, 3, 2]  # position 2 is held by no slot
    V, H, E = ic.VISIBLE, ic.HIDDEN, ic.EVICTED
    assert info.state.tolist() == [[V, V, E, V, H]]
    prefill = ic._mask_info(masks_table(), B, 0, 1, "temporal")
    assert prefill.key_positions.tolist() == [0, 1, 2]  # the empty slot holds no position
    assert prefill.visible.astype(int).tolist() == [[1, 0, 0], [1, 1, 0]]
    assert prefill.query_positions.tolist() == [0, 1]


def ring_past_its_size_masks():
    """One decode query of ``rotating:max_size=8,keep=2`` at position 20: the ring holds the sinks
    0, 1 and the newest six, 15..20, in slot order [0 1 | 17 18 19 20 15 16]."""
    keys = [0, 1, 17, 18, 19, 20, 15, 16]
    return table(
        "masks",
        [
            {
                "strategy": B,
                "step": 12,
                "layer": 0,
                "query": 0,
                "query_position": 20,
                "mask": "1" * 8,
                "key_positions": " ".join(map(str, keys)),
            }
        ],
    )


def test_temporal_mask_of_a_ring_past_its_size_shows_evicted_positions_as_evicted():
    info = ic._mask_info(ring_past_its_size_masks(), B, 12, 0, "temporal")
    row = info.state[0]
    assert np.flatnonzero(row == ic.VISIBLE).tolist() == [0, 1, *range(15, 21)]
    assert np.flatnonzero(row == ic.EVICTED).tolist() == list(range(2, 15))  # never painted visible
    assert info.count(ic.EVICTED) == 13 and info.count(ic.VISIBLE) == 8
    fig = figure_json(ic.mask_figure(ring_past_its_size_masks(), B, 12, 0, "temporal"))
    heat = fig["data"][0]
    assert list(heat["x"]) == list(range(21))  # one column per position: no gap drawn as one wide cell
    assert {t["name"] for t in fig["data"][1:]} == {"visible", "evicted"}
    assert "13 earlier positions evicted" in fig["layout"]["title"]["text"]


def test_slot_and_temporal_masks_name_the_same_slot_and_position_on_hover():
    masks = ring_past_its_size_masks()
    slot = figure_json(ic.mask_figure(masks, B, 12, 0, "slot"))["data"][0]
    temporal = figure_json(ic.mask_figure(masks, B, 12, 0, "temporal"))["data"][0]
    assert slot["hovertemplate"] == temporal["hovertemplate"]
    slot_cells = np.asarray(slot["customdata"]).tolist()[0]
    temporal_cells = np.asarray(temporal["customdata"]).tolist()[0]
    by_slot = {tuple(c[:2]) for c in slot_cells}
    by_position = {tuple(c[:2]) for c in temporal_cells if c[0] != ic.NOT_HELD}
    assert (
        by_slot
        == by_position
        == {("2", "17"), ("6", "15"), ("0", "0"), ("1", "1"), ("3", "18"), ("4", "19"), ("5", "20"), ("7", "16")}
    )
    assert temporal_cells[5] == [ic.NOT_HELD, "5", "evicted"]


def test_mask_figure_refuses_an_unknown_order_and_says_when_no_mask_was_recorded():
    with pytest.raises(ValueError, match="order must be"):
        ic.mask_figure(masks_table(), B, 4, 1, "time")
    fig = figure_json(ic.mask_figure(masks_table(), B, 3, 1))
    assert "no mask recorded" in fig["layout"]["annotations"][0]["text"]


def ring_run_tables(capacity: int = 6, keep: int = 2, prompt: int = 3, last: int = 12):
    """What ``rotating:max_size=6,keep=2`` records over decode steps 1..last: a steps table, its
    slot table (slot -> position, from the library's own ring layout) and one mask at step 8."""
    steps, slots = [], []
    for step in range(last + 1):
        offset = prompt + step
        steps.append(
            {"strategy": B, "step": step, "phase": "prefill" if step == 0 else "decode", "position": offset - 1}
        )
        write = min(offset, capacity) if offset <= capacity else keep + (offset - keep) % (capacity - keep)
        positions = ring_slot_positions(offset=offset, write_index=write, keep=keep, capacity=capacity)
        slots.append(
            {
                "strategy": B,
                "step": step,
                "layer": 0,
                "write_index": write,
                "keep": keep,
                "positions": " ".join(map(str, positions)),
            }
        )
    held = [int(p) for p in slots[8]["positions"].split()]
    mask = "".join("0" if p == 10 else "1" for p in held)  # as if the mask hid position 10 at step 8
    masks = [
        {
            "strategy": B,
            "step": 8,
            "layer": 0,
            "query": 0,
            "query_position": 10,
            "mask": mask,
            "key_positions": slots[8]["positions"],
        }
    ]
    return table("steps", steps), table("slots", slots), table("masks", masks)


def test_mask_over_the_run_shows_a_rings_sliding_window_and_its_sink_columns():
    steps, slots, masks = ring_run_tables()
    layers = table("layers", [])
    info = ic._mask_run_info(steps, layers, slots, masks, B, 0, 12)
    assert info.source == "slots" and info.steps.tolist() == list(range(1, 13))  # decode steps only
    assert info.query_positions.tolist() == list(range(3, 15))
    V, C, E = ic.VISIBLE, ic.CAUSAL, ic.EVICTED
    for row, q in zip(info.state, info.query_positions):
        visible = np.flatnonzero(row == V).tolist()
        if info.steps[list(info.query_positions).index(q)] == 8:
            continue
        newest = list(range(max(2, q - 3), q + 1))  # the window slides one position per step
        assert visible == sorted({0, 1, *newest}), (q, visible)  # the sinks stay visible: columns 0, 1
        assert (row[q + 1 :] == C).all()
        assert np.flatnonzero(row == E).tolist() == list(range(2, max(2, q - 3)))
    at8 = info.state[info.steps.tolist().index(8)]
    assert at8[10] == ic.HIDDEN and 8 in info.masked_steps  # the recorded mask is used where it exists
    short = ic._mask_run_info(steps, layers, slots, masks, B, 0, 12, span=4)
    assert short.steps.tolist() == [9, 10, 11, 12]  # the block ends at the chosen step
    fig = figure_json(ic.mask_run_figure(steps, layers, slots, masks, B, 0, 12))
    assert {t["name"] for t in fig["data"][1:]} == {"visible", "evicted", "masked by causality", "held, masked"}


def test_mask_over_the_run_of_an_append_only_cache_comes_from_its_layers_rows():
    steps = table(
        "steps",
        [{"strategy": A, "step": t, "phase": "decode" if t else "prefill", "position": 2 + t} for t in range(0, 9, 2)],
    )
    layers = table(
        "layers",
        [
            {"strategy": A, "step": t, "layer": 0, "kind": "kv", "offset": 3 + t, "tokens_held": 3 + t, "capacity": 256}
            for t in range(0, 9, 2)
        ],
    )
    info = ic._mask_run_info(steps, layers, table("slots", []), table("masks", []), A, 0, 8)
    assert info.source == "layers" and info.steps.tolist() == [2, 4, 6, 8] and info.every == 2
    assert not (info.state == ic.EVICTED).any()
    assert [int((r == ic.VISIBLE).sum()) for r in info.state] == [5, 7, 9, 11]
    empty = figure_json(ic.mask_run_figure(steps, layers, table("slots", []), table("masks", []), C, 0, 8))
    assert "no slot table or per-layer rows" in empty["layout"]["annotations"][0]["text"]


def test_a_very_large_mask_keeps_its_states_and_drops_only_the_per_cell_hover_words():
    state = np.zeros((100, ic.HOVER_CELLS // 100 + 1), dtype=np.int8)
    words = np.full(state.shape, "", dtype=object)
    heat = ic._state_heatmap(state, np.arange(state.shape[1]), np.arange(100), words, words)
    assert heat.customdata is None and "key %{x}" in heat.hovertemplate
    assert np.asarray(heat.z).shape == state.shape
    small = ic._state_heatmap(state[:2, :3], np.arange(3), np.arange(2), words[:2, :3], words[:2, :3])
    assert np.asarray(small.customdata).shape == (2, 3, 3)
