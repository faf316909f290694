"""The Planner page's figures and tables on small plans: what each draws, read from its data, and
that every number is the planner library's (and the CLI's) for the same inputs."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest
from app_helpers import figure_json

from app import plan_charts
from app.figures import strategy_colors
from cachelib.cli.plan import format_table
from cachelib.core.units import (
    GiB,  # the planner's unit
    human_gib,
)
from cachelib.plan import (
    GB,
    PlanRequest,
    Quality,
    account,
    attach_quality,
    frontier_curves,
    memory_curves,
    plan,
    preset,
)
from cachelib.plan.quality import Evidence

SMOL = preset("smollm2")  # 30 layers, 3 KV heads x 64, max_position_embeddings 8192
SPECS = ["standard", "rotating:max_size=256,keep=4", "quantized:bits=4"]
CONTEXTS = [1, 100, 256, 257, 1000]


def small_plan(budget: int | None = int(0.4 * GB)):
    # 256-token prompt chunks keep the logits (chunk x vocab) within the 0.1 GB left for cache and activations
    return plan(
        SMOL, PlanRequest(SPECS, context=1000, prefill_chunk=256, budget_bytes=budget, weights_bytes=int(0.3 * GB))
    )


def test_memory_figure_draws_allocated_and_peak_in_gb_with_the_budget_and_where_memory_stops_each():
    fits = small_plan()
    available = int(0.1 * GB)
    curves = memory_curves(SMOL, PlanRequest(SPECS, context=1000), [100, 1000, 8000])
    fig = figure_json(plan_charts.plan_memory_figure(curves, SPECS, cache_budget=available, context=1000, fits=fits))
    lines = [t for t in fig["data"] if t.get("mode") == "lines"]
    assert [(t["name"], t["meta"]) for t in lines] == [(s, k) for s in SPECS for k in ("allocated", "peak")]
    colors = strategy_colors(SPECS)
    std = lines[0]
    assert std["line"]["color"] == colors["standard"] and std["showlegend"] and not lines[1]["showlegend"]
    expected = [account(SMOL, "standard", context=n).bytes_allocated for n in (100, 1000, 8000)]
    assert std["customdata"] == expected  # exact bytes on hover
    np.testing.assert_allclose(std["y"], np.array(expected) / GiB)
    budget_line = [s for s in fig["layout"]["shapes"] if s["y0"] == s["y1"]]
    assert budget_line[0]["y0"] == pytest.approx(available / GiB)
    assert [s["x0"] for s in fig["layout"]["shapes"] if s["x0"] == s["x1"]] == [1000]  # the asked context
    marks = next(t for t in fig["data"] if t["name"] == "max context in the budget")
    bound = {f.spec: f.max_context for f in fits if f.context_limit == "memory"}
    assert dict(zip(marks["customdata"], marks["x"])) == bound and "standard" in bound
    assert marks["marker"]["color"] == [colors[s] for s in bound]


def test_memory_figure_without_budget_has_no_budget_line_and_log_axes_on_request():
    curves = memory_curves(SMOL, PlanRequest(SPECS[:1], context=100), [10, 100])
    fig = figure_json(plan_charts.plan_memory_figure(curves, SPECS[:1], log=True))
    assert not [s for s in fig["layout"].get("shapes", []) if s["y0"] == s["y1"]]
    assert fig["layout"]["xaxis"]["type"] == fig["layout"]["yaxis"]["type"] == "log"
    empty = figure_json(plan_charts.plan_memory_figure(curves.iloc[:0], SPECS))
    assert empty["layout"]["annotations"][0]["text"] == "no strategy to plan"


def test_frontier_figure_draws_conservative_steps_per_strategy_and_marks_the_workload():
    budget = PlanRequest(SPECS, context=1000, budget_bytes=350 * 10**6, weights_bytes=300 * 10**6)  # 50 MB cache
    frontier = frontier_curves(SMOL, budget, CONTEXTS)
    fig = figure_json(plan_charts.plan_frontier_figure(frontier, SPECS, workload=(1000, 3)))
    by_name = {t["name"]: t for t in fig["data"]}
    std = by_name["standard"]
    assert std["x"] == CONTEXTS and std["line"]["shape"] == "vh"  # drops at the sample where the count falls
    assert std["y"] == frontier[frontier["strategy"] == "standard"]["max_batch"].tolist()
    assert std["line"]["color"] == strategy_colors(SPECS)["standard"]
    star = by_name["your workload (3 x 1,000 tokens)"]
    assert (star["x"], star["y"]) == ([1000], [3])
    assert fig["layout"]["yaxis"]["type"] == "log" and 1 in fig["layout"]["yaxis"]["tickvals"]

    fig = figure_json(plan_charts.plan_frontier_figure(frontier, SPECS, measure="sessions"))
    assert fig["data"][2]["y"] == frontier[frontier["strategy"] == SPECS[2]]["sessions"].tolist()
    assert "concurrent sessions" in fig["layout"]["title"]["text"]
    with pytest.raises(ValueError, match="measure must be one of max_batch, sessions"):
        plan_charts.plan_frontier_figure(frontier, SPECS, measure="tokens")
    empty = figure_json(plan_charts.plan_frontier_figure(frontier.iloc[:0], SPECS))
    assert empty["layout"]["annotations"][0]["text"] == "give a memory budget to see what fits"


def cli_cells(fits, budgeted: bool) -> list[dict[str, str]]:
    """The CLI's text table as {column: cell} per row."""
    head, *rows = format_table(fits, budgeted).splitlines()
    names = re.split(r"\s{2,}", head.strip())
    return [dict(zip(names, re.split(r"\s{2,}", r.strip()))) for r in rows]


