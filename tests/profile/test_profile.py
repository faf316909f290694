"""The profiler records what every cache does, per layer and per step; profiles round-trip."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from cachelib.decode import Runner
from cachelib.profile import Probes, list_profiles, load_profile, read_meta, run_profile, save_profile, summarize
from cachelib.profile.guard import MemoryGuard
from cachelib.profile.store import ENDED_WITHOUT_CLOSING, ProfileWriter

FOUR = ["standard", "rotating:max_size=64,keep=4", "quantized:bits=8", "quantized:bits=4"]
PROMPT = "Explain what a KV cache is, and why it matters for serving language models."


def _held_nbytes(cache) -> int:
    """Bytes of the arrays a whole-model cache holds, read from the arrays themselves."""
    if isinstance(cache, list):  # MLX: a list of layer caches with mlx-lm's nbytes
        return sum(c.nbytes for c in cache)
    total = 0
    for layer in cache.layers:  # torch: every tensor attribute of every layer
        for value in vars(layer).values():
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if hasattr(t, "element_size") and hasattr(t, "numel"):
                    total += t.numel() * t.element_size()
    return total


@pytest.fixture(scope="module", params=["mlx", "torch"])
def four_way(request, smollm2_mlx, smollm2_torch):
    loaded = smollm2_mlx if request.param == "mlx" else smollm2_torch
    held = []

    def check_bytes(event):
        for label, cache in event.caches.items():
            held.append((label, event.step, _held_nbytes(cache)))

    profile = run_profile(
        loaded,
        FOUR,
        prompt=PROMPT,
        max_tokens=256,
        probes=Probes(masks=64),
        on_step=check_bytes,
    )
    return profile, held


@pytest.mark.bundled
@pytest.mark.slow
def test_baseline_has_zero_kl_and_full_agreement(four_way):
    profile, _ = four_way
    steps = profile.frame("steps")
    base = steps[steps["strategy"] == "standard"]
    assert len(base) == 256 and profile.complete
    assert (base["kl"] == 0).all() and base["top1_agree"].all()


@pytest.mark.bundled
@pytest.mark.slow
def test_rotating_never_holds_more_than_capacity_and_slot_map_follows_write_index(four_way):
    profile, _ = four_way
    layers = profile.frame("layers")
    rot = layers[layers["strategy"] == "rotating:max_size=64,keep=4"]
    assert (rot["tokens_held"] <= rot["capacity"]).all()
    decode = rot[rot["step"] > 0]
    assert (decode["tokens_held"] <= 64).all()
    assert rot["evicted"].max() > 0
    slots = profile.frame("slots")
    rot_slots = slots[slots["strategy"] == "rotating:max_size=64,keep=4"]
    assert len(rot_slots) > 0
    for _, row in rot_slots.iterrows():
        positions = np.array([int(x) for x in row["positions"].split()])
        layer = rot[(rot["step"] == row["step"]) & (rot["layer"] == row["layer"])].iloc[0]
        # The newest token sits just before the write index; the keep slots hold 0..keep-1.
        assert positions[(row["write_index"] - 1) % len(positions)] == layer["offset"] - 1
        if layer["offset"] > len(positions):
            assert positions[:4].tolist() == [0, 1, 2, 3]
            assert sorted(positions.tolist()) == sorted(set(positions.tolist()))


@pytest.mark.bundled
@pytest.mark.slow
def test_quantization_error_is_recorded_and_grows_with_fewer_bits(four_way):
    profile, _ = four_way
    layers = profile.frame("layers")
    err = {b: layers[layers["strategy"] == f"quantized:bits={b}"]["key_rel_rms"] for b in (8, 4)}
    assert err[8].notna().all() and (err[8] > 0).all()
    assert err[4].mean() > err[8].mean()
    assert layers[layers["strategy"] == "standard"]["key_rel_rms"].isna().all()


@pytest.mark.bundled
@pytest.mark.slow
def test_bytes_allocated_equal_the_bytes_of_the_held_arrays_at_every_step(four_way):
    profile, held = four_way
    steps = profile.frame("steps").set_index(["strategy", "step"])
    assert len(held) == 4 * 256
    for label, step, nbytes in held:
        assert steps.loc[(label, step), "cache_bytes_allocated"] == nbytes, (label, step)


@pytest.mark.bundled
@pytest.mark.slow
def test_csv_round_trips_unchanged(four_way, tmp_path):
    profile, _ = four_way
    path = save_profile(profile, tmp_path / "p.csv")
    again = load_profile(path)
    assert again == profile
    for table in ("steps", "layers", "slots", "masks"):
        pd.testing.assert_frame_equal(again.frame(table), profile.frame(table), check_dtype=False)


# --- fast tests on a tiny preset --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(load_model):
    return load_model("tiny-llama", "mlx")


def test_profile_streams_to_csv_and_loads_back(tiny, tmp_path):
    out = tmp_path / "run.csv"
    profile = run_profile(
        tiny, ["standard", "rotating:max_size=16,keep=2"], prompt="hello there", max_tokens=24, out=out
    )
    assert out.exists() and not (tmp_path / ".run.csv.partial").exists()
    back = load_profile(out)
    assert back == profile and back.complete
    assert json.loads(back.meta["strategies"]) == ["standard", "rotating:max_size=16,keep=2"]


def test_missing_column_or_wrong_version_is_refused_by_name(tiny, tmp_path):
    path = tmp_path / "run.csv"
    run_profile(tiny, ["standard"], prompt="hi", max_tokens=3, out=path)
    frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    frame.drop(columns=["kl"]).to_csv(tmp_path / "nokl.csv", index=False)
    with pytest.raises(ValueError, match="missing column.*kl"):
        load_profile(tmp_path / "nokl.csv")
    frame.loc[(frame["table"] == "meta") & (frame["key"] == "schema_version"), "value"] = "99"
    frame.to_csv(tmp_path / "v99.csv", index=False)
    with pytest.raises(ValueError, match="schema version 99 is not supported"):
        load_profile(tmp_path / "v99.csv")
    (tmp_path / "junk.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not a cachelib profile"):
        load_profile(tmp_path / "junk.csv")


def test_read_meta_reads_what_load_profile_reads_and_refuses_what_it_refuses(tiny, tmp_path):
    path = tmp_path / "run.csv"
    run_profile(tiny, ["standard"], prompt="hi", max_tokens=3, out=path)
    assert read_meta(path) == {k: str(v) for k, v in load_profile(path).meta.items()}
    frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    frame.loc[(frame["table"] == "meta") & (frame["key"] == "schema_version"), "value"] = "99"
    frame.to_csv(tmp_path / "v99.csv", index=False)
    with pytest.raises(ValueError, match="v99.csv: profile schema version 99 is not supported"):
        read_meta(tmp_path / "v99.csv")
    # A file a crashed run left behind still says "running": both readers call it incomplete.
    writer = ProfileWriter(tmp_path / "crashed.csv")
    writer.write_meta(load_profile(path).meta | {"status": "running", "reason": ""})
    writer.flush()
    writer.partial.rename(tmp_path / "crashed.csv")
    for meta in (read_meta(tmp_path / "crashed.csv"), load_profile(tmp_path / "crashed.csv").meta):
        assert (meta["status"], meta["reason"]) == ("incomplete", ENDED_WITHOUT_CLOSING)
    assert [f.name for f in list_profiles(tmp_path)] == ["crashed.csv", "run.csv", "v99.csv"]


def test_memory_guard_asks_the_predictors_it_is_given_and_counts_only_the_steps_taken():
    class Grows:  # a cache of 100 bytes per token
        def __init__(self, tokens=0):
            self.tokens = tokens

        def copy(self):
            return Grows(self.tokens)

        def update(self, n, phase, keep_layers):
            self.tokens += n
            return type("Step", (), {"bytes_allocated": 100 * self.tokens})

    guard = MemoryGuard(1000, [Grows(), Grows()])
    assert guard.check(3, []) == "" and guard.check(2, []) == ""  # 600, then 1000 bytes
    refusal = "the next step would bring the caches to 1,200 bytes (now 0), over the limit of 1,000 bytes"
    assert refusal in guard.check(1, [])
    assert refusal in guard.check(1, [])  # the refused step was not counted


def test_exception_at_step_k_leaves_rows_before_k_and_incomplete_status(tiny, tmp_path, monkeypatch):
    k = 5
    real_step = Runner.step
    calls = {"n": 0}

    def failing_step(self, cache, ids, extra=None):
        if calls["n"] == k:  # one strategy: the k-th call is step k
            raise RuntimeError("simulated device failure")
        calls["n"] += 1
        return real_step(self, cache, ids, extra)

    monkeypatch.setattr(Runner, "step", failing_step)
    out = tmp_path / "broken.csv"
    with pytest.raises(RuntimeError, match="simulated"):
        run_profile(tiny, ["standard"], prompt="hello", max_tokens=20, out=out)
    back = load_profile(out)
    assert back.status == "incomplete" and "simulated device failure" in back.meta["reason"]
    assert back.frame("steps")["step"].tolist() == list(range(k))


def test_stop_request_keeps_what_was_recorded(tiny):
    stop = {"now": False}
    profile = run_profile(
        tiny,
        ["standard"],
        prompt="hello",
        max_tokens=50,
        should_stop=lambda: stop["now"],
        on_step=lambda event: stop.update(now=event.step >= 6),
    )
    assert profile.status == "incomplete" and "stopped by request" in profile.meta["reason"]
    assert profile.frame("steps")["step"].max() == 6


def test_memory_guard_stops_before_the_caches_pass_the_limit(tiny):
    free = run_profile(
        tiny,
        ["concat"],
        prompt="hello",
        max_tokens=40,
        probes=Probes(memory=1, ring=0, quant_error=0, quality=0, masks=0, system=0),
    )
    allocated = free.frame("steps")["cache_bytes_allocated"].tolist()
    limit = allocated[20] + 1  # room for step 20, not for step 21 (concat grows every step)
    guarded = run_profile(tiny, ["concat"], prompt="hello", max_tokens=40, memory_limit=limit)
    steps = guarded.frame("steps")
    assert guarded.status == "incomplete" and "memory guard" in guarded.meta["reason"]
    assert steps["step"].max() == 20
    assert steps["cache_bytes_allocated"].max() <= limit


def test_free_running_records_where_each_strategy_departs(tiny):
    profile = run_profile(
        tiny, ["standard", "rotating:max_size=8,keep=0"], prompt="tell me a story", max_tokens=40, free_running=True
    )
    steps = profile.frame("steps")
    base = steps[steps["strategy"] == "standard"]
    assert not base["departed"].any()
    summary = summarize(profile).set_index("strategy")
    assert pd.isna(summary.loc["standard", "first_departure_step"])
    rot = steps[steps["strategy"] == "rotating:max_size=8,keep=0"]
    differs = [s for s, a, b in zip(base["step"], base["token_id"], rot["token_id"]) if a != b]
    assert differs, "an 8-token window on a 40-step decode should change some token"
    assert summary.loc["rotating:max_size=8,keep=0", "first_departure_step"] == differs[0]
    assert rot[rot["step"] >= differs[0]]["departed"].all() and not rot[rot["step"] < differs[0]]["departed"].any()


def test_evaluation_text_is_teacher_forced_for_every_strategy(tiny):
    text = "The quick brown fox jumps over the lazy dog. " * 8
    profile = run_profile(tiny, ["standard", "quantized:bits=4"], text=text, max_tokens=30, prompt_tokens=10)
    steps = profile.frame("steps")
    assert profile.meta["input"] == "text" and int(profile.meta["prompt_tokens"]) == 10
    assert steps[steps["strategy"] == "standard"]["logprob_target"].notna().all()


def test_probes_switched_off_leave_their_columns_empty(tiny):
    profile = run_profile(
        tiny,
        ["standard", "quantized:bits=4"],
        prompt="hi",
        max_tokens=6,
        probes=Probes(quality=0, quant_error=0, masks=0),
    )
    steps, layers = profile.frame("steps"), profile.frame("layers")
    assert steps["kl"].isna().all() and layers["key_rel_rms"].isna().all()
    assert len(profile.frame("masks")) == 0 and steps["cache_bytes_allocated"].notna().all()


def test_masks_are_recorded_in_slot_order_with_key_positions(tiny):
    profile = run_profile(
        tiny, ["rotating:max_size=8,keep=2"], prompt="one two three four five", max_tokens=20, probes=Probes(masks=1)
    )
    masks = profile.frame("masks")
    decode = masks[masks["step"] == 19]
    assert len(decode) == 4  # one query row per layer
    row = decode.iloc[0]
    assert len(row["mask"]) == len(row["key_positions"].split()) == 8
    prefill = masks[(masks["step"] == 0) & (masks["layer"] == 0)]
    # Causal within the ring's window: query i sees keys max(0, i-7)..i.
    assert [r.count("1") for r in prefill["mask"]] == [min(i + 1, 8) for i in range(len(prefill))]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"strategies": ["lru"]}, "unknown strategy 'lru'"),
        ({"strategies": ["rotating:max_size"]}, "malformed knob"),
        ({"strategies": ["rotating:max_size=8,keep=8"]}, "keep=8 must be < max_size=8"),
        ({"strategies": ["quantized:bits=7"]}, "bits' = 7 is not supported"),
        ({"prompt": "  "}, "prompt is empty"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"memory_limit": "lots"}, "not a size"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_problem(tiny, kwargs, message):
    args = {"strategies": ["standard"], "prompt": "hello", "max_tokens": 4} | kwargs
    with pytest.raises(ValueError, match=message):
        run_profile(tiny, **args)
