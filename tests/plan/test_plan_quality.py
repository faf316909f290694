"""The quality price: measured KL / agreement from real profiles, and the recommendation."""

from __future__ import annotations

import pytest

from cachelib.cli import main
from cachelib.plan import PlanRequest, Quality, attach_quality, plan, preset
from cachelib.plan.quality import recommend
from cachelib.profile import run_profile
from cachelib.profile.evidence import collect_evidence, measured_quality, with_quality

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
    fits = with_quality(plan(preset("llama-3.1-8b"), PlanRequest(SPECS, context=4096, prefill=64)), profiles_dir)
    loose = max(q.mean_kl for q in quality.values()) + 1
    pick = recommend(fits, max_kl=loose, planned_model="llama-3.1-8b")
    # Every measured strategy qualifies: the smallest peak wins (a 16-token ring).
    assert pick.fit.spec == "rotating:max_size=16,keep=4"
    assert "measured on tiny-llama" in pick.text and "not on llama-3.1-8b" in pick.text
    strict = min(q.mean_kl for q in quality.values())
    best = min(quality, key=lambda s: quality[s].mean_kl)
    assert recommend(fits, max_kl=strict).fit.spec == best
    none = recommend(fits, max_kl=-0.0, min_agreement=1.0)
    assert none.fit.spec == "standard" or quality[none.fit.spec].top1_agreement == 1.0  # lossless: exact


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


def test_evidence_records_its_context_and_specs_match_by_meaning(profiles_dir):
    evidence = {e.spec: e for e in collect_evidence(profiles_dir)}
    prompt_a = evidence["quantized:bits=4"].context - 48  # one run: its prompt, then 48 decode steps
    assert prompt_a > 0 and evidence["rotating:max_size=16,keep=4"].context >= evidence["quantized:bits=4"].context
    # The same strategy written with its default knobs spelled out gets the same evidence.
    spelled = ["quantized:bits=4,group_size=64", "rotating:keep=4,max_size=32", "quantized:bits=4,group_size=32"]
    fits = with_quality(plan(preset("llama-3.1-8b"), PlanRequest(spelled, context=4096, prefill=64)), profiles_dir)
    assert fits[0].quality.mean_kl == evidence["quantized:bits=4"].mean_kl
    assert fits[1].quality.mean_kl == evidence["rotating:max_size=32,keep=4"].mean_kl
    assert fits[2].quality is None  # another group size is another strategy


def test_a_ring_measured_only_before_it_filled_is_not_recommended():
    specs = ["standard", "rotating:max_size=4096", "rotating:max_size=64", "quantized:bits=8"]
    fits = plan(preset("smollm2"), PlanRequest(specs, context=8192, prefill=64))
    measured = {  # the 4096-ring ran 300 tokens: it never evicted anything
        "rotating:max_size=4096": Quality(0.0, 1.0, "SmolLM2-135M-Instruct", "short.csv", context=300),
        "rotating:max_size=64": Quality(0.02, 0.95, "SmolLM2-135M-Instruct", "long.csv", context=300),
        "quantized:bits=8": Quality(0.001, 0.99, "SmolLM2-135M-Instruct", "long.csv", context=300),
    }
    pick = recommend(attach_quality(fits, measured), max_kl=0.05, planned_model=preset("smollm2"))
    assert pick.fit.spec == "rotating:max_size=64" and pick.unfilled == ("rotating:max_size=4096",)
    assert pick.unmeasured == () and "standard" in pick.qualified  # lossless: exact by construction
    exact = recommend(attach_quality(fits, measured), max_kl=0.0, planned_model=preset("smollm2"))
    assert exact.fit.spec == "standard" and "keeps every token at full precision" in exact.text
    assert "never evicting: rotating:max_size=4096" in pick.text
    assert "evicts more at 8,192 tokens than in the runs measured (300 tokens)" in pick.text
    assert "not on" not in pick.text  # the bundled smollm2 preset is SmolLM2-135M-Instruct, what profiles record
    llama = plan(preset("llama-3.1-8b"), PlanRequest(["quantized:bits=8"], context=64))
    assert "not on llama" in recommend(attach_quality(llama, measured), max_kl=1, planned_model=preset("llama-3.1-8b")).text


def test_plan_cli_leaves_out_measured_strategies_this_backend_refuses(tmp_path, load_model, capsys):
    loaded = load_model("tiny-llama", "torch")
    run_profile(loaded, ["standard", "offloaded"], prompt="Offload me.", max_tokens=4, out=tmp_path / "o.csv")
    args = ["plan", "--model", "smollm2", "--context", "512", "--quality-from", str(tmp_path), "--max-kl", "1"]
    assert main([*args, "--backend", "mlx"]) == 0  # offloaded exists on torch only: skipped, not fatal
    out = capsys.readouterr().out
    assert "measured but not plannable here: offloaded" in out and "recommendation: standard" in out
    assert main([*args, "--backend", "torch"]) == 0
    assert "recommendation: offloaded" in capsys.readouterr().out
