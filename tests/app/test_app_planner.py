"""The Planner page through Streamlit's AppTest: the default plan, the frontier following the
budget, bad input, and the recommendation from profiles in the app's folder, all equal to what
the planner library and ``python -m cachelib plan`` give for the same inputs."""

from __future__ import annotations

import csv
import json
import re
import shlex

import pandas as pd
import pytest
from app_helpers import MAIN, plotly_figures
from streamlit.testing.v1 import AppTest

from cachelib.cli import main as cli_main
from cachelib.core.units import human_gib  # the planner counts device memory in GiB
from cachelib.plan import GiB as GB
from cachelib.plan import PlanRequest, cache_budget, max_batch, plan, plan_request, preset
from cachelib.plan.answer import default_strategies
from cachelib.profile.evidence import load_evidence

TIMEOUT = 60
DEFAULT_SPECS = list(default_strategies("mlx-lm"))  # the page opens on mlx-lm: its standard set
LLAMA = preset("llama-3.1-8b")


def planner() -> AppTest:
    at = AppTest.from_file(str(MAIN), default_timeout=TIMEOUT)
    at.run()
    at.switch_page("views/planner.py").run()
    assert not at.exception
    return at


def plan_command(at) -> str:
    """The ``python -m cachelib plan`` command the page shows (the answer's command comes first)."""
    return next(c.value for c in at.code if c.value.startswith("python -m cachelib plan"))


def errors(at) -> list[str]:
    return [e.value for e in at.error]


def figures(at) -> dict[str, dict]:
    """The page's figures by their title's first words (the retrieval heatmap where the evidence has trials)."""
    out = {}
    for fig in plotly_figures(at):
        title = fig["layout"]["title"]["text"]
        kind = (
            "frontier"
            if title.startswith("Fit frontier")
            else "quality"
            if title.startswith("Quality")
            else "retrieval"
            if title.startswith("Retrieval")
            else "memory"
        )
        out[kind] = fig
    return out


def cli_table(command: str, capsys, *extra: str) -> tuple[list[dict[str, str]], str]:
    """Run the command the page shows; its table as {column: cell} per row, and all it printed."""
    assert cli_main([*shlex.split(command)[3:], *extra]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("strategy"))
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip() or line.startswith("evidence:"):
            break
        rows.append(line)
    names = re.split(r"\s{2,}", lines[start].strip())
    return [dict(zip(names, re.split(r"\s{2,}", r.strip()))) for r in rows], out


def same_as_cli(shown: pd.DataFrame, cli: list[dict[str, str]]) -> None:
    assert len(cli) and shown["strategy"].tolist() == [r["strategy"] for r in cli]
    for (_, ours), theirs in zip(shown.iterrows(), cli):
        for col in (
            "allocated",
            "used",
            "peak",
            "per token",
            "fits",
            "headroom",
            "budget needed",
            "mean KL",
            "top-1",
            "activations",
        ):
            if col in theirs:
                expected = "–" if theirs[col] == "-" else theirs[col]  # no value
                assert ours[col] == expected, (ours["strategy"], col)
        assert (
            ours["max batch"] == f"{int(theirs['max batch']):,}" and ours["sessions"] == f"{int(theirs['sessions']):,}"
        )


def traces(fig: dict) -> dict[str, dict]:
    return {t["name"]: t for t in fig["data"] if t.get("mode") == "lines" and t.get("meta") != "peak"}


