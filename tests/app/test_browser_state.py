"""What a user sets stays set, what the app refuses it says beside the field, and many series stay
readable, in headless Chromium against a real ``streamlit run``.

- strategies set on Live comparison survive a visit to the Planner; a duplicated row is refused
  with one line and Run is off; ``1e12``, ``-5`` and ``abc`` in a knob each give one visible
  message and Run off;
- a finished run's status line keeps its own duration and speed after a page change;
- with both committed example profiles loaded (15 series), every Quality and Speed plot area is at
  least 300 px wide and every series has a legend entry inside its figure;
- at 800 px no chart title lies under plotly's toolbar (Profiles and Inspector).
"""

from __future__ import annotations

import re

import pytest
from test_browser import ROOT, START_TIMEOUT, UI_TIMEOUT, app_url, browser  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

EXAMPLES = ROOT / "profiles" / "examples"
RUN_TIMEOUT = 240


def _open(browser, url: str, width: int = 1440):  # noqa: F811
    page = browser.new_page(viewport={"width": width, "height": 1400})
    page.set_default_timeout(UI_TIMEOUT * 1000)
    page.goto(url)
    return page


def _visible_errors(page, mentioning: str | None = None) -> list[str]:
    """The error boxes shown; with ``mentioning``, once one mentions it (or none shows, when "")."""
    if mentioning is not None:
        script = (
            "(m) => { const e = Array.from(document.querySelectorAll('[data-testid=stAlertContentError]'))"
            ".filter(e => e.getBoundingClientRect().width > 0);"
            " return m === '' ? e.length === 0 : e.some(x => x.innerText.includes(m)); }"
        )
        try:
            page.wait_for_function(script, arg=mentioning, timeout=20_000)
        except Exception:  # noqa: BLE001 (a timeout: report what the page shows)
            pass
    return page.evaluate(
        "() => Array.from(document.querySelectorAll('[data-testid=stAlertContentError]'))"
        ".filter(e => e.getBoundingClientRect().width > 0).map(e => e.innerText.trim())"
    )


def _type(page, key: str, text: str) -> None:
    box = page.locator(f".st-key-{re.sub(r'[^A-Za-z0-9_-]', '-', key)} input")
    box.fill(text)
    box.press("Enter")
    page.wait_for_timeout(1200)  # the rerun the field caused


def _chosen(page, key: str) -> str:
    """The option a select box shows."""
    script = """(k) => { const el = document.querySelector(`.st-key-${k}`);
      const input = el.querySelector('input');
      const shown = el.querySelector('[data-baseweb=select]');
      return (input && input.value) || (shown ? shown.innerText.trim().split('\\n')[0] : ''); }"""
    return page.evaluate(script, key)


def _run_disabled(page, expected: bool) -> bool:
    """Whether Run is off, once it reads ``expected`` (or the wait ran out: the page settled otherwise)."""
    script = "(want) => Array.from(document.querySelectorAll('.st-key-run button')).every(b => b.disabled === want)"
    try:
        page.wait_for_function(script, arg=expected, timeout=20_000)
    except Exception:  # noqa: BLE001 (a timeout: report what the page shows)
        pass
    return page.locator(".st-key-run button").first.is_disabled()


def test_settings_survive_a_page_change_and_bad_fields_turn_run_off(app_url, browser):  # noqa: F811
    page = _open(browser, app_url)
    page.locator(".st-key-run button").wait_for(timeout=START_TIMEOUT * 1000)
    page.locator(".st-key-strategy_1_name").get_by_role("combobox").click()
    page.get_by_role("option", name="h2o", exact=True).click()
    page.locator(".st-key-strategy_1_h2o-budget input").wait_for()
    _type(page, "strategy_1_h2o.budget", "32")
    assert _visible_errors(page, "") == []

    page.get_by_role("link", name="Planner").click()
    page.get_by_text("One spec per line").wait_for()
    page.get_by_role("link", name="Live comparison").click()
    page.locator(".st-key-strategy_1_h2o-budget input").wait_for()
    assert [_chosen(page, f"strategy_{i}_name") for i in range(3)] == ["standard", "h2o", "quantized"]
    assert page.locator(".st-key-strategy_1_h2o-budget input").input_value() == "32"

    # A duplicated row: one line in its row, Run off until a knob differs.
    page.locator(".st-key-strategy_1_dup button").first.click()
    errors = _visible_errors(page, "repeats strategy 2")
    assert len(errors) == 1 and "repeats strategy 2" in errors[0], errors
    assert _run_disabled(page, True)
    _type(page, "strategy_3_h2o.budget", "48")
    assert _visible_errors(page, "") == [] and not _run_disabled(page, False)

    # Whole numbers as typed: one visible message beside the field, Run off, for each bad entry.
    for typed in ("1e12", "-5", "abc"):
        _type(page, "strategy_3_h2o.budget", typed)
        errors = _visible_errors(page, typed)
        assert len(errors) == 1 and typed in errors[0] and "allowed: a whole number" in errors[0], errors
        assert _run_disabled(page, True)
    _type(page, "strategy_3_h2o.budget", "48")
    assert not _run_disabled(page, False)


