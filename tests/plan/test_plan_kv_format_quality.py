"""A runtime's lossy KV format (vLLM's fp8, llama.cpp's q8_0 / q4_0) is judged by the measured
evidence of the strategy that stores it bit for bit, or said to be "quality not measured" with the
command that measures it; never "exact". The format strategies' bytes are the formats' bytes."""

from __future__ import annotations

import argparse

import pytest

from cachelib.cli import plan as cli
from cachelib.core.rules import format_bytes
from cachelib.plan import PlanRequest, plan_request, preset, trace
from cachelib.plan.quality import EXACT, Evidence
from cachelib.profile import load_evidence

ARCH = preset("smollm2")


def point(spec: str, context: int, kl: float, top1: float, backend: str = "torch") -> Evidence:
    return Evidence(
        spec,
        "SmolLM2-135M-Instruct",
        backend,
        context,
        1.0,
        3,
        kl,
        top1,
        mean_kl_ci95=kl / 2,
        top1_ci95=0.01,
        files=(f"{spec}.csv",),
    )


EVIDENCE = [
    point("fp8", 1024, 0.011, 0.97),
    point("fp8", 2048, 0.013, 0.96),
    point("q8_0", 2048, 0.0004, 1.0),
    point("q4_0", 2048, 0.09, 0.88),
    point("quantized:bits=8", 2048, 0.0009, 0.99),
]


def planned(runtime: str, kv_format: str | None, evidence=EVIDENCE, context: int = 2048, **kw):
    request = PlanRequest(("standard",), context=context, runtime=runtime, kv_format=kv_format, **kw)
    return plan_request(ARCH, request, evidence)


@pytest.mark.parametrize(
    ("runtime", "kv_format", "kl"), [("vllm", "fp8", 0.013), ("llama.cpp", "q8_0", 0.0004), ("llama.cpp", "q4_0", 0.09)]
)
def test_format_is_judged_by_its_strategys_measured_point(runtime, kv_format, kl):
    result = planned(runtime, kv_format)
    q = result.fits[0].quality
    assert q is not None and q is not EXACT and q.samples == 3
    assert (q.mean_kl, q.context, q.backend) == (kl, 2048, "torch")
    assert f"--kv-format {kv_format} judged by strategy {kv_format}" in q.note
    assert result.judgements["standard"].spec == kv_format


def test_shorter_plan_takes_the_point_at_least_as_long_and_longer_is_extrapolated():
    assert planned("vllm", "fp8", context=1000).fits[0].quality.context == 1024
    j = planned("vllm", "fp8", context=8000).judgements["standard"]
    assert j.quality.context == 2048 and "extrapolated" in j.reason and "--strategy fp8" in j.command


@pytest.mark.parametrize(("runtime", "kv_format"), [("vllm", "fp8"), ("llama.cpp", "q4_0")])
def test_unmeasured_format_is_not_measured_and_never_exact(runtime, kv_format):
    others = [e for e in EVIDENCE if e.spec != kv_format]
    result = planned(runtime, kv_format, evidence=others, max_kl=10.0)
    j = result.judgements["standard"]
    assert result.fits[0].quality is None and j.quality is None
    assert j.reason.startswith("quality not measured")
    # what measures it: the same-named strategy, on torch (llama.cpp's ggml kernels do not run here)
    assert "--backend torch" in j.command and f"--strategy {kv_format}" in j.command
    rec = result.recommendation
    assert rec.fit is None and "standard" in rec.unmeasured  # not "exact", so not recommended


def test_without_a_format_the_runtimes_dtype_cache_stays_exact():
    result = planned("vllm", None)
    assert result.fits[0].quality is EXACT


def test_cli_prints_the_measured_figures_not_exact(capsys):
    parser = argparse.ArgumentParser(prog="cachelib plan")
    cli.add_arguments(parser)
    rc = cli.run(
        parser.parse_args(["--model", "smollm2", "--runtime", "vllm", "--kv-format", "fp8", "--context", "1024"])
    )
    out = capsys.readouterr().out
    assert rc == 0 and "exact: keeps every token" not in out
    line = next(x for x in out.splitlines() if x.startswith("standard: "))
    assert "--kv-format fp8 judged by strategy fp8" in line
    assert "mean KL" in line or "quality not measured" in line


def test_committed_evidence_measures_every_format_on_torch_at_1024_and_2048():
    points = load_evidence().points
    for kv_format in ("fp8", "q8_0", "q4_0"):
        contexts = {p.context for p in points if p.spec == kv_format and p.backend == "torch"}
        assert {1024, 2048} <= contexts, (kv_format, contexts)
    kl = {p.spec: p.mean_kl for p in points if p.context == 2048 and p.backend == "torch"}
    assert 0 < kl["q8_0"] < kl["fp8"] < kl["q4_0"]  # the formats' precision orders them
    for runtime, kv_format in (("vllm", "fp8"), ("llama.cpp", "q8_0"), ("llama.cpp", "q4_0")):
        q = planned(runtime, kv_format, evidence=points).fits[0].quality
        assert q is not None and q.mean_kl == kl[kv_format]


@pytest.mark.parametrize("kv_format", ["fp8", "q8_0", "q4_0"])
def test_format_strategy_bytes_are_the_formats_bytes(kv_format):
    run = trace(ARCH, kv_format, "torch", updates=[300, 1])
    per_layer = format_bytes(ARCH.kv_heads * ARCH.key_dim, kv_format) * 2 * 512  # K and V, two 256-token steps
    assert run.steps[-1].bytes_allocated == per_layer * ARCH.attention_layers
