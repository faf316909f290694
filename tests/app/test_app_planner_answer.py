"""The Planner page's answer block is the CLI's, line for line, for the same request: the default
plan, a sessions target solved for ``max_kv_size``, and vLLM with fp8; the page starts from the
CLI's defaults; bad input keeps the previous answer under one error line; from 7 strategies on
the charts draw the ones picked."""

from __future__ import annotations

import re
import shlex

from app_helpers import MAIN, plotly_figures
from streamlit.testing.v1 import AppTest

from cachelib.cli import main as cli_main
from cachelib.plan.request import request_defaults

TIMEOUT = 60


def planner() -> AppTest:
    at = AppTest.from_file(str(MAIN), default_timeout=TIMEOUT)
    at.run()
    at.switch_page("views/planner.py").run()
    assert not at.exception
    return at


def _plain(markdown: str) -> str:
    return re.sub(r"\\(.)", r"\1", markdown.strip().removeprefix("**").removesuffix("**"))


def page_answer(at) -> list[str]:
    """The answer block's lines as the page shows them (markdown read back as text)."""
    shown = [m.value for m in at.markdown]
    start = next(i for i, m in enumerate(shown) if m.startswith("**answer:"))
    lines = [_plain(shown[start])]
    if at.code[0].value and not at.code[0].value.startswith("python -m cachelib plan"):
        lines.append(at.code[0].value)
    for block in shown[start + 1 :]:
        if block.startswith("**"):  # the header after the block
            break
        lines += [_plain(line) for line in block.split("  \n")]
    return lines


def plan_command(at) -> str:
    return next(c.value for c in at.code if c.value.startswith("python -m cachelib plan"))


def cli_answer(command: str, capsys) -> list[str]:
    """The block the CLI opens with, for the command the page shows."""
    assert cli_main(shlex.split(command)[3:]) == 0
    out = capsys.readouterr().out
    return [line.strip() for line in out.split("\n\n")[0].splitlines()]


def test_the_default_page_and_the_cli_print_the_same_answer(profiles_dir, capsys):
    at = planner()
    assert not at.error
    shown = page_answer(at)
    assert shown[0].startswith("answer: standard (no cache flag) on mlx-lm") and len(shown) >= 5
    assert shown == cli_answer(plan_command(at), capsys)


def test_sixteen_sessions_solved_for_max_kv_size_answer_as_the_cli_does_with_the_bits_beside(profiles_dir, capsys):
    at = planner()
    at.text_input(key="plan_context").set_value("8192")
    at.text_input(key="plan_prefill_chunk").set_value("512")
    at.text_input(key="plan_sessions").set_value("16")
    at.number_input(key="plan_max_kl").set_value(0.1)
    at.number_input(key="plan_min_agreement").set_value(0.9)
    at.radio(key="plan_solve").set_value("max_kv_size").run()
    assert not at.exception and not at.error
    command = plan_command(at)
    assert "--sessions 16 --solve max_kv_size" in command
    shown = page_answer(at)
    assert shown == cli_answer(command, capsys)
    assert "side by side, the same sessions:" in shown
    side = shown[shown.index("side by side, the same sessions:") + 1 :]
    assert side[0].startswith("rotating:max_size=") and "mean KL" in side[0]
    assert "no mlx-lm option for llama-3.1-8b" in side[0]  # mlx-lm's llama builds its own cache: no --max-kv-size
    assert side[1].startswith("quantized:bits=8 (--kv-bits 8") and "mean KL" in side[1]


def test_vllm_with_fp8_shows_its_command_and_no_backend_choice(profiles_dir, capsys):
    at = planner()
    at.selectbox(key="plan_runtime").set_value("vllm").run()
    assert "plan_backend" not in [r.key for r in at.radio]  # the runtime implies it
    at.selectbox(key="plan_kv_format").set_value("fp8").run()
    assert not at.error
    shown = page_answer(at)
    assert shown == cli_answer(plan_command(at), capsys)
    assert shown[1].startswith("vllm serve meta-llama/Llama-3.1-8B --max-model-len 32768 --kv-cache-dtype fp8")
    assert any(line.startswith("quality: ") and ("fp8" in line or "mean KL" in line) for line in shown)
    at.selectbox(key="plan_runtime").set_value("llama.cpp").run()  # fp8 is not one of its formats
    assert not at.exception and not at.error and at.selectbox(key="plan_kv_format").value == "dtype"
    assert page_answer(at)[1].startswith("llama-server -m meta-llama/Llama-3.1-8B.gguf -c ")


