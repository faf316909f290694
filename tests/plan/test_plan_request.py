"""One planning request: bytes inside, GB at the edges; the command line it writes reads back as
the same request; plan_request plans the measured strategies as candidates too."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cachelib.cli import build_parser
from cachelib.plan.quality import Evidence
from cachelib.plan import GB, PlanRequest, Quality, cache_budget, gb_to_bytes, plan, plan_request, preset, weight_bytes
from cachelib.cli.plan import request_from_args
from cachelib.spec import parse_spec

LLAMA = preset("llama-3.1-8b")
SMOL = preset("smollm2")  # heads 64 wide


def _from_argv(argv: list[str]) -> PlanRequest:
    assert argv[:4] == ["python", "-m", "cachelib", "plan"]
    return request_from_args(build_parser().parse_args(argv[3:]))


def test_to_argv_reads_back_as_the_same_request():
    request = PlanRequest(
        ["standard", "rotating:keep=4,max_size=4096"], context=32768, batch=2, backend="torch", dtype="bfloat16",
        prefill=1000, prefill_chunk=512, budget_bytes=24 * GB, weight_bits=4.5, reserve_bytes=1_250_000_000,
        max_kl=0.1, min_agreement=0.123456789,
    )  # fmt: skip
    argv = request.to_argv("llama-3.1-8b", ["my profiles"])
    assert _from_argv(argv) == request
    assert argv[argv.index("--budget-gb") + 1] == "24" and argv[argv.index("--reserve-gb") + 1] == "1.25"
    args = build_parser().parse_args(argv[3:])
    assert (args.model, [str(p) for p in args.evidence], args.strategy) == (
        "llama-3.1-8b", ["my profiles"], ["standard", "rotating:max_size=4096,keep=4"],  # canonical text
    )  # fmt: skip


def test_to_argv_writes_only_what_differs_from_the_cli_defaults():
    plain = PlanRequest(["standard"], context=10).to_argv("smollm2")
    assert plain == "python -m cachelib plan --model smollm2 --context 10 --strategy standard --backend mlx --dtype float16".split()
    given = PlanRequest(["standard"], context=10, weights_bytes=300_000_000, weight_bits=4).to_argv("smollm2")
    assert given[-2:] == ["--weights-gb", "0.3"] and "--weight-bits" not in given  # given weights: bits unused


@pytest.mark.parametrize("nbytes", [1, 123_456_789, 24 * GB + 1, 80 * GB - 7, 2**50 + 3])
def test_gb_on_the_command_line_reads_back_as_exactly_the_bytes(nbytes):
    request = PlanRequest(["standard"], context=10, budget_bytes=nbytes, weights_bytes=nbytes // 3)
    back = _from_argv(request.to_argv("smollm2"))
    assert (back.budget_bytes, back.weights_bytes) == (nbytes, nbytes // 3)


def test_gb_are_read_into_bytes_at_the_edge():
    assert gb_to_bytes("budget-gb", 24.0) == 24 * GB and gb_to_bytes("budget-gb", None) is None
    assert gb_to_bytes("weights-gb", 0.3) == 300_000_000
    with pytest.raises(ValueError, match=r"--reserve-gb must be >= 0, got -1"):
        gb_to_bytes("reserve-gb", -1)


def test_a_request_parses_its_strategies_and_names_bad_input():
    request = PlanRequest(["quantized:group_size=64,bits=4", parse_spec("standard")], context=1)
    assert request.strategies == (parse_spec("quantized:bits=4,group_size=64"), parse_spec("standard"))
    with pytest.raises(ValueError, match="give at least one strategy spec"):
        PlanRequest([], context=1)
    with pytest.raises(ValueError, match="--context must be a positive integer, got 0"):
        PlanRequest(["standard"], context=0)
    with pytest.raises(ValueError, match="--batch must be a positive integer, got -1"):
        PlanRequest(["standard"], context=1, batch=-1)
    with pytest.raises(ValueError, match="knob 'max_size' is required"):
        PlanRequest(["rotating"], context=1)


def test_weights_are_counted_at_the_requests_bits_unless_given():
    request = PlanRequest(["standard"], context=1000, budget_bytes=24 * GB, reserve_bytes=GB, weight_bits=4.5)
    counted = weight_bytes(LLAMA, 4.5)
    assert request.weights(LLAMA) == counted
    assert request.cache_budget(LLAMA) == cache_budget(24 * GB, counted, GB)
    assert replace(request, weights_bytes=5 * GB).weights(LLAMA) == 5 * GB
    assert replace(request, budget_bytes=None).cache_budget(LLAMA) is None
    fit = plan(LLAMA, request)[0]
    assert (fit.weights_bytes, fit.reserve_bytes, fit.budget_bytes) == (counted, GB, 24 * GB)
    unknown = replace(LLAMA, num_params=None)
    assert request.weights(unknown) is None
    with pytest.raises(ValueError, match="has no parameter count; give --weights-gb to plan against --budget-gb"):
        plan(unknown, request)


def test_plan_request_adds_measured_candidates_and_lists_what_it_cannot_plan():
    measured = [
        Evidence("quantized:bits=4,group_size=64", "smollm2", "mlx", 8192, 1.0, 4, 0.02, 0.95),  # = quantized:bits=4
        Evidence("quantized:bits=8", "smollm2", "mlx", 8192, 1.0, 4, 0.001, 0.99),
        Evidence("quantized:bits=4,group_size=128", "other", "mlx", 8192, 1.0, 4, 0.01, 0.99),  # 64-wide heads refuse
    ]
    request = PlanRequest(["standard", "quantized:bits=4"], context=4096, budget_bytes=24 * GB, max_kl=0.01)
    result = plan_request(SMOL, request, measured)
    assert [f.spec for f in result.fits] == ["standard", "quantized:bits=4", "quantized:bits=8"]
    assert result.added == ("quantized:bits=8",) and list(result.skipped) == ["quantized:bits=4,group_size=128"]
    assert result.recommendation.fit.spec == "quantized:bits=8"
    assert result.request is request and result.cache_budget == request.cache_budget(SMOL)
    assert result.measured_on == ["smollm2"]
    quiet = plan_request(SMOL, replace(request, max_kl=None), measured)  # no threshold: nothing added
    assert [f.spec for f in quiet.fits] == ["standard", "quantized:bits=4"] and quiet.recommendation is None