def test_a_finished_runs_status_line_keeps_its_duration_after_a_page_change(app_url, browser):  # noqa: F811
    page = _open(browser, app_url)
    page.locator(".st-key-run button").wait_for(timeout=START_TIMEOUT * 1000)
    page.locator(".st-key-model").get_by_role("combobox").click()
    page.get_by_role("option", name="tiny-llama", exact=True).click()
    page.wait_for_timeout(1500)
    page.locator(".st-key-run button").click()
    status = page.get_by_text(re.compile(r"^step 64/64 · [\d.]+ s in all"))
    status.wait_for(timeout=RUN_TIMEOUT * 1000)
    line = status.inner_text()
    page.get_by_role("link", name="Planner").click()
    page.get_by_text("One spec per line").wait_for()
    page.wait_for_timeout(3000)  # the clock would have run on by now
    page.get_by_role("link", name="Live comparison").click()
    again = page.get_by_text(re.compile(r"^step 64/64 · [\d.]+ s in all"))
    again.wait_for()
    assert again.inner_text().split(" · ")[:3] == line.split(" · ")[:3], (line, again.inner_text())


PLOTS = """(keys) => keys.map(k => {
  const d = document.querySelector(`.st-key-${k} .js-plotly-plot`);
  if (!d) return null;
  const box = d.getBoundingClientRect();
  const shown = (d.data || []).filter(t => t.showlegend !== false && t.name).map(t => t.name);
  const legend = Array.from(d.querySelectorAll('.legend .traces')).filter(t => {
    const b = t.getBoundingClientRect();
    return b.width > 0 && b.top >= box.top - 1 && b.bottom <= box.bottom + 1
      && b.left >= box.left - 1 && b.right <= box.right + 1;
  }).map(t => t.textContent);
  return {key: k, width: d._fullLayout._size.w, height: d._fullLayout._size.h, shown, legend};
})"""


def test_two_example_profiles_leave_every_plot_wide_with_every_series_in_its_legend(
    app_url,
    browser,
    tmp_path,  # noqa: F811
):
    folder = tmp_path / "profiles"
    folder.mkdir(exist_ok=True)
    for f in EXAMPLES.glob("*.csv"):
        (folder / f.name).write_bytes(f.read_bytes())
    page = _open(browser, f"{app_url}/profiles")
    for name in ("smollm2-mlx-256t.csv", "smollm2-torch-256t.csv"):
        page.get_by_role("combobox", name="Compare").click(timeout=START_TIMEOUT * 1000)
        page.get_by_role("option", name=name).click()
        page.keyboard.press("Escape")
        page.wait_for_timeout(1500)
    # both plots drawn (a rerun under load can still be replacing one when the other is there)
    keys = ["compare_quality", "compare_speed"]
    page.wait_for_function(f"() => ({PLOTS})({keys!r}).every(p => p !== null && p.width > 0)", timeout=120_000)
    page.wait_for_timeout(2000)
    page.wait_for_function(f"() => ({PLOTS})({keys!r}).every(p => p !== null && p.width > 0)", timeout=60_000)
    plots = page.evaluate(PLOTS, keys)
    for p in plots:
        assert p is not None and p["width"] >= 300, p
        assert p["shown"] and sorted(p["shown"]) == sorted(p["legend"]), p
    # The summary table of the 15 strategies: every column in view at 1,440 px, no sideways scroll.
    scroll = page.evaluate(
        "() => { const s = Array.from(document.querySelectorAll('[data-testid=stDataFrame] "
        ".dvn-scroller')).pop(); return s ? [s.scrollWidth, s.clientWidth] : null; }"
    )
    assert scroll is not None and scroll[0] <= scroll[1] + 1, scroll
    quality = plots[0]
    assert any(s.endswith("/ sliding:window=64") for s in quality["legend"])  # the worst series, in view
    assert len(quality["shown"]) >= 13


TITLE_UNDER_TOOLBAR = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).flatMap(d => {
  const bar = d.querySelector('.modebar');
  const title = d.querySelector('.gtitle');
  if (!bar || !title) return [];
  const a = bar.getBoundingClientRect(), b = title.getBoundingClientRect();
  const overlap = a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom;
  const where = r => `${r.left | 0}..${r.right | 0} x ${r.top | 0}..${r.bottom | 0}`;
  return overlap ? [`${title.textContent.slice(0, 40)}: title ${where(b)}, toolbar ${where(a)}`] : [];
})"""


def test_at_800_px_no_chart_title_is_under_the_toolbar(app_url, browser, tmp_path):  # noqa: F811
    folder = tmp_path / "profiles"
    folder.mkdir(exist_ok=True)
    (folder / "smollm2-mlx-256t.csv").write_bytes((EXAMPLES / "smollm2-mlx-256t.csv").read_bytes())
    page = _open(browser, f"{app_url}/profiles", width=800)
    page.get_by_role("combobox", name="Compare").click(timeout=START_TIMEOUT * 1000)
    page.get_by_role("option", name="smollm2-mlx-256t.csv").click()
    page.keyboard.press("Escape")
    page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length === 4", timeout=120_000)
    page.wait_for_timeout(1500)
    for d in page.locator(".js-plotly-plot").all():
        d.hover()  # the toolbar shows on hover
    assert page.evaluate(TITLE_UNDER_TOOLBAR) == []
    page.get_by_role("link", name="Inspector").click()
    page.locator(".st-key-insp_ring .js-plotly-plot").wait_for(timeout=120_000)
    page.wait_for_timeout(2000)
    for d in page.locator(".js-plotly-plot").all():
        d.hover()
    assert page.evaluate(TITLE_UNDER_TOOLBAR) == []
