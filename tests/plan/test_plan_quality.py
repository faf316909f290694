"""The quality price from real profiles as explicit evidence, and the recommendation."""

from __future__ import annotations

import shutil

import pytest

from cachelib.cli import main
from cachelib.plan import PlanRequest, plan, plan_request, preset
from cachelib.plan.quality import Evidence, judge_fits, kept_fraction, recommend
from cachelib.profile import load_evidence, run_profile

SPECS = [
    "standard",
    "rotating:max_size=16,keep=4",
    "rotating:max_size=32,keep=4",
    "quantized:bits=8",
    "quantized:bits=4",
]


@pytest.fixture(scope="module")
def profiles_dir(tmp_path_factory, load_model):
    folder = tmp_path_factory.mktemp("profiles")
    loaded = load_model("tiny-llama", "torch")
    run_profile(loaded, SPECS, prompt="Tell me about memory.", max_tokens=48, out=folder / "a.csv")
    run_profile(loaded, SPECS[:3], prompt="Another prompt, another run.", max_tokens=48, out=folder / "b.csv")
    (folder / "notes.csv").write_text("not,a,profile\n1,2,3\n")  # skipped with a warning, not fatal
    return folder


def test_profiles_give_one_point_per_run_and_strategy_naming_model_backend_and_file(profiles_dir):
    evidence = load_evidence([profiles_dir])
    assert set(evidence.files) == {str(profiles_dir / "a.csv"), str(profiles_dir / "b.csv")}
    assert len(evidence.warnings) == 1 and "notes.csv" in evidence.warnings[0]
    rings = [p for p in evidence.points if p.spec == "rotating:max_size=16,keep=4"]
    assert sorted(p.files for p in rings) == [("a.csv",), ("b.csv",)]
    assert {(p.model, p.backend, p.kind, p.samples) for p in rings} == {("tiny-llama", "torch", "profile", 1)}
    assert all(p.kept_fraction == kept_fraction(p.spec, p.context) < 1 for p in rings)
    assert not any(p.spec == "standard" for p in evidence.points)  # the baseline measures nothing against itself


def test_a_copy_of_a_run_counts_once(profiles_dir, tmp_path):
    shutil.copy(profiles_dir / "a.csv", tmp_path / "a-copy.csv")
    once = load_evidence([profiles_dir]).points
    twice = load_evidence([profiles_dir, tmp_path]).points
    assert len(twice) == len(once)


def test_missing_or_empty_evidence_paths_are_named(tmp_path):
    with pytest.raises(ValueError, match="no evidence at"):
        load_evidence([tmp_path / "nowhere"])
    with pytest.raises(ValueError, match="no evidence in"):
        load_evidence([tmp_path])


def test_profiles_single_samples_settle_no_threshold_so_the_lossless_strategy_is_recommended(profiles_dir):
    points = load_evidence([profiles_dir]).points
    context = max(p.context for p in points)  # the runs' own length: every point covers its strategy
    arch = preset("llama-3.1-8b")
    fits, judged = judge_fits(
        plan(arch, PlanRequest(SPECS, context=context, prefill=24)), points, backend="torch", planned=arch
    )
    loose = max(p.mean_kl for p in points) + 1
    pick = recommend(fits, max_kl=loose, planned_model=arch, judgements=judged)
    # a profile is one run: no 95% interval, so no lossy strategy is shown to meet even a loose threshold
    assert pick.fit.spec == "standard" and pick.qualified == ("standard",)
    assert "from one sample: no 95% interval" in pick.verdicts["rotating:max_size=16,keep=4"]
    exact = recommend(fits, max_kl=0.0, min_agreement=1.0)
    assert exact.fit.spec == "standard" and "keeps every token at full precision" in exact.text


def test_threshold_errors_are_named():
    with pytest.raises(ValueError, match="give a quality threshold"):
        recommend([])
    with pytest.raises(ValueError, match="min_agreement must be between 0 and 1"):
        recommend([], min_agreement=3)


def test_plan_cli_judges_by_the_evidence_it_is_given_and_names_it(profiles_dir, capsys):
    args = [
        "plan",
        "--model",
        "llama-3.1-8b",
        "--backend",
        "torch",
        "--context",
        "64",
        "--prefill",
        "16",
        "--no-default-evidence",
        "--evidence",
        str(profiles_dir),
        "--max-kl",
        "100",
    ]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "mean KL" in captured.out and "measured on tiny-llama, not on llama-3.1-8b" in captured.out
    # one-sample profiles settle no threshold; of the lossless two, DynamicCache without offloading is simpler
    assert "answer: standard on transformers" in captured.out
    assert "notes.csv: skipped" in captured.err


def test_plan_cli_refuses_an_evidence_path_that_does_not_exist(tmp_path, capsys):
    code = main(
        ["plan", "--model", "smollm2", "--context", "512", "--evidence", str(tmp_path / "none"), "--max-kl", "1"]
    )
    assert code == 2 and "no evidence at" in capsys.readouterr().err


def test_measured_strategies_this_model_refuses_are_listed_not_fatal():
    # measured with group size 128 on a model with 128-dim heads; smollm2's heads are 64 wide
    measured = Evidence("quantized:bits=4,group_size=128", "other", "mlx", 4096, 1.0, 2, 0.01, 0.99)
    result = plan_request(preset("smollm2"), PlanRequest(["standard"], context=512, max_kl=1, suggest=True), [measured])
    assert "quantized:bits=4,group_size=128" in result.skipped
    assert result.recommendation.fit.spec == "standard"
