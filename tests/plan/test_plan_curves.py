"""The planner over a grid of contexts: every point equals the account, max batch and sessions of
a run of that length, gaps where a strategy refuses the run, and a cost of about one account of
the longest run, not one per point."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cachelib.plan import (
    GB,
    PlanRequest,
    account,
    chart_range,
    context_grid,
    frontier_curves,
    max_batch,
    max_sessions,
    memory_curves,
    preset,
)
from cachelib.plan.accounting import Replay
from cachelib.spec import parse_spec

SMOL = preset("smollm2")  # 30 layers, 3 KV heads x 64, max_position_embeddings 8192
SPECS = ["standard", "rotating:max_size=256,keep=4", "quantized:bits=4"]
CONTEXTS = [1, 100, 256, 257, 1000]


def test_context_grid_spans_the_range_and_always_holds_the_asked_context():
    grid = context_grid(1000, 2000, points=8)
    assert grid == [250, 500, 750, 1000, 1250, 1500, 1750, 2000]
    grid = context_grid(777, 2000, points=8)
    assert 777 in grid and grid == sorted(set(grid)) and grid[-1] == 2000
    log = context_grid(1000, 10_000, points=5, log=True)
    assert log == [1, 10, 100, 1000, 10_000]
    with pytest.raises(ValueError, match="must be >= 1 token"):
        context_grid(0, 100)


def test_chart_range_is_twice_the_context_cut_to_the_model_length_when_that_covers_it():
    assert chart_range(1000, 8192) == 2000
    assert chart_range(6000, 8192) == 8192
    assert chart_range(10_000, 8192) == 20_000  # past the model's length: the model does not cut it
    assert chart_range(1000, None) == 2000


def test_memory_curves_are_the_accounts_of_each_context():
    # cachelib's own loop: what account() plans without a deployment
    request = PlanRequest(SPECS, context=1000, batch=2, dtype="bfloat16", prefill=200, runtime="cachelib")
    curves = memory_curves(SMOL, request, CONTEXTS)
    assert len(curves) == len(SPECS) * len(CONTEXTS)
    for row in curves.itertuples():
        # a run shorter than the prompt is all prompt, as the solver counts it
        acc = account(
            SMOL, row.strategy, "mlx", context=row.context, batch=2, dtype="bfloat16", prefill=min(200, row.context)
        )
        assert (row.bytes_allocated, row.peak_bytes) == (acc.bytes_allocated, acc.peak_bytes)
    std = curves[curves["strategy"] == "standard"].set_index("context")
    assert std.loc[256, "bytes_allocated"] < std.loc[257, "bytes_allocated"]  # the next 256-token block


def test_memory_curves_leave_gaps_where_a_strategy_refuses_the_run_and_raise_when_it_refuses_all():
    curves = memory_curves(SMOL, PlanRequest(["static:max_len=256"], context=1), CONTEXTS)
    refused = curves.set_index("context")["bytes_allocated"]
    assert refused[[1, 100, 256]].notna().all() and refused[[257, 1000]].isna().all()
    with pytest.raises(ValueError, match="group_size=128 does not divide"):
        memory_curves(SMOL, PlanRequest(["quantized:bits=4,group_size=128"], context=1), CONTEXTS)


def test_frontier_curves_are_max_batch_and_sessions_of_each_context():
    # cachelib's own loop: what the solver's functions plan (no runtime)
    request = PlanRequest(
        SPECS, context=1000, backend="torch", budget_bytes=350 * 10**6, weights_bytes=300 * 10**6, runtime="cachelib"
    )
    available = request.cache_budget(SMOL)
    frontier = frontier_curves(SMOL, request, CONTEXTS)
    for row in frontier.itertuples():
        kw = dict(context=row.context, backend="torch")
        forward = request.forward_bytes(SMOL, parse_spec(row.strategy), context=row.context, batch=1)[0]  # counted too
        assert row.max_batch == max_batch(SMOL, row.strategy, available, row_bytes=forward, **kw)
        assert row.sessions == max_sessions(SMOL, row.strategy, available, forward_bytes=forward, **kw)
    std = frontier[frontier["strategy"] == "standard"]["max_batch"].to_numpy()
    assert (np.diff(std) <= 0).all() and std[0] > std[-1]
    with pytest.raises(ValueError, match="give a memory budget"):
        frontier_curves(SMOL, PlanRequest(SPECS, context=1000), CONTEXTS)


GRID = [1, 2, 31, 32, 33, 64, 100, 255, 256, 257, 300, 513, 1000, 1500]
CASES = [  # (model, backend, specs)
    (
        "tiny-llama",
        "mlx",
        [
            "standard",
            "concat",
            "rotating:max_size=64,keep=4",
            "quantized:bits=4,group_size=32",
            "kivi:group_size=32,residual=64",
            "chunked:chunk_size=100",
            "static:max_len=300",
            "sliding:window=50",
        ],
    ),
    (
        "tiny-llama",
        "torch",
        [
            "standard",
            "rotating:max_size=64,keep=4",
            "quantized:bits=4,group_size=32",
            "offloaded",
            "static:max_len=300",
            "sliding:window=50",
        ],
    ),
    ("tiny-gemma3", "mlx", ["standard", "rotating:max_size=128", "quantized:bits=8,group_size=32"]),
    ("tiny-gemma3", "torch", ["standard", "offloaded", "kivi:group_size=32,residual=64"]),
    ("tiny-mamba", "mlx", ["standard"]),
]
FEEDS = [  # (prefill, prefill_chunk)
    (None, None),
    (None, 64),
    (None, 1),
    (0, None),
    (100, None),
    (100, 32),
    (700, 256),
    (200, 1),
]


@pytest.mark.parametrize("model, backend, specs", CASES, ids=[f"{m}-{b}" for m, b, _ in CASES])
def test_one_walk_per_strategy_gives_each_contexts_own_account(model, backend, specs):
    # the curves share one replay across the grid; each point must still be its own run's numbers
    arch = preset(model)
    for prefill, chunk in FEEDS:
        request = PlanRequest(
            specs, context=1, backend=backend, batch=3, prefill=prefill, prefill_chunk=chunk, runtime="cachelib"
        )  # cachelib's loop: what account() and the solver plan
        curves = memory_curves(arch, request, GRID).set_index(["strategy", "context"])
        budget = replace(request, budget_bytes=10**9 + 4 * 10**6, weights_bytes=10**9)  # room for a few caches
        available = budget.cache_budget(arch)
        frontier = frontier_curves(arch, budget, GRID).set_index(["strategy", "context"])
        for spec in specs:
            for n in GRID:
                p = None if prefill is None else min(prefill, n)
                try:
                    acc = account(arch, spec, backend, context=n, prefill=p, prefill_chunk=chunk, batch=3)
                except ValueError:
                    assert np.isnan(curves.loc[(spec, n), "bytes_allocated"]), (spec, n)
                    assert np.isnan(frontier.loc[(spec, n), "max_batch"]), (spec, n)
                    continue
                where = (spec, n, prefill, chunk)
                assert curves.loc[(spec, n), "bytes_allocated"] == acc.bytes_allocated, where
                assert curves.loc[(spec, n), "peak_bytes"] == acc.peak_bytes, where
                kw = dict(context=n, backend=backend, prefill=prefill, prefill_chunk=chunk)
                forward = budget.forward_bytes(arch, parse_spec(spec), context=n, batch=1)[0]  # counted too
                most = max_batch(arch, spec, available, row_bytes=forward, **kw)
                assert frontier.loc[(spec, n), "max_batch"] == most, where
                assert frontier.loc[(spec, n), "sessions"] == max_sessions(
                    arch, spec, available, forward_bytes=forward, **kw
                ), where


def test_the_grid_costs_the_same_whatever_the_context(monkeypatch):
    # the Planner page hung at a context of 10^8 (issue 17, item 10): the walk fed every prompt
    # chunk and every growth step; cycles of equal updates are now jumped over, exactly
    calls = [0]
    update = Replay.update

    def counted(self, *args):
        calls[0] += 1
        return update(self, *args)

    monkeypatch.setattr(Replay, "update", counted)
    arch, spec = preset("llama-3.1-8b"), "standard"
    for prefill, chunk in [(1000, None), (None, 2048), (1000, 256)]:
        cost = {}
        for context in (500_000, 5 * 10**11):
            grid = context_grid(context, 2 * context)
            calls[0] = 0
            account(arch, spec, context=grid[-1], prefill=prefill, prefill_chunk=chunk)
            assert calls[0] <= 64, (prefill, chunk, context)  # a few cycles, not context / chunk
            calls[0] = 0
            memory_curves(arch, PlanRequest([spec], context=1, prefill=prefill, prefill_chunk=chunk), grid)
            budget = PlanRequest([spec], context=1, prefill=prefill, prefill_chunk=chunk, budget_bytes=80 * GB)
            frontier_curves(arch, budget, grid)
            cost[context] = calls[0]
            assert calls[0] <= 2 * 16 * len(grid), (prefill, chunk, context)  # a few updates per point
        assert cost[5 * 10**11] <= 2 * cost[500_000], (prefill, chunk, cost)
