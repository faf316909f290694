"""What the Live page keeps and refuses (AppTest): settings survive a visit to another page,
whole-number fields read exactly what was typed, a repeated strategy is refused before Run, and
a finished run's status line keeps its own duration."""

from __future__ import annotations

import re
import time

import pytest
from app_helpers import MAIN, finish_run
from streamlit.testing.v1 import AppTest

from app.keys import Keys
from app.widgets import parse_int

TIMEOUT = 180


def new_app() -> AppTest:
    at = AppTest.from_file(str(MAIN), default_timeout=TIMEOUT)
    at.run()
    assert not at.exception
    return at


def errors(at) -> list[str]:
    return [re.sub(r"\\(.)", r"\1", e.value) for e in at.error]


def test_strategies_probes_and_inputs_survive_a_visit_to_other_pages(profiles_dir):
    at = new_app()
    at.selectbox(key="strategy_1_name").set_value("h2o").run()
    at.text_input(key="strategy_1_h2o.budget").set_value("32").run()
    at.selectbox(key="strategy_2_quantized.bits").set_value(8)
    at.text_area(key="prompt").set_value("Why is the sky blue?")
    at.slider(key="max_tokens").set_value(12)
    at.text_input(key=Keys.probe("masks")).set_value("4")
    at.checkbox(key="one_by_one").check().run()
    for page in ("views/planner.py", "views/profiles.py", "views/inspector.py"):
        at.switch_page(page).run()
        assert not at.exception
    at.switch_page("views/live.py").run()
    assert not at.exception and not errors(at)
    assert at.selectbox(key="strategy_0_name").value == "standard"
    assert at.selectbox(key="strategy_1_name").value == "h2o"
    assert at.text_input(key="strategy_1_h2o.budget").value == "32"
    assert at.selectbox(key="strategy_2_name").value == "quantized"
    assert at.selectbox(key="strategy_2_quantized.bits").value == 8
    assert at.text_area(key="prompt").value == "Why is the sky blue?"
    assert at.slider(key="max_tokens").value == 12
    assert at.text_input(key=Keys.probe("masks")).value == "4"
    assert at.checkbox(key="one_by_one").value


@pytest.mark.parametrize("typed", ["1e12", "-5", "abc", "10000000000000"])
@pytest.mark.parametrize("field", ["strategy_1_rotating.max_size", Keys.probe("memory")])
def test_a_whole_number_field_refuses_what_it_cannot_use_beside_the_field_and_run_is_off(profiles_dir, field, typed):
    at = new_app()
    at.text_input(key=field).set_value(typed).run()
    assert not at.exception
    shown = errors(at)
    assert len(shown) == 1 and "allowed: a whole number" in shown[0] and typed in shown[0]
    assert at.button(key="run").disabled
    assert Keys.LIVE not in at.session_state and not list(profiles_dir.iterdir())
    at.text_input(key=field).set_value("32").run()
    assert not errors(at) and not at.button(key="run").disabled


def test_parse_int_reads_digits_only_and_names_the_range():
    assert parse_int("64", 1, 100) == 64 and parse_int(" 1_000 ", 0) == 1000 and parse_int("", 0, empty="off") is None
    for typed, says in (
        ("1e12", "not a whole number in digits"),
        ("2.0", "not a whole number"),
        ("-5", "out of range"),
        ("", "is empty"),
        ("101", "out of range"),
    ):
        with pytest.raises(ValueError, match=says) as e:
            parse_int(typed, 0, 100, what="max_size")
        assert "allowed: a whole number from 0 to 100" in str(e.value)


def test_a_repeated_strategy_is_refused_in_its_row_and_run_is_off(profiles_dir):
    at = new_app()
    at.button(key="strategy_1_dup").click().run()
    assert errors(at) == [
        "strategy 3 (rotating:max_size=64,keep=4) repeats strategy 2: a run compares each strategy once; "
        "change a knob or remove the copy"
    ]
    assert at.button(key="run").disabled
    at.text_input(key="strategy_3_rotating.max_size").set_value("32").run()
    assert not errors(at) and not at.button(key="run").disabled
    # The same cache written two ways (a knob at its default) is a repeat too.
    at.text_input(key="strategy_3_rotating.max_size").set_value("64")
    at.text_input(key="strategy_3_rotating.keep").set_value("").run()
    assert len(errors(at)) == 1 and "repeats strategy 2" in errors(at)[0]


def test_a_finished_runs_status_line_keeps_its_own_duration(profiles_dir):
    at = new_app()
    at.selectbox(key="model").set_value("tiny-llama").run()
    at.slider(key="max_tokens").set_value(6)
    at.button(key="run").click().run()
    finish_run(at)
    run = at.session_state[Keys.LIVE]
    line = next(c.value for c in at.caption if c.value.startswith("step 6/6"))
    assert "in all" in line and "steps/s" in line
    time.sleep(1.5)
    at.switch_page("views/planner.py").run()
    at.switch_page("views/live.py").run()
    again = next(c.value for c in at.caption if c.value.startswith("step 6/6"))
    assert again.split(" · ")[:3] == line.split(" · ")[:3]  # steps, seconds, steps/s: unchanged
    seconds = float(re.search(r"([\d.]+) s in all", line).group(1))
    assert seconds == pytest.approx(run.ended_at, abs=0.06)


def test_planner_inputs_survive_a_visit_to_the_live_page():
    at = new_app()
    at.switch_page("views/planner.py").run()
    at.text_input(key="plan_context").set_value("8192")
    at.text_area(key="plan_strategies").set_value("standard\nrotating:max_size=1024,keep=4").run()
    assert not at.exception
    at.switch_page("views/live.py").run()
    at.switch_page("views/planner.py").run()
    assert at.text_input(key="plan_context").value == "8192"
    assert at.text_area(key="plan_strategies").value == "standard\nrotating:max_size=1024,keep=4"
