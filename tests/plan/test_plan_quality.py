"""The quality price: measured KL / agreement from real profiles, and the recommendation."""

from __future__ import annotations

import pytest

from cachelib.cli import main
from cachelib.plan import plan, preset
from cachelib.plan.quality import collect_evidence, measured_quality, recommend, with_quality
from cachelib.profile import run_profile

SPECS = ["standard", "rotating:max_size=16,keep=4", "rotating:max_size=32,keep=4", "quantized:bits=8", "quantized:bits=4"]


@pytest.fixture(scope="module")
def profiles_dir(tmp_path_factory, load_model):
    folder = tmp_path_factory.mktemp("profiles")
    loaded = load_model("tiny-llama", "torch")
    run_profile(loaded, SPECS, prompt="Tell me about memory.", max_tokens=48, out=folder / "a.csv")
    run_profile(loaded, SPECS[:3], prompt="Another prompt, another run.", max_tokens=48, out=folder / "b.csv")
    (folder / "notes.csv").write_text("not,a,profile\n1,2,3\n")  # skipped, not fatal
    return folder


def test_evidence_names_model_backend_runs_and_files(profiles_dir):
    evidence = {e.spec: e for e in collect_evidence(profiles_dir)}
    assert set(evidence) == set(SPECS[1:])  # the baseline measures nothing against itself
    rot = evidence["rotating:max_size=16,keep=4"]
    assert (rot.model, rot.backend, rot.runs, rot.files) == ("tiny-llama", "torch", 2, ("a.csv", "b.csv"))
    assert rot.steps == 2 * 47  # decode steps of both runs
    assert evidence["quantized:bits=4"].runs == 1


def test_recommendation_is_the_cheapest_strategy_meeting_the_threshold(profiles_dir):
    quality = measured_quality(profiles_dir)
    fits = with_quality(plan(preset("llama-3.1-8b"), SPECS, context=4096, prefill=64), profiles_dir)
    loose = max(q.mean_kl for q in quality.values()) + 1
    pick = recommend(fits, max_kl=loose, planned_model="llama-3.1-8b")
    # Every measured strategy qualifies: the smallest peak wins (a 16-token ring).
    assert pick.fit.spec == "rotating:max_size=16,keep=4"
    assert "measured on tiny-llama" in pick.text and "not on llama-3.1-8b" in pick.text
    strict = min(q.mean_kl for q in quality.values())
    best = min(quality, key=lambda s: quality[s].mean_kl)
    assert recommend(fits, max_kl=strict).fit.spec == best
    none = recommend(fits, max_kl=-0.0, min_agreement=1.0)
    assert none.fit is None or quality[none.fit.spec].top1_agreement == 1.0


def test_threshold_errors_are_named():
    with pytest.raises(ValueError, match="give a quality threshold"):
        recommend([])
    with pytest.raises(ValueError, match="min_agreement must be between 0 and 1"):
        recommend([], min_agreement=3)


def test_plan_cli_prints_quality_and_recommendation(profiles_dir, capsys):
    code = main(["plan", "--model", "llama-3.1-8b", "--context", "8192", "--prefill", "64", "--quality-from", str(profiles_dir), "--max-kl", "100"])
    out = capsys.readouterr().out
    assert code == 0
    assert "mean KL" in out and "quality measured on tiny-llama" in out
    assert "recommendation: rotating:max_size=16,keep=4" in out