def test_default_page_plans_llama_against_24_gb_with_the_librarys_numbers_as_the_cli_prints_them(profiles_dir, capsys):
    at = planner()
    assert not errors(at)
    table = at.dataframe[0].value
    request = PlanRequest(DEFAULT_SPECS, context=32768, runtime="mlx-lm", budget_bytes=24 * GB)  # the CLI's defaults
    expected = plan(LLAMA, request)
    assert table["strategy"].tolist() == DEFAULT_SPECS  # only what was asked: no candidates unless suggested
    assert table["peak"].tolist() == [human_gib(f.cache.peak_bytes) for f in expected]
    assert table["max batch"].tolist() == [f"{f.max_batch:,}" for f in expected]
    assert table["sessions"].tolist() == [f"{f.sessions:,}" for f in expected]
    assert table["max context"].tolist() == [f"{f.max_context:,}" for f in expected]
    assert table["limited by"].tolist() == ["memory"] * 3  # mlx-lm's quantized attention materialises scores
    result = plan_request(LLAMA, request, load_evidence().points)
    assert f"{human_gib(result.cache_budget)} for the cache and activations" in " ".join(m.value for m in at.markdown)
    assert "sessions can exceed the max batch" in " ".join(c.value for c in at.caption)
    # the answer first: the lossless standard fits, in mlx-lm's own command
    assert at.markdown[0].value == "**answer: standard (no cache flag) on mlx-lm for llama-3.1-8b at 32,768 tokens**"
    assert at.code[0].value == "mlx_lm.generate --model meta-llama/Llama-3.1-8B"

    figs = figures(at)
    assert {"memory", "frontier"} <= set(figs)
    frontier = traces(figs["frontier"])
    assert list(frontier)[: len(DEFAULT_SPECS)] == DEFAULT_SPECS
    at_context = frontier["standard"]["x"].index(32768)
    # two sessions of 32,768 tokens: mlx-lm's generate_step computes no prefill chunk's logits
    assert frontier["standard"]["y"][at_context] == expected[0].max_batch == 2
    assert frontier["quantized:bits=4"]["y"][at_context] == expected[2].max_batch
    assert list(traces(figs["memory"]))[: len(DEFAULT_SPECS)] == DEFAULT_SPECS
    same_as_cli(table, cli_table(plan_command(at), capsys)[0])


def test_with_no_evidence_picked_there_is_no_recommendation(profiles_dir):
    at = planner()
    at.multiselect(key="plan_evidence").set_value([]).run()
    assert not at.exception and not errors(at)
    assert any("No evidence picked" in c.value for c in at.caption)
    assert at.dataframe[0].value["strategy"].tolist() == DEFAULT_SPECS
    assert at.markdown[0].value.startswith("**answer: standard")  # lossless: judged without evidence


def test_changing_the_budget_moves_the_frontier_and_the_inputs_survive_a_page_visit(profiles_dir):
    at = planner()
    before = traces(figures(at)["frontier"])["quantized:bits=4"]
    at.number_input(key="plan_budget").set_value(40.0).run()
    assert not at.exception and not errors(at)
    after = traces(figures(at)["frontier"])["quantized:bits=4"]
    available = cache_budget(40 * GB, LLAMA.num_params * 2, 0)
    assert after["x"] == before["x"]
    request = PlanRequest(["quantized:bits=4"], context=32768, prefill_chunk=2048)
    assert after["y"] == [
        max_batch(
            LLAMA,
            "quantized:bits=4",
            available,
            context=n,
            prefill_chunk=2048,
            deployment=request.deployment,
            row_bytes=request.forward_bytes(LLAMA, request.strategies[0], context=n, batch=1)[0],
        )
        for n in after["x"]
    ]
    assert all(a >= b for a, b in zip(after["y"], before["y"])) and after["y"] != before["y"]
    budget_line = [s for s in figures(at)["memory"]["layout"]["shapes"] if s["y0"] == s["y1"]]
    assert budget_line[0]["y0"] == pytest.approx(available / GB)
    assert at.dataframe[0].value["max batch"].tolist()[2] == f"{int(after['y'][after['x'].index(32768)]):,}"

    at.radio(key="plan_measure").set_value("sessions").run()
    assert "concurrent sessions" in figures(at)["frontier"]["layout"]["title"]["text"]
    at.switch_page("views/live.py").run()
    at.switch_page("views/planner.py").run()
    assert at.number_input(key="plan_budget").value == 40.0
    assert at.radio(key="plan_measure").value == "sessions"


