"""The planner judges a strategy only as far as its evidence reaches: bounded strategies at the
same kept fraction, lossy ones at a context at least as long (or with an extrapolation note),
the planned backend and model first, and nothing recommended where nothing covers the target."""

from __future__ import annotations

import pytest

from cachelib.plan import PlanRequest, plan_request, preset
from cachelib.plan.quality import EXACT, Evidence, judge, kept_fraction, scaled_candidates

SMOL = "SmolLM2-135M-Instruct"


def point(spec, context, kl, top1, backend="mlx", model=SMOL, samples=4, ci=0.01):
    return Evidence(
        spec, model, backend, context, kept_fraction(spec, context), samples, kl, top1, ci, 0.02, files=("e.csv",)
    )


# a ring family measured on the bundled model at 8k: only the large kept fractions pass KL <= 0.1
RINGS = [
    point("rotating:max_size=256,keep=4", 8192, 0.40, 0.70),  # kept 3.1%
    point("rotating:max_size=1024,keep=4", 8192, 0.08, 0.92),  # kept 12.5%
    point("rotating:max_size=4096,keep=4", 8192, 0.01, 0.98),  # kept 50%
]
QUANT = [point("quantized:bits=8", 2048, 0.002, 0.99), point("quantized:bits=8", 8192, 0.003, 0.99)]


def test_a_ring_is_judged_by_the_closest_kept_fraction_at_or_below_its_own():
    j = judge(RINGS, "rotating:max_size=4096,keep=4", backend="mlx", context=32768)  # kept 12.5%
    assert j.quality.mean_kl == 0.08 and j.quality.kept_fraction == 0.125
    j = judge(RINGS, "rotating:max_size=8192,keep=4", backend="mlx", context=32768)  # kept 25%: judged at 12.5%
    assert j.quality.mean_kl == 0.08
    assert "12.50%" in j.quality.note and "25.00%" in j.quality.note


def test_a_ring_keeping_less_than_anything_measured_is_not_covered_and_says_how_to_measure_it():
    j = judge(RINGS, "rotating:max_size=128,keep=4", backend="mlx", context=32768)  # kept 0.39%
    assert j.quality is None and "not covered by evidence" in j.reason
    # the bundled model scores 64 tokens after at most 8,128: the same kept fraction there is a ring of 32
    assert "--context 8128 --score-tokens 64" in j.command and "rotating:max_size=32,keep=4" in j.command


def test_the_printed_command_is_one_the_evaluation_accepts_on_the_bundled_model():
    import shlex
    from types import SimpleNamespace

    from cachelib.cli import build_parser
    from cachelib.profile.evaluate import check_limit

    for spec in ("rotating:max_size=128,keep=4", "quantized:bits=8"):
        j = judge(RINGS + QUANT, spec, backend="mlx", context=32768)
        argv = shlex.split(j.command)
        assert argv[:4] == ["python", "-m", "cachelib", "evaluate"]
        args = build_parser().parse_args(argv[3:])  # what `python -m cachelib` parses
        assert args.model == "smollm2" and args.context == [8128] and args.score_tokens == 64
        # the bundled model's limit: the check evaluate runs before it loads anything
        check_limit(
            SimpleNamespace(name="SmolLM2-135M-Instruct", max_position_embeddings=8192), args.context, args.score_tokens
        )


def test_keep_zero_is_another_family_than_keep_four():
    j = judge(RINGS, "rotating:max_size=4096,keep=0", backend="mlx", context=32768)
    assert j.quality is None


def test_a_bound_that_holds_the_whole_context_is_exact():
    j = judge([], "rotating:max_size=4096,keep=4", backend="mlx", context=1000)
    assert j.quality is not None and j.quality.mean_kl == 0 and "whole" in j.reason


def test_a_pyramid_is_exact_only_when_its_top_layer_holds_the_whole_context():
    # PyramidKV's mean budget is its bound, but its top layer keeps budget/beta: 1,024 / 20 = 51
    assert judge([], "pyramidkv:budget=1024,beta=20", backend="mlx", context=512).quality is None
    assert (
        judge([], "pyramidkv:budget=1024,beta=2", backend="mlx", context=512).quality
        == judge([], "snapkv:budget=1024", backend="mlx", context=512).quality
    )
    assert judge([], "pyramidkv:budget=1024,beta=2", backend="mlx", context=600).quality is None