def shown_cells(table) -> list[dict[str, str]]:
    """The table as the page shows it, {column: text} per row."""
    return plan_charts.plan_table_text(table).to_dict("records")


def test_plan_table_holds_the_fits_numbers_and_shows_them_as_the_cli_prints_them():
    quality = {"quantized:bits=4": Quality(0.0123456, 0.875, "smollm2", "a.csv")}
    fits = attach_quality(small_plan(), quality)
    table = plan_charts.plan_table(fits)
    assert list(table.columns) == [
        "strategy",
        "allocated",
        "used",
        "peak",
        "per token",
        "activations",
        "mean KL",
        "top-1",
        "measured on",
        "fits",
        "headroom",
        "max context",
        "limited by",
        "max batch",
        "sessions",
        "budget needed",
    ]
    for f, row in zip(fits, table.itertuples(index=False)):
        assert (row.strategy, row.peak, row.headroom, row.sessions) == (
            f.spec,
            f.cache.peak_bytes,
            f.headroom_bytes,
            f.sessions,
        )
    assert table["limited by"].tolist() == [plan_charts.LIMITS[f.context_limit] for f in fits]
    assert table["mean KL"].isna().tolist() == [True, True, False]

    shown, cli = shown_cells(table), cli_cells(fits, budgeted=True)
    assert len(shown) == len(cli) == 3
    for ours, theirs in zip(shown, cli):
        for col in (
            "allocated",
            "used",
            "peak",
            "per token",
            "activations",
            "headroom",
            "budget needed",
            "mean KL",
            "top-1",
        ):
            assert ours[col] == ("–" if theirs[col] == "-" else theirs[col]), (ours["strategy"], col)  # no value
        assert ours["mean KL"] == theirs["mean KL"]  # "not covered" on both
        assert ours["max batch"] == theirs["max batch"] and ours["fits"] == theirs["fits"]
    assert shown[2]["top-1"] == "87.5%" and shown[0]["mean KL"] == "not covered"
    styled = plan_charts.styled_plan_table(table, SPECS)
    assert styled.data.equals(plan_charts.plan_table_text(table))
    assert f"color: {strategy_colors(SPECS)['quantized:bits=4']}" in styled.to_html()