def test_the_page_starts_from_the_cli_s_defaults(profiles_dir):
    at = planner()
    d = request_defaults()
    assert at.number_input(key="plan_reserve").value * 2**30 == d["reserve_bytes"] == 0
    typed = {key: "" if d[key] is None else str(d[key]) for key in ("prefill_chunk", "batch", "sessions")}
    assert at.text_input(key="plan_prefill_chunk").value == typed["prefill_chunk"]  # whole numbers as typed
    assert at.text_input(key="plan_batch").value == typed["batch"]
    assert at.text_input(key="plan_sessions").value == typed["sessions"]
    assert at.number_input(key="plan_max_kl").value == d["max_kl"]
    assert at.number_input(key="plan_min_agreement").value == d["min_agreement"]
    assert at.checkbox(key="plan_suggest").value == d["suggest"]
    assert at.checkbox(key="plan_most_sessions").value == d["most_sessions"]
    assert at.radio(key="plan_device").value == d["device"]
    assert at.selectbox(key="plan_dtype").value == d["dtype"]


def test_bad_input_keeps_the_previous_answer_with_one_error_line(profiles_dir):
    at = planner()
    before = page_answer(at)
    at.number_input(key="plan_budget").set_value(10.0).run()  # below the weights
    assert len(at.error) == 1 and "below the weights" in at.error[0].value
    assert page_answer(at) == before
    at.text_area(key="plan_strategies").set_value("standard\nring").run()
    assert len(at.error) == 1 and "unknown strategy" in at.error[0].value
    assert page_answer(at) == before


def test_fifteen_strategies_are_charted_through_the_strategies_shown_picker(profiles_dir):
    at = planner()
    rings = [f"rotating:max_size={256 * k}" for k in range(1, 13)]
    specs = ["standard", *rings, "quantized:bits=8", "quantized:bits=4"]
    at.text_area(key="plan_strategies").set_value("\n".join(specs)).run()
    assert not at.exception and not at.error and len(at.dataframe[0].value) == 15
    picked = at.multiselect(key="plan_shown").value
    assert len(picked) == 6 and picked[0] == "standard"
    drawn = [
        t["name"] for f in plotly_figures(at) for t in f["data"] if t.get("mode") == "lines" and t.get("meta") != "peak"
    ]
    assert set(drawn) == set(picked)
    at.multiselect(key="plan_shown").set_value([*picked, "quantized:bits=4"]).run()
    drawn = {t["name"] for f in plotly_figures(at) for t in f["data"] if t.get("mode") == "lines"}
    assert "quantized:bits=4" in drawn


def test_a_device_picked_puts_the_speed_in_the_answer_as_the_cli_prints_it(profiles_dir, capsys):
    at = planner()
    at.selectbox(key="plan_hardware").set_value("m3-max").run()
    at.number_input(key="plan_min_tokens_per_s").set_value(20.0).run()
    assert not at.exception and not at.error
    command = plan_command(at)
    assert "--hardware m3-max --min-tokens-per-s 20" in command
    shown = page_answer(at)
    assert shown == cli_answer(command, capsys)
    speed = next(line for line in shown if line.startswith("speed on m3-max: "))
    assert "tokens/s per session" in speed and "(the interval's low end)" in speed
    # the answer's figures are the speed table's, for the answer's strategy and sessions
    strategy = shown[0].removeprefix("answer: ").split(" ")[0]
    row = next(r for r in at.dataframe if "tokens/s per session" in r.value.columns).value
    row = row[row.strategy == strategy].iloc[0]
    assert f"{row['tokens/s per session']:.1f} tokens/s per session ({row['interval']})" in speed
    assert f"at {row['sessions']} session" in speed