def test_quantized_is_judged_at_a_context_at_least_as_long_else_extrapolated_with_a_note():
    j = judge(QUANT, "quantized:bits=8,group_size=64", backend="mlx", context=4096)
    assert j.quality.context == 8192 and not j.command
    j = judge(QUANT, "quantized:bits=8", backend="mlx", context=32768)
    assert j.quality.context == 8192 and "extrapolated" in j.quality.note and "--context 8128" in j.command
    assert judge(QUANT, "quantized:bits=4", backend="mlx", context=4096).quality is None


def test_the_planned_backend_wins_and_the_other_backend_is_named():
    torch_only = [point("quantized:bits=8", 8192, 0.003, 0.99, backend="torch")]
    j = judge(torch_only, "quantized:bits=8", backend="mlx", context=4096)
    assert "measured on torch, not mlx" in j.quality.note
    both = torch_only + [point("quantized:bits=8", 8192, 0.005, 0.99, backend="mlx")]
    assert judge(both, "quantized:bits=8", backend="mlx", context=4096).quality.mean_kl == 0.005


def test_an_extrapolated_point_says_what_the_other_backend_measured_further():
    """The planned backend's 2,048-token point is judged; torch's 8,128-token point is quoted
    beside it, not used in its place."""
    points = [
        point("quantized:bits=8", 2048, 0.0005, 0.99),
        point("quantized:bits=8", 8128, 0.0007, 0.98, backend="torch"),
    ]
    j = judge(points, "quantized:bits=8", backend="mlx", context=32768)
    assert j.quality.mean_kl == 0.0005 and j.quality.backend == "mlx" and j.quality.context == 2048
    assert "extrapolated: measured up to 2,048 tokens" in j.quality.note
    assert "torch measured it up to 8,128 tokens: mean KL 0.0007 ± 0.01 nats, top-1 agreement 98.0%" in j.quality.note
    # nothing to add where the judged point is already the longest, or the other model's
    assert "measured it up to" not in judge(points[:1], "quantized:bits=8", backend="mlx", context=32768).quality.note
    other = [points[0], point("quantized:bits=8", 8128, 0.0007, 0.98, backend="torch", model="Other")]
    assert "measured it up to" not in judge(other, "quantized:bits=8", backend="mlx", context=32768).quality.note


def test_ring_evidence_does_not_cross_backends():
    """mlx-lm windows each query of an overflowing prefill chunk; transformers' mask does not."""
    j = judge(RINGS, "rotating:max_size=4096,keep=4", backend="torch", context=32768)
    assert j.quality is None and "measured on mlx too" in j.reason and "--backend torch" in j.command


def test_lossless_needs_no_evidence():
    assert judge([], "standard", backend="mlx", context=10**6).quality == EXACT


def test_scaled_candidates_keep_the_measured_kept_fraction_at_the_target():
    sizes = sorted(s.get("max_size") for s in scaled_candidates(RINGS, 32768))
    assert sizes == [1024, 4096, 16384]


def test_llama_at_32k_is_never_recommended_a_ring_below_the_passing_kept_fraction():
    """The issue's case: the default thresholds at 32,768 tokens. Only rings keeping >= 12.5% pass."""
    request = PlanRequest(
        ["standard", "rotating:max_size=128,keep=4", "quantized:bits=8"],
        context=32768,
        prefill_chunk=2048,
        budget_bytes=24 * 10**9,
        reserve_bytes=10**9,
        max_kl=0.1,
        min_agreement=0.9,
    )
    result = plan_request(preset("llama-3.1-8b"), request, RINGS + QUANT)
    rec = result.recommendation
    assert rec.fit is not None
    pick = rec.fit.spec
    if pick.startswith("rotating"):
        assert kept_fraction(pick, 32768) >= 0.125
    assert "rotating:max_size=128,keep=4" in rec.unmeasured
    assert any("rotating:max_size=32,keep=4" in c for c in rec.commands)
    # the lossless standard fits: it is the answer; the 8-bit cache qualifies by its interval's bounds too
    assert pick == "standard" and "quantized:bits=8" in rec.qualified
    assert rec.verdicts["quantized:bits=8"].startswith("meets: mean KL's upper 95% bound")


def test_with_no_covering_evidence_nothing_is_recommended_and_the_text_says_why():
    request = PlanRequest(["rotating:max_size=128,keep=4"], context=32768, max_kl=0.1)
    rec = plan_request(preset("llama-3.1-8b"), request, []).recommendation
    assert rec.fit is None and "not covered by evidence" in rec.text.lower()
    assert rec.commands and "cachelib evaluate" in rec.commands[0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_thresholds_must_be_finite(bad):
    with pytest.raises(ValueError, match="max.kl"):
        plan_request(preset("llama-3.1-8b"), PlanRequest(["standard"], context=1024, max_kl=bad), [])
