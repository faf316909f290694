"""What the pages show besides figures: the full-cache reference, the summary in plain words,
several profiles side by side, the profile folder listing, saving under a name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app import data, profile_folder
from cachelib.profile import Profile, list_profiles, load_profile
from cachelib.profile.figure_data import full_cache_reference

ROOT = Path(__file__).resolve().parents[2]


def profile_with_steps(rows, **meta) -> Profile:
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    p = Profile(
        {
            "schema_version": 1,
            "name": "p",
            "status": "complete",
            "strategies": json.dumps(strategies),
            "baseline": strategies[0],
            "num_layers": 2,
            "num_kv_heads": 3,
            "head_dim": 4,
            "dtype": "float16",
            **meta,
        }
    )
    p.add("steps", rows)
    return p


PER_TOKEN = 2 * 2 * 3 * 4 * 2  # K and V, 2 layers, 3 KV heads, head_dim 4, float16
ROWS = [
    {
        "strategy": "standard",
        "step": 0,
        "phase": "prefill",
        "position": 9,
        "cache_bytes_allocated": 1000,
        "cache_bytes_used": 10 * PER_TOKEN,
        "cache_tokens_held": 10,
        "kl": 0.0,
        "top1_agree": True,
        "tokens_per_second": 100.0,
    },
    {
        "strategy": "standard",
        "step": 1,
        "phase": "decode",
        "position": 10,
        "cache_bytes_allocated": 1000,
        "cache_bytes_used": 11 * PER_TOKEN,
        "cache_tokens_held": 11,
        "kl": 0.0,
        "top1_agree": True,
        "tokens_per_second": 10.0,
    },
    {
        "strategy": "rotating:max_size=4",
        "step": 0,
        "phase": "prefill",
        "position": 9,
        "cache_bytes_allocated": 250,
        "cache_bytes_used": 4 * PER_TOKEN,
        "cache_tokens_held": 4,
        "kl": 0.0,
        "top1_agree": True,
        "tokens_per_second": 100.0,
    },
    {
        "strategy": "rotating:max_size=4",
        "step": 1,
        "phase": "decode",
        "position": 10,
        "cache_bytes_allocated": 250,
        "cache_bytes_used": 4 * PER_TOKEN,
        "cache_tokens_held": 4,
        "kl": 0.02,
        "top1_agree": False,
        "tokens_per_second": 12.0,
    },
]


def test_full_cache_reference_is_two_times_layers_heads_dim_element_size_per_token():
    p = profile_with_steps(ROWS)
    ref = full_cache_reference(p.meta, p.frame("steps"), "standard")
    assert ref["step"].tolist() == [0, 1]
    assert ref["bytes"].tolist() == [10 * PER_TOKEN, 11 * PER_TOKEN]  # positions 9 and 10 -> 10 and 11 tokens
    assert ref["label"].unique().tolist() == ["full cache, float16"]  # the dtype the summary's "saved" names
    assert full_cache_reference({**p.meta, "num_kv_heads": 0}, p.frame("steps"), "standard") is None


def test_summary_table_says_what_each_strategy_saved_in_plain_words():
    table = data.summary_table(profile_with_steps(ROWS))
    assert table["strategy"].tolist() == ["standard", "rotating:max_size=4"]
    assert table.loc[0, "verdict"] == "baseline"
    # Against the float16 full cache's bytes used at the last step (11 tokens), not the allocation.
    assert table.loc[1, "memory_saved"] == pytest.approx(1 - 4 / 11)
    assert table.loc[1, "verdict"] == (
        "saved 64% memory vs a float16 full cache at 11 tokens, for 0.02 nats mean KL (top-1 agreement 0%)"
    )
    assert table.loc[1, "top1_agreement"] == pytest.approx(0.0)  # over decode steps, as the mean KL
    assert table.loc[1, "peak_mib"] == pytest.approx(250 / 2**20)
    assert table["bytes_per_token"].tolist() == [PER_TOKEN, PER_TOKEN]  # bytes used / tokens held
    assert table["tokens_held"].tolist() == [11, 4]


def test_bytes_per_token_is_bytes_used_over_tokens_held_not_allocated_over_held():
    # Standard preallocates 256-token blocks: allocated / held overstates what a token costs.
    rows = [dict(r, cache_bytes_allocated=256 * PER_TOKEN) for r in ROWS if r["strategy"] == "standard"]
    table = data.summary_table(profile_with_steps(rows))
    assert table.loc[0, "bytes_per_token"] == PER_TOKEN
    assert table.loc[0, "peak_mib"] * 2**20 == 256 * PER_TOKEN  # the allocation is shown apart
    assert table.loc[0, "memory_saved"] == pytest.approx(0.0)


def test_the_bundled_float32_model_costs_46080_bytes_per_token():
    from cachelib.profile.summary import full_cache_bytes_per_token

    meta = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "dtype": "float32"}
    assert full_cache_bytes_per_token(meta) == 30 * 3 * 64 * 2 * 4 == 46_080
    assert full_cache_bytes_per_token({**meta, "dtype": "float16"}) == 23_040
    assert full_cache_bytes_per_token({**meta, "dtype": "no-such-dtype"}) is None


def test_committed_example_standard_costs_46080_bytes_per_token_and_every_saving_names_float32():
    profile = load_profile(ROOT / "profiles" / "examples" / "smollm2-mlx-256t.csv", name="smollm2-mlx-256t")
    table = data.summary_table(profile).set_index("strategy")
    assert table.loc["standard", "bytes_per_token"] == 46_080
    assert table.loc["standard", "memory_saved"] == pytest.approx(0.0)
    steps = profile.frame("steps")
    for strategy, row in table.drop(index="standard").iterrows():
        last = steps[(steps["strategy"] == strategy) & steps["cache_bytes_used"].notna()].iloc[-1]
        assert row["memory_saved"] == pytest.approx(1 - last["cache_bytes_used"] / (46_080 * (last["position"] + 1)))
        assert f"vs a float32 full cache at {last['position'] + 1} tokens" in row["verdict"]


def test_sampled_memory_is_read_at_the_last_sample_and_without_geometry_against_the_baseline():
    rows = [dict(r) for r in ROWS]
    for r in rows:
        if r["step"] == 1:  # memory sampled at step 0 only
            r.update(cache_bytes_used=None, cache_tokens_held=None, cache_bytes_allocated=None)
    table = data.summary_table(profile_with_steps(rows))
    assert table["memory_step"].tolist() == [0, 0] and table["tokens"].tolist() == [10, 10]
    assert table.loc[1, "memory_saved"] == pytest.approx(1 - 4 / 10)
    no_geometry = data.summary_table(profile_with_steps(ROWS, num_kv_heads=""))
    assert no_geometry.loc[1, "saved_against"] == "baseline"
    assert no_geometry.loc[1, "verdict"].startswith("saved 64% memory vs the baseline at 11 tokens")
    assert "the baseline's bytes used" in data.measured_on(no_geometry)
    assert "a float16 full cache holding every token" in data.measured_on(data.summary_table(profile_with_steps(ROWS)))


def test_combine_labels_strategies_by_profile_and_keeps_each_baseline():
    a = data.run_view(profile_with_steps(ROWS), "run-a")
    b = data.run_view(profile_with_steps(ROWS, status="incomplete", reason="stopped by request before step 2"), "run-b")
    both = data.combine([a, b])
    assert both.strategies == [
        "run-a / standard",
        "run-a / rotating:max_size=4",
        "run-b / standard",
        "run-b / rotating:max_size=4",
    ]
    assert both.baselines == ["run-a / standard", "run-b / standard"]
    assert set(both.steps["strategy"]) == set(both.strategies)
    assert both.summary["strategy"].tolist() == both.strategies
    assert both.status == "incomplete" and "run-b: stopped by request" in both.reason
    # same model: one line, naming the profiles it stands for
    assert both.reference["label"].unique().tolist() == ["full cache, float16 (run-a, run-b)"]
    same = data.combine([a, data.run_view(profile_with_steps(ROWS), "run-a")])
    assert same.strategies[2] == "run-a (2) / standard"
    wider = data.run_view(profile_with_steps(ROWS, num_kv_heads=6), "run-c")  # another model: its own line
    refs = data.combine([a, wider]).reference
    assert sorted(refs["label"].unique()) == ["full cache, float16 (run-a)", "full cache, float16 (run-c)"]
    by_label = refs.groupby("label")["bytes"].last()
    assert by_label["full cache, float16 (run-c)"] == 2 * by_label["full cache, float16 (run-a)"]


def test_nearest_recorded_step_is_at_or_before_else_the_first():
    assert data.nearest_at_or_before([0, 16, 32], 20) == 16
    assert data.nearest_at_or_before([0, 16, 32], 32) == 32
    assert data.nearest_at_or_before([4, 8], 1) == 4
    assert data.nearest_at_or_before([], 3) is None


def test_profile_listing_covers_sweep_folders_and_marks_bad_and_incomplete_files(tiny_profiles, tmp_path):
    folder = tmp_path / "profiles"
    (folder / "sweep-a").mkdir(parents=True)
    (folder / "done.csv").write_bytes((tiny_profiles / "tiny-complete.csv").read_bytes())
    (folder / "sweep-a" / "point-1.csv").write_bytes((tiny_profiles / "tiny-stopped.csv").read_bytes())
    (folder / "sweep-a" / "index.csv").write_text("point,status\npoint-1,stopped\n")
    (folder / "notes.csv").write_text("a,b\n1,2\n")
    (folder / ".running.csv.partial").write_text("")
    files = list_profiles(folder)
    assert [f.name for f in files] == ["done.csv", "notes.csv", "sweep-a/point-1.csv"]
    assert files[2].label == "sweep-a/point-1"
    table = profile_folder.listing(files).set_index("profile")
    assert table.loc["done.csv", "status"] == "complete"
    assert table.loc["sweep-a/point-1.csv", "status"] == "incomplete"
    assert "stopped by request" in table.loc["sweep-a/point-1.csv", "reason"]
    assert table.loc["notes.csv", "status"] == "not a profile"


def test_save_as_refuses_bad_and_taken_names(tiny_profiles, profiles_dir):
    profile = load_profile(tiny_profiles / "tiny-complete.csv")
    path = profile_folder.save_as(profile, "my-run")
    assert path == profiles_dir / "my-run.csv"
    assert load_profile(path).name == "my-run"
    with pytest.raises(ValueError, match="already exists"):
        profile_folder.save_as(profile, "my-run.csv")
    with pytest.raises(ValueError, match="is not allowed"):
        profile_folder.save_as(profile, "../elsewhere")
