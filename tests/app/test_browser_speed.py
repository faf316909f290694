"""Stop, pressed in a real browser while the charts keep refreshing, is honoured at once: the
run ends at the next step boundary, keeps what it recorded, and says it was stopped.

(How fast the page is lives in ``bench/bench_app.py``; this checks behaviour only.) A Stop
button redrawn by every refresh of the polling fragment used to lose clicks: the element under
the pointer was replaced, and the run went on for many steps.
"""

from __future__ import annotations

import re

import pytest
from test_browser import app_url, browser  # noqa: F401  (fixtures: the server and Chromium)

from cachelib.profile import load_profile

pytestmark = [pytest.mark.browser, pytest.mark.slow]
TOKENS = 2048  # the slider's last value: far more steps than the run gets to
STOP_AT = 20


def _shown_step(page) -> int:
    text = page.evaluate("() => document.querySelector('[data-testid=stProgress]')?.innerText || ''")
    m = re.search(r"step (\d+)/", text)
    return int(m.group(1)) if m else -1


def test_stop_pressed_while_charts_refresh_ends_the_run_at_the_next_step(app_url, browser, tmp_path):  # noqa: F811
    page = browser.new_page(viewport={"width": 1440, "height": 1600})
    page.set_default_timeout(120_000)
    page.goto(app_url)
    page.locator(".st-key-run button").wait_for()
    page.get_by_role("combobox", name="Model").click()
    page.get_by_role("option", name="tiny-llama").click()
    slider = page.get_by_role("slider", name="Tokens to decode")
    slider.focus()
    slider.press("End")
    page.wait_for_function(
        f"() => document.querySelector('[data-testid=stSliderThumbValue]')?.innerText === '{TOKENS}'"
    )
    page.locator(".st-key-run button").click()
    page.wait_for_function(
        "() => "
        "{ const m = (document.querySelector('[data-testid=stProgress]')?.innerText || '').match(/step (\\d+)\\//);"
        f" return m && +m[1] >= {STOP_AT}; }}",
        polling=50,
    )
    page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length >= 4")  # refreshing charts
    shown = _shown_step(page)
    page.locator(".st-key-stop button").first.click()  # (Streamlit draws a button with help text twice)
    page.wait_for_function("() => document.querySelectorAll('.st-key-stop').length === 0")  # the run ended
    assert page.get_by_text("Traceback").count() == 0

    (saved,) = (tmp_path / "profiles").glob("*.csv")
    profile = load_profile(saved)
    steps = int(profile.meta["steps_completed"])
    assert profile.status == "incomplete" and f"stopped by request before step {steps}" in profile.meta["reason"]
    assert shown <= steps < TOKENS
    page.get_by_text(re.compile("stopped by request")).first.wait_for()  # the page says so too
