"""What fits in a budget: max context (against a brute-force scan), max batch, sessions, the
budget needed, limits, quality attachment and bad input."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from cachelib.plan import (
    GB,
    NO_LIMIT,
    PlanRequest,
    Quality,
    account,
    attach_quality,
    budget_needed,
    cache_budget,
    max_batch,
    max_context,
    max_sessions,
    plan,
    preset,
    weight_bytes,
)

GEMMA = preset("tiny-gemma3")
LLAMA = preset("tiny-llama")


def _peak(arch, spec, backend, n, prefill, chunk):
    p = None if prefill is None else min(prefill, n)
    return account(arch, spec, backend, context=n, prefill=p, prefill_chunk=chunk).peak_bytes


@pytest.mark.parametrize(
    "arch, backend, spec",
    [
        (GEMMA, "mlx", "standard"),
        (GEMMA, "mlx", "rotating:max_size=100,keep=4"),
        (GEMMA, "mlx", "sliding:window=50"),
        (LLAMA, "mlx", "kivi:bits=2,group_size=32,residual=16"),
        (LLAMA, "mlx", "quantized:bits=8,start=300"),
        (GEMMA, "torch", "offloaded"),
        (LLAMA, "torch", "chunked:chunk_size=100"),
    ],
)
def test_max_context_is_the_longest_context_whose_every_shorter_run_fits(arch, backend, spec):
    rng = random.Random(spec)
    scan = 700
    for _ in range(2):
        prefill, chunk = rng.choice([None, rng.randint(1, 300)]), rng.choice([None, 1, 7, 64])
        peaks = [_peak(arch, spec, backend, n, prefill, chunk) for n in range(1, scan + 1)]
        available = peaks[rng.randint(0, scan - 1)] + rng.randint(0, 3000)
        first_fail = next((n for n, p in enumerate(peaks, 1) if p > available), None)
        got = max_context(arch, spec, available, backend=backend, prefill=prefill, prefill_chunk=chunk)
        if first_fail is None:
            assert got[0] is None or got[0] >= scan
        else:
            assert got == (first_fail - 1, "memory"), (prefill, chunk, available)


def test_max_context_limits_memory_model_max_len_and_unbounded():
    big = 10**12
    assert max_context(LLAMA, "standard", big) == (LLAMA.max_position_embeddings, "model")
    assert max_context(LLAMA, "static:max_len=512", big) == (512, "max_len")
    assert max_context(LLAMA, "static:max_len=512", 100) == (0, "memory")
    # a ring fed in chunks stops growing: memory never binds
    assert max_context(LLAMA, "rotating:max_size=256,keep=4", big, prefill_chunk=64) == (None, "unbounded")
    assert max_context(preset("tiny-mamba"), "standard", big) == (None, "unbounded")
    # a growing cache under a bounded budget binds on memory, also with the model limit lifted
    n, why = max_context(LLAMA, "standard", 50 * 2**20, limit=NO_LIMIT)
    assert why == "memory" and account(LLAMA, "standard", context=n).peak_bytes <= 50 * 2**20
    assert account(LLAMA, "standard", context=n + 1).peak_bytes > 50 * 2**20


def test_max_batch_and_sessions_follow_peak_and_resident_bytes():
    available = 40 * 2**20
    acc = account(GEMMA, "standard", context=1000, prefill=200)
    assert max_batch(GEMMA, "standard", available, context=1000, prefill=200) == available // acc.peak_bytes
    sessions = max_sessions(GEMMA, "standard", available, context=1000, prefill=200)
    assert sessions == 1 + (available - acc.peak_bytes) // acc.max_resident_bytes
    # the reverse: that many sessions need at most the budget, one more needs more
    need = budget_needed(GEMMA, "standard", context=1000, prefill=200, weights_bytes=0, sessions=sessions)
    more = budget_needed(GEMMA, "standard", context=1000, prefill=200, weights_bytes=0, sessions=sessions + 1)
    assert need <= available < more


def test_budget_needed_is_the_smallest_budget_that_fits():
    weights = weight_bytes(LLAMA)
    # the solver's functions plan cachelib's own caches and loop: so does the request
    asked = PlanRequest(["quantized:bits=4"], context=3000, batch=2, reserve_bytes=10, runtime="cachelib")
    forward = asked.forward_bytes(LLAMA, asked.strategies[0])[0]  # the whole device counts its activations
    need = budget_needed(
        LLAMA,
        "quantized:bits=4",
        context=3000,
        batch=2,
        weights_bytes=weights,
        reserve_bytes=10,
        activation_bytes=forward,
    )
    fit = plan(LLAMA, replace(asked, budget_bytes=need))[0]
    assert fit.fits and fit.headroom_bytes == 0 and fit.budget_needed == need and fit.activation_bytes == forward
    short = plan(LLAMA, replace(asked, budget_bytes=need - 1))[0]
    assert short.fits is False and short.headroom_bytes == -1


def test_plan_reports_every_strategy_against_the_budget():
    fits = plan(
        preset("llama-3.1-8b"),
        PlanRequest(
            ["standard", "rotating:max_size=4096,keep=4", "quantized:bits=4"],
            context=32768,
            budget_bytes=80 * GB,
            prefill_chunk=2048,
        ),
    )
    by = {f.spec: f for f in fits}
    assert by["standard"].cache.bytes_allocated == 32768 * 131_072
    assert by["standard"].weights_bytes == 2 * 8_030_261_248
    assert by["rotating:max_size=4096,keep=4"].context_limit == "unbounded"
    assert all(f.fits for f in fits)
    # mlx-lm's quantized attention materialises each chunk's scores (32 heads, fp16): generate_step's last chunk is
    # 2,047 tokens over 32,767 keys (the prompt's last token goes alone), 4.3 GB a row, so fewer rows fit than with
    # the full cache, whose fused kernel holds no scores
    q4, standard = by["quantized:bits=4"], by["standard"]
    assert q4.device.activations - standard.device.activations == 32 * 2047 * 32767 * 2 + 2047 * 32767
    assert q4.cache.peak_bytes < standard.cache.peak_bytes and q4.max_batch < standard.max_batch


def test_budget_below_the_weights_is_refused():
    with pytest.raises(
        ValueError, match=r"budget 9\.31 GiB per device is below the weights on one device \(14\.96 GiB\)"
    ):
        plan(preset("llama-3.1-8b"), PlanRequest(["standard"], context=100, budget_bytes=10 * GB))
    with pytest.raises(ValueError, match="but not the reserve"):
        cache_budget(100, 60, 50)
    with pytest.raises(ValueError, match="tiny-mamba has no parameter count"):
        weight_bytes(replace(preset("tiny-mamba"), num_params=None))
    with pytest.raises(ValueError, match="weight bits must be positive"):
        weight_bytes(LLAMA, 0)


def test_quality_attaches_by_canonical_spec_and_names_its_model():
    fits = plan(LLAMA, PlanRequest(["standard", "rotating:max_size=512,keep=4"], context=1000))
    table = {
        "rotating:keep=4,max_size=512": Quality(0.012, 0.97, model="smollm2", source="profiles/run.csv"),
    }
    out = attach_quality(fits, table)
    assert out[0].quality is None
    assert out[1].quality.model == "smollm2" and out[1].quality.top1_agreement == 0.97
    assert out[1].cache == fits[1].cache
