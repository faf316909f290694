"""The Planner's whole-number fields read what was typed (issue 30): ``1e12``, ``-5`` and ``abc``
each give one visible message naming the field and the allowed values, the previous answer stays
(marked as the last valid plan) and nothing is planned with the value the field showed before; a
valid value plans again."""

from __future__ import annotations

import re

import pytest
from app_helpers import MAIN
from streamlit.testing.v1 import AppTest

from app.keys import Keys

TIMEOUT = 60


@pytest.fixture(scope="module")
def at() -> AppTest:
    # one page for every case: each starts from a valid plan, and reruns are what is tested
    at = AppTest.from_file(str(MAIN), default_timeout=TIMEOUT)
    at.run()
    at.switch_page("views/planner.py").run()
    assert not at.exception and not at.error
    return at


def _errors(at) -> list[str]:
    return [re.sub(r"\\(.)", r"\1", e.value) for e in at.error]  # markdown read back as text


def _answer(at) -> str:
    return next(m.value for m in at.markdown if m.value.startswith("**answer:"))


@pytest.mark.parametrize(
    "key, label, typed, why",
    [
        ("plan_context", "Context (tokens)", "1e12", "is not a whole number in digits"),
        ("plan_sessions", "Sessions", "-5", "is out of range"),
        ("plan_batch", "Batch", "abc", "is not a whole number in digits"),
    ],
)
def test_a_bad_number_keeps_the_last_plan_under_one_message(at, key, label, typed, why):
    at.text_input(key="plan_context").set_value("8192")
    at.text_input(key="plan_sessions").set_value("")
    at.text_input(key="plan_batch").set_value("1").run()
    assert not at.exception and not at.error
    before, planned = _answer(at), at.session_state[Keys.PLANNER_LAST]
    assert "8,192 tokens" in before

    at.text_input(key=key).set_value(typed).run()
    assert not at.exception
    shown = repr(typed) if why.startswith("is not") else typed
    assert _errors(at) == [
        f"{label} = {shown} {why}; allowed: a whole number >= 1" + (" (empty: any)" if key == "plan_sessions" else "")
    ]
    assert at.text_input(key=key).value == typed  # the field shows what was typed, not a rounded or older value
    assert _answer(at) == before  # the previous answer, not one planned from another value
    assert at.session_state[Keys.PLANNER_LAST] is planned  # nothing was planned
    assert any(c.value.startswith("Showing the last valid plan") for c in at.caption)

    at.text_input(key=key).set_value("16" if key == "plan_sessions" else "4096" if key == "plan_context" else "2").run()
    assert not at.error and at.session_state[Keys.PLANNER_LAST] is not planned  # a valid value plans again


def test_whole_numbers_in_digits_are_read_as_typed(at):
    at.text_input(key="plan_batch").set_value("1").run()
    at.text_input(key="plan_sessions").set_value("").run()
    at.text_input(key="plan_context").set_value("1_000_000").run()
    assert not at.error
    assert at.session_state[Keys.PLANNER_LAST].result.request.context == 1_000_000
    assert "1,000,000 tokens" in _answer(at)


def test_a_bad_chart_range_draws_no_chart_and_says_why(at):
    at.text_input(key="plan_context").set_value("8192").run()
    drawn = len(at.get("plotly_chart"))
    at.text_input(key="plan_range").set_value("1e12").run()
    assert _errors(at) == [
        "Charts up to (tokens) = '1e12' is not a whole number in digits; allowed: a whole number >= 1 "
        "(empty: 2 x context, at most the model's)"
    ]
    assert len(at.get("plotly_chart")) == drawn - 2  # the memory and frontier charts
    at.text_input(key="plan_range").set_value("").run()
    assert not at.error and len(at.get("plotly_chart")) == drawn
