"""One planning request: bytes inside, GiB at the edges; the command line it writes reads back as
the same request; plan_request plans the measured strategies as candidates too."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cachelib.cli import build_parser
from cachelib.cli.plan import request_from_args
from cachelib.core.units import memory_text, parse_memory
from cachelib.plan import (
    GB,
    GiB,
    PlanRequest,
    cache_budget,
    memory_bytes,
    plan,
    plan_request,
    preset,
    weight_bytes,
)
from cachelib.plan.quality import Evidence
from cachelib.spec import parse_spec

LLAMA = preset("llama-3.1-8b")
SMOL = preset("smollm2")  # heads 64 wide


def _from_argv(argv: list[str]) -> PlanRequest:
    assert argv[:4] == ["python", "-m", "cachelib", "plan"]
    return request_from_args(build_parser().parse_args(argv[3:]))


def test_to_argv_reads_back_as_the_same_request():
    request = PlanRequest(
        ["standard", "rotating:keep=4,max_size=4096"],
        context=32768,
        batch=2,
        backend="torch",
        dtype="bfloat16",
        prefill=1000,
        prefill_chunk=512,
        budget_bytes=24 * GiB,
        weights_dtype="q4_k",
        reserve_bytes=1_250_000_000,
        max_kl=0.1,
        min_agreement=0.123456789,
        suggest=True,
        most_sessions=True,
    )
    argv = request.to_argv("llama-3.1-8b", ["my profiles"])
    assert _from_argv(argv) == request
    assert argv[argv.index("--budget") + 1] == "24GiB" and argv[argv.index("--reserve") + 1] == "1.25GB"
    vllm = PlanRequest(
        ["standard"],
        context=4096,
        runtime="vllm",
        tp=8,
        pp=2,
        kv_format="fp8",
        budget_bytes=80 * GiB,
        sessions=16,
        solve="max_kv_size",
        device="cpu",
    )
    assert _from_argv(vllm.to_argv("llama-3.1-70b")) == vllm and vllm.backend == "torch"
    bits = PlanRequest(["standard"], context=10, weights_dtype=4.5)
    assert bits == PlanRequest(["standard"], context=10, weights_dtype="4.5") == _from_argv(bits.to_argv("smollm2"))
    args = build_parser().parse_args(argv[3:])
    assert (args.model, [str(p) for p in args.evidence], args.strategy) == (
        "llama-3.1-8b",
        ["my profiles"],
        ["standard", "rotating:max_size=4096,keep=4"],  # canonical text
    )


def test_to_argv_writes_only_what_differs_from_the_cli_defaults():
    plain = PlanRequest(["standard"], context=10).to_argv("smollm2")  # no runtime named: mlx's, written out
    assert (
        plain
        == "python -m cachelib plan --model smollm2 --context 10 --strategy standard --runtime mlx-lm "
        "--dtype float16".split()
    )
    own = PlanRequest(["standard"], context=10, runtime="cachelib", backend="torch").to_argv("smollm2")
    assert own[-6:] == ["--runtime", "cachelib", "--backend", "torch", "--dtype", "float16"]
    given = PlanRequest(["standard"], context=10, weights_bytes=300_000_000, weights_dtype="4").to_argv("smollm2")
    assert given[-2:] == ["--weights-memory", "0.3GB"] and "--weights-dtype" not in given  # given weights: dtype unused


@pytest.mark.parametrize("nbytes", [1, 123_456_789, 24 * GB + 1, 80 * GiB - 7, 2**50 + 3, 24 * GiB, 24 * GB])
def test_memory_on_the_command_line_reads_back_as_exactly_the_bytes(nbytes):
    request = PlanRequest(["standard"], context=10, budget_bytes=nbytes, weights_bytes=nbytes // 3)
    back = _from_argv(request.to_argv("smollm2"))
    assert (back.budget_bytes, back.weights_bytes) == (nbytes, nbytes // 3)


def test_memory_is_gib_by_default_and_says_its_unit_otherwise():
    # a "24 GB" GPU holds 24 GiB: a bare number is GiB; GB spelled out is 10^9 bytes
    assert memory_bytes("budget", 24.0) == memory_bytes("budget", "24") == parse_memory("24GiB") == 24 * 2**30
    assert parse_memory("24GB") == parse_memory("24 gb") == 24 * 10**9 and memory_bytes("budget", None) is None
    assert parse_memory("512MiB") == 512 * 2**20 and parse_memory("1000B") == 1000
    assert memory_text(24 * 2**30) == "24GiB" and memory_text(24 * 10**9) == "24GB"
    with pytest.raises(ValueError, match=r"reserve must be a finite size >= 0, got -1"):
        memory_bytes("reserve", -1)
    with pytest.raises(ValueError, match=r"unknown unit 'GiBs' in '24GiBs'; allowed: B, KiB, MiB, GiB"):
        parse_memory("24GiBs", "budget")


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
    request = PlanRequest(["standard"], context=1000, budget_bytes=24 * GB, reserve_bytes=GB, weights_dtype="4.5")
    counted = weight_bytes(LLAMA, 4.5)
    assert request.weights(LLAMA) == counted
    assert request.cache_budget(LLAMA) == cache_budget(24 * GB, counted, GB)
    assert PlanRequest(["standard"], context=1).weights(LLAMA) == weight_bytes(LLAMA, 16)  # published bfloat16
    assert replace(request, weights_bytes=5 * GB).weights(LLAMA) == 5 * GB
    assert replace(request, budget_bytes=None).cache_budget(LLAMA) is None
    fit = plan(LLAMA, request)[0]
    assert (fit.weights_bytes, fit.reserve_bytes, fit.budget_bytes) == (counted, GB, 24 * GB)
    unknown = replace(LLAMA, num_params=None)
    assert request.weights(unknown) is None
    with pytest.raises(ValueError, match="has no parameter count; give --weights-memory to plan against --budget"):
        plan(unknown, request)


def test_plan_request_adds_measured_candidates_and_lists_what_it_cannot_plan():
    measured = [
        Evidence("quantized:bits=4,group_size=64", "smollm2", "mlx", 8192, 1.0, 4, 0.02, 0.95),  # = quantized:bits=4
        Evidence("quantized:bits=8", "smollm2", "mlx", 8192, 1.0, 4, 0.001, 0.99),
        Evidence("quantized:bits=4,group_size=128", "other", "mlx", 8192, 1.0, 4, 0.01, 0.99),  # 64-wide heads refuse
    ]
    request = PlanRequest(
        ["standard", "quantized:bits=4"], context=4096, budget_bytes=24 * GB, max_kl=0.01, suggest=True
    )
    result = plan_request(SMOL, request, measured)
    assert [f.spec for f in result.fits] == ["standard", "quantized:bits=4", "quantized:bits=8"]
    assert result.added == ("quantized:bits=8",) and list(result.skipped) == ["quantized:bits=4,group_size=128"]
    assert result.recommendation.fit.spec == "standard"  # lossless and it fits: nothing lossy is needed
    assert "one sample" in result.recommendation.verdicts["quantized:bits=8"]  # and one sample settles nothing
    assert result.request is request and result.cache_budget == request.cache_budget(SMOL)
    assert result.measured_on == ["smollm2"]
    quiet = plan_request(SMOL, replace(request, suggest=False), measured)  # not asked for: nothing added
    assert [f.spec for f in quiet.fits] == ["standard", "quantized:bits=4"]
    assert plan_request(SMOL, replace(request, max_kl=None), measured).recommendation is None  # no threshold