def test_bad_input_shows_the_librarys_message_and_keeps_the_previous_plan(profiles_dir, tmp_path):
    at = planner()
    shown = at.dataframe[0].value

    charts = len(at.get("plotly_chart"))

    def check(message: str) -> None:
        assert not at.exception
        assert errors(at) == [message]
        assert at.dataframe[0].value.equals(shown) and len(at.get("plotly_chart")) == charts
        assert "Showing the last valid plan." in [c.value for c in at.caption]

    at.text_area(key="plan_strategies").set_value("standard\nrotating:max_size=0").run()
    check("strategy on line 2 ('rotating:max_size=0'): rotating: knob 'max_size' = 0 must be >= 1")
    at.text_area(key="plan_strategies").set_value("\n".join(DEFAULT_SPECS)).run()
    assert not errors(at)

    at.number_input(key="plan_budget").set_value(10.0).run()
    check(
        "budget 10.00 GiB per device is below the weights on one device (14.96 GiB): nothing is left for the cache; "
        "raise the budget, quantize the weights (--weights-dtype) or split them (--tp, --pp)"
    )
    at.number_input(key="plan_budget").set_value(24.0).run()

    at.text_area(key="plan_strategies").set_value("standard\noffloaded").run()
    check("strategy 'offloaded' is not available on mlx; it runs on: torch")
    at.text_area(key="plan_strategies").set_value("\n".join(DEFAULT_SPECS)).run()

    at.selectbox(key="plan_model").set_value(at.selectbox(key="plan_model").options[-1]).run()  # a config.json
    check("give the path of a config.json (or of the folder holding it)")
    missing = tmp_path / "no-such" / "config.json"
    at.text_input(key="plan_config").set_value(str(missing)).run()
    check(f"model config '{missing}' not found (give a config.json or a folder holding one)")
    partial = tmp_path / "config.json"
    partial.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    at.text_input(key="plan_config").set_value(str(partial)).run()
    check(
        f"{partial}: config is missing required field(s): num_hidden_layers, num_attention_heads (model_type 'llama')"
    )


def test_recommendation_comes_from_the_evidence_picked_as_the_cli_gives_it(
    profiles_dir, tiny_profiles, tmp_path, capsys
):
    for name in ("tiny-complete.csv", "tiny-stopped.csv"):  # only what is picked counts
        (profiles_dir / name).write_bytes((tiny_profiles / name).read_bytes())
    at = planner()
    picked = str(profiles_dir / "tiny-complete.csv")
    assert picked in at.multiselect(key="plan_evidence").options
    at.multiselect(key="plan_evidence").set_value([picked])
    at.selectbox(key="plan_model").set_value("tiny-llama")
    at.text_input(key="plan_context").set_value("2048")
    at.text_area(key="plan_strategies").set_value("standard\nquantized:bits=8")
    at.number_input(key="plan_budget").set_value(1.0)
    at.number_input(key="plan_weights").set_value(0.01)
    at.number_input(key="plan_reserve").set_value(0.0)
    at.number_input(key="plan_max_kl").set_value(100.0)
    at.number_input(key="plan_min_agreement").set_value(None).run()
    assert not at.exception and not errors(at)

    arch = preset("tiny-llama")
    evidence = load_evidence([picked])
    request = PlanRequest(
        ["standard", "quantized:bits=8"],
        context=2048,
        budget_bytes=GB,
        weights_bytes=round(0.01 * GB),
        max_kl=100.0,
        runtime="mlx-lm",
    )
    result = plan_request(arch, request, evidence.points)
    rec = result.recommendation
    # the lossless standard serves the request: it is the answer, whatever the evidence says of the others
    assert rec.fit.spec == "standard" and rec.fit is result.choice.fit
    assert at.markdown[0].value.startswith("**answer: standard (no cache flag) on mlx-lm for tiny-llama")
    at.toggle(key="plan_show_evidence").set_value(True).run()

    table = at.dataframe[0].value
    assert table["strategy"].tolist() == [f.spec for f in result.fits]
    terms = at.dataframe[1].value  # what "fits" counted for the first strategy, term by term
    assert terms["term"].tolist() == ["weights", "cache peak", "activations peak", "runtime overhead", "reserve"]
    assert terms["bytes"].tolist() == [human_gib(n) for _, n, _ in result.fits[0].device.terms()]
    evidence_table = at.dataframe[2].value
    assert set(evidence_table["files"]) == {"tiny-complete.csv"}

    # The command the page shows prints the same table and recommendation, and its CSV the exact bytes.
    out = tmp_path / "plan.csv"
    command = plan_command(at)
    assert "--no-default-evidence" in command and "tiny-complete.csv" in command
    cli, printed = cli_table(command, capsys, "--csv", str(out))
    same_as_cli(table, cli)
    assert f"recommendation: {rec.text}" in printed
    with open(out, newline="") as fh:
        exact = {r["strategy"]: int(r["peak_bytes"]) for r in csv.DictReader(fh)}
    assert exact == {f.spec: f.cache.peak_bytes for f in result.fits}

    at.number_input(key="plan_max_kl").set_value(None).run()
    assert not errors(at) and at.markdown[0].value.startswith("**answer: standard")


