"""The Planner in Chromium at 1400 x 900: the default plan's answer block is on screen without
scrolling, and with 15 strategies, all of them shown, no chart's plotting area is squeezed
below 300 px by its legend (plotly's own laid-out size, ``_fullLayout._size``)."""

from __future__ import annotations

import pytest
from test_browser import UI_TIMEOUT, _shoot, app_url, browser  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.browser, pytest.mark.slow]
PlaywrightTimeout = pytest.importorskip(
    "playwright.sync_api", reason="the playwright package is not installed"
).TimeoutError

SPECS = ["standard", *(f"rotating:max_size={256 * k}" for k in range(1, 13)), "quantized:bits=8", "quantized:bits=4"]
PLOT_AREAS = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(d => ({
  title: ((d._fullLayout || {}).title || {}).text || '',
  height: (d._fullLayout || {})._size ? d._fullLayout._size.h : 0, traces: (d.data || []).length}))"""


def test_the_answer_is_on_screen_and_fifteen_strategies_keep_every_chart_300_px(
    app_url,
    browser,
    tmp_path,  # noqa: F811
):
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.set_default_timeout(UI_TIMEOUT * 1000)
    page.goto(f"{app_url}/planner")
    block = page.locator(".st-key-plan_answer")
    block.get_by_text("mlx_lm.generate --model meta-llama/Llama-3.1-8B").wait_for()
    page.locator(".st-key-plan_frontier .js-plotly-plot").wait_for()
    box = block.bounding_box()
    assert page.evaluate("() => window.scrollY") == 0
    assert box["y"] >= 0 and box["y"] + box["height"] <= 900, box  # the whole block, without scrolling

    _shoot(page, tmp_path, "planner-answer")
    area = page.get_by_role("textbox", name="One spec per line")
    area.fill("\n".join(SPECS))
    area.press("Control+Enter")
    # the picker exists before the rerun too: wait for the new specs' chips, then open it; a rerun that
    # lands while the list is open closes it, so open it again until "Select all" can be clicked
    page.locator(".st-key-plan_shown").get_by_text(SPECS[1], exact=True).first.wait_for()
    for attempt in range(6):
        page.get_by_role("combobox", name="Strategies shown").click()
        try:
            page.get_by_role("option", name="Select all").click(timeout=10_000)
            break
        except PlaywrightTimeout:  # the list closed under a rerun
            page.keyboard.press("Escape")
    else:
        raise AssertionError("the Strategies shown list never stayed open long enough to pick Select all")
    page.keyboard.press("Escape")
    page.wait_for_function(
        "() => Array.from(document.querySelectorAll('.st-key-plan_memory .js-plotly-plot'))"
        ".some(d => (d.data || []).filter(t => t.meta === 'allocated').length === 15)"
    )
    page.wait_for_timeout(1000)
    assert page.locator("[data-testid='stException']").count() == 0
    charts = page.evaluate(PLOT_AREAS)
    assert len(charts) >= 2, charts
    for chart in charts:
        assert chart["height"] >= 300, chart
    _shoot(page, tmp_path, "planner-15")