def test_the_page_shows_the_deciding_columns_first_and_keeps_every_column():
    # issue 13: the sessions column sat past the right edge at 1440 px; the page now leads with
    # what a reader decides by (strategy pinned), then the byte detail
    quality = {"quantized:bits=4": Quality(0.0123456, 0.875, "smollm2", "a.csv")}
    table = plan_charts.plan_table(attach_quality(small_plan(), quality))
    order = plan_charts.page_column_order(table)
    assert order[:9] == [
        "strategy",
        "fits",
        "sessions",
        "max batch",
        "max context",
        "mean KL",
        "top-1",
        "peak",
        "per token",
    ]
    assert sorted(order) == sorted(table.columns)  # nothing dropped, nothing repeated
    bare = plan_charts.plan_table(small_plan(budget=None))
    assert plan_charts.page_column_order(bare) == ["strategy", "peak", "per token", "allocated", "used", "activations"]


def test_plan_table_without_budget_or_evidence_has_only_the_cache_columns():
    table = plan_charts.plan_table(small_plan(budget=None))
    assert list(table.columns) == ["strategy", "allocated", "used", "peak", "per token", "activations"]
    torch = plan(SMOL, PlanRequest(["offloaded"], context=100, backend="torch"))
    assert "host" in plan_charts.plan_table(torch).columns  # offloaded layers sit on the host


def test_savings_text_counts_against_the_first_strategy():
    fits = small_plan()
    std, quant = fits[0], fits[2]
    text = plan_charts.savings_text(quant, fits)
    saved = std.cache.peak_bytes - quant.cache.peak_bytes
    assert text.startswith(f"Against standard it needs {human_gib(saved)} less cache at its peak")
    assert f"({saved / std.cache.peak_bytes:.0%} less)" in text
    assert f"{quant.sessions:,} concurrent sessions fit instead of {std.sessions:,}" in text
    assert "nothing saved" in plan_charts.savings_text(std, fits)


def test_parse_strategies_reads_one_canonical_spec_per_line_and_names_a_bad_line():
    text = "standard\n\n# a comment\nrotating:keep=4,max_size=64\nstandard\n"
    assert plan_charts.parse_strategies(text) == ["standard", "rotating:max_size=64,keep=4"]
    with pytest.raises(ValueError, match=r"strategy on line 2 \('ring'\): unknown strategy"):
        plan_charts.parse_strategies("standard\nring")
    assert plan_charts.parse_strategies(" \n# nothing\n") == []  # the page then plans the runtime's standard set


def test_evidence_table_lists_each_measured_point_with_its_confidence_interval():
    ev = Evidence("quantized:bits=4", "smollm2", "mlx", 4096, 1.0, 4, 0.05, 0.95, 0.01, 0.02, files=("a.csv", "b.csv"))
    table = plan_charts.evidence_table([ev])
    row = table.iloc[0]
    assert (row["strategy"], row["context"], row["samples"], row["mean KL"], row["± KL"], row["files"]) == (
        "quantized:bits=4",
        4096,
        4,
        0.05,
        0.01,
        "a.csv, b.csv",
    )


def test_quality_info_places_each_planned_lossy_strategy_on_the_evidence_it_is_judged_by():
    rings = [
        Evidence(f"rotating:max_size={n},keep=4", "smollm2", "mlx", 8192, n / 8192, 4, kl, 0.9, 0.01)
        for n, kl in ((256, 0.4), (1024, 0.08))
    ]
    fits = [replace(f, spec="rotating:max_size=4096,keep=4") for f in small_plan()[:1]]
    info = plan_charts.quality_info(rings, fits, 32768, "mlx")
    assert [(p.family, p.context, p.kept_fraction, p.mean_kl) for p in info.points] == [
        ("rotating keep=4", 8192, 1 / 32, 0.4),
        ("rotating keep=4", 8192, 1 / 8, 0.08),
    ]
    context = fits[0].cache.context
    assert info.targets == [("rotating keep=4", "rotating:max_size=4096,keep=4", min(1.0, 4096 / context))]
    fig = plan_charts.quality_figure(info).to_dict()
    assert [t["name"] for t in fig["data"]][:1] == ["rotating keep=4"]