@pytest.mark.parametrize("context", [10**8, 10**12])
def test_a_context_far_past_the_models_length_plans_promptly_with_a_warning(profiles_dir, capsys, context):
    # the page hung at 10^8 tokens (no answer in 10 minutes) while the CLI answered (issue 17, item 10);
    # a hang fails the run's own timeout, and how long the page takes is bench/bench_planner.py's figure
    at = planner()
    at.multiselect(key="plan_evidence").set_value([]).run()  # the bytes only: no evidence to read
    at.text_input(key="plan_context").set_value(str(context)).run(timeout=TIMEOUT)
    assert not at.exception and not errors(at)
    warned = [w.value for w in at.warning]
    assert any(f"context {context:,} is past llama-3.1-8b's limit of 131,072" in w for w in warned), warned
    table = at.dataframe[0].value
    request = PlanRequest(DEFAULT_SPECS, context=context, runtime="mlx-lm", budget_bytes=24 * GB)
    assert table["peak"].tolist() == [human_gib(f.cache.peak_bytes) for f in plan(LLAMA, request)]
    memory = traces(figures(at)["memory"])["standard"]
    assert context in memory["x"] and max(memory["x"]) == 2 * context
    command = plan_command(at)
    assert cli_main([*shlex.split(command)[3:]]) == 0  # the CLI says it too
    said = capsys.readouterr()
    assert f"warning: context {context:,} is past llama-3.1-8b's limit of 131,072" in said.err


def test_runtime_and_parallelism_fields_plan_one_device_and_name_a_split_the_runtime_refuses(profiles_dir, capsys):
    at = planner()
    at.selectbox(key="plan_model").set_value("llama-3.1-70b")
    at.selectbox(key="plan_runtime").set_value("vllm").run()  # its fields show: tensor parallel, fp8
    at.text_input(key="plan_tp").set_value("8")
    at.number_input(key="plan_budget").set_value(80.0)
    at.text_area(key="plan_strategies").set_value("standard").run()
    assert not at.exception and not errors(at)
    table = at.dataframe[0].value
    request = PlanRequest(["standard"], context=32768, runtime="vllm", tp=8, budget_bytes=80 * GB)
    [fit] = plan(preset("llama-3.1-70b"), request)
    assert fit.cache.bytes_per_token == 40_960  # 8 KV heads over 8 ranks: one per GPU
    assert table["allocated"].tolist()[0] == human_gib(fit.cache.bytes_allocated)
    assert table["all devices"].tolist()[0] == human_gib(8 * fit.cache.bytes_allocated)
    assert "--runtime vllm" in plan_command(at) and "--tp 8" in plan_command(at)
    vllm = "vllm serve meta-llama/Llama-3.1-70B --max-model-len 32768 --gpu-memory-utilization 0.9 -tp 8"
    assert at.code[0].value == vllm  # the answer in vLLM's own flags
    assert "plan_backend" not in [r.key for r in at.radio]  # a runtime implies its backend
    same_as_cli(table.iloc[:1], cli_table(plan_command(at), capsys)[0][:1])

    at.selectbox(key="plan_model").set_value("qwen2.5-7b").run()  # 28 attention heads
    assert errors(at) == [
        "tp=8: vllm requires the attention heads (28 in qwen2.5-7b) divisible by the tensor-parallel size; "
        "allowed: 1, 2, 4, 7, 14, 28"
    ]
