"""The figures in a real browser (``streamlit run`` + headless Chromium, as in test_browser.py),
checked on the data plotly drew and on element bounding boxes, not on pixels:

- the Inspector's temporal mask of a ring past its size draws the evicted positions as evicted;
- the committed example profile (memory probe every 4th step) draws visible memory lines;
- a 12-strategy profile draws 12 distinct colours, and no legend lies over a plot area.

The profiles are real runs of the tiny-llama preset (random weights, fast) and the committed example.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_browser import UI_TIMEOUT, _shoot, app_url, browser  # noqa: F401  (fixtures)

from app import inspector_charts as ic
from cachelib.profile import Probes, load_profile, run_profile

pytestmark = [pytest.mark.browser, pytest.mark.slow]
PlaywrightTimeout = pytest.importorskip(
    "playwright.sync_api", reason="the playwright package is not installed"
).TimeoutError
PlaywrightTimeout = pytest.importorskip(
    "playwright.sync_api", reason="the playwright package is not installed"
).TimeoutError

ROOT = Path(__file__).resolve().parents[2]
FIRST_PAGE_TIMEOUT = 240
EXAMPLE = ROOT / "profiles" / "examples" / "smollm2-mlx-256t.csv"
RING = "rotating:max_size=16,keep=2"
TWELVE = [
    "standard",
    "rotating:max_size=16,keep=2",
    "rotating:max_size=24,keep=4",
    "rotating:max_size=32,keep=0",
    "quantized:bits=8,group_size=32",
    "quantized:bits=4,group_size=32",
    "quantized:bits=4,group_size=32,start=8",
    "kivi:bits=2,group_size=32,residual=32",
    "chunked:chunk_size=16",
    "static:max_len=128",
    "sliding:window=16",
    "concat",
]


@pytest.fixture(scope="session")
def twelve_profile(tmp_path_factory, load_model):
    """A real 12-strategy run of the tiny-llama preset (16 tokens)."""
    out = tmp_path_factory.mktemp("twelve") / "twelve.csv"
    run_profile(
        load_model("tiny-llama", "mlx"),
        TWELVE,
        prompt="Hello there",
        max_tokens=16,
        probes=Probes(),
        out=out,
        name="twelve",
    )
    return out


def _open_profile(page, app_url, profiles: Path, source: Path) -> None:  # noqa: F811
    """Put ``source`` in the app's profiles folder and load it on the Profiles page."""
    profiles.mkdir(exist_ok=True)
    shutil.copy(source, profiles / source.name)
    page.goto(f"{app_url}/profiles")
    compare = page.get_by_role("combobox", name="Compare")
    compare.wait_for(timeout=FIRST_PAGE_TIMEOUT * 1000)  # the first page imports the app: slow on a busy machine
    compare.click()
    page.get_by_role("option", name=source.name, exact=True).click()
    page.keyboard.press("Escape")
    page.wait_for_function(
        "() => document.querySelectorAll('.js-plotly-plot').length >= 4", timeout=FIRST_PAGE_TIMEOUT * 1000
    )
    page.wait_for_timeout(1500)  # let plotly finish drawing
    assert page.locator("[data-testid='stException']").count() == 0


def _figure(page, key: str) -> dict:
    """What plotly drew in the chart keyed ``key``: its full (decoded) traces and layout."""
    script = """(key) => {
        const gd = document.querySelector(`.st-key-${key} .js-plotly-plot`);
        if (!gd || !gd._fullData) return null;
        const plain = (v) => (v && v.length !== undefined && typeof v !== 'string') ? Array.from(v, plain) : v;
        return {
            data: gd._fullData.map(t => ({name: t.name, meta: t.meta, visible: t.visible, x: plain(t.x), y: plain(t.y),
                                          z: plain(t.z), color: (t.line || {}).color, showlegend: t.showlegend})),
            title: (gd._fullLayout.title || {}).text || '',
        };
    }"""
    return page.evaluate(script, key)


def test_temporal_mask_of_a_ring_past_its_size_draws_evicted_positions_as_evicted(
    app_url,
    browser,
    tmp_path,
    tiny_profiles,  # noqa: F811
):
    page = browser.new_page(viewport={"width": 1440, "height": 2400})
    page.set_default_timeout(2 * UI_TIMEOUT * 1000)  # a shared 2-core machine is slow to redraw
    _open_profile(page, app_url, tmp_path / "profiles", tiny_profiles / "tiny-complete.csv")
    page.get_by_role("link", name="Inspector").click()
    page.get_by_role("combobox", name="Strategy").click()
    page.get_by_role("option", name=RING).click()
    step = page.get_by_role("slider", name="Step")
    step.focus()
    step.press("End")  # step 23: masks are recorded there (every 8th step and the last)
    page.wait_for_function(
        "() => (document.querySelector('.st-key-insp_mask_temporal .js-plotly-plot')?.layout?.title?.text || '')"
        ".includes('step 23')"
    )
    page.wait_for_timeout(1000)
    fig = _figure(page, "insp_mask_temporal")
    heat = fig["data"][0]
    z, x = np.asarray(heat["z"], dtype=float), np.asarray(heat["x"], dtype=float)

    steps = load_profile(tiny_profiles / "tiny-complete.csv").frame("steps")
    query = int(steps[(steps["strategy"] == RING) & (steps["step"] == 23)]["position"].item())
    assert x.tolist() == list(range(query + 1))  # one column per position, held or not
    row = z[-1]
    evicted = list(range(2, query - 13))  # between the 2 sinks and the newest 14
    assert len(evicted) > 10
    assert np.flatnonzero(row == ic.EVICTED).tolist() == evicted
    assert np.flatnonzero(row == ic.VISIBLE).tolist() == [0, 1, *range(query - 13, query + 1)]
    assert {"visible", "evicted"} <= {t["name"] for t in fig["data"][1:]}  # named in the legend

    run = _figure(page, "insp_mask_run")
    run_z = np.asarray(run["data"][0]["z"], dtype=float)
    assert run_z.shape[0] == 23 and (run_z[:, :2] == ic.VISIBLE).all()  # the sink columns
    assert (np.diff((run_z == ic.EVICTED).sum(axis=1)) == 1).all()  # the sliding diagonal
    assert page.get_by_text("NaN").count() == 0
    assert page.locator("[data-testid='stDataFrame']").count() == 0  # reading the tables draws nothing
    _shoot(page, tmp_path, "inspector-masks")


def test_committed_example_sampled_every_4th_step_draws_visible_memory_lines(app_url, browser, tmp_path):  # noqa: F811
    page = browser.new_page(viewport={"width": 1440, "height": 2400})
    page.set_default_timeout(2 * UI_TIMEOUT * 1000)  # a shared 2-core machine is slow to redraw
    _open_profile(page, app_url, tmp_path / "profiles", EXAMPLE)
    fig = _figure(page, "compare_memory")
    assert "memory recorded every 4 steps" in fig["title"]
    used = [t for t in fig["data"] if t["meta"] == "used"]
    assert len(used) == len(load_profile(EXAMPLE).strategies)
    for t in used:
        y = np.asarray(t["y"], dtype=float)
        assert t["visible"] is True and np.isfinite(y).sum() >= 60 and np.isfinite(y).all()
    # Drawn, not only in the data: every line's SVG path has segments.
    lengths = page.evaluate(
        "() => Array.from(document.querySelectorAll('.st-key-compare_memory .scatterlayer .js-line'))"
        ".map(p => (p.getAttribute('d') || '').length)"
    )
    assert len([n for n in lengths if n > 50]) >= 2 * len(used), lengths  # used and allocated of each
    assert page.get_by_text("Sampled probes in this run: memory every 4 steps").count() == 1
    _shoot(page, tmp_path, "example-memory")


def _overlaps(a: dict, b: dict) -> bool:
    return (
        a["x"] < b["x"] + b["width"]
        and b["x"] < a["x"] + a["width"]
        and a["y"] < b["y"] + b["height"]
        and (b["y"] < a["y"] + a["height"])
    )


def test_twelve_strategies_draw_distinct_colours_and_no_legend_over_a_plot(
    app_url,
    browser,
    tmp_path,
    twelve_profile,  # noqa: F811
):
    page = browser.new_page(viewport={"width": 1440, "height": 2400})
    page.set_default_timeout(2 * UI_TIMEOUT * 1000)  # a shared 2-core machine is slow to redraw
    _open_profile(page, app_url, tmp_path / "profiles", twelve_profile)
    for key in ("compare_memory", "compare_quality"):
        fig = _figure(page, key)
        colors = {t["name"]: t["color"] for t in fig["data"] if t["name"] in TWELVE}
        expected = 11 if key == "compare_quality" else 12  # quality leaves the baseline out
        assert len(colors) == expected and len(set(colors.values())) == expected, (key, colors)
    # Speed: the strategies of the one strategy batch share each forward, so one line stands for
    # them (named for how many); a strategy that ran on its own keeps its own line and colour.
    speed = _figure(page, "compare_speed")["data"]
    batch = [t["name"] for t in speed if (t["name"] or "").startswith("one batch of ")]
    alone = [t["name"] for t in speed if t["name"] in TWELVE]
    assert len(batch) == 1 and int(batch[0].split()[3].rstrip(":")) + len(alone) == 12, (batch, alone)
    boxes = page.evaluate(
        """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(gd => ({
            key: gd.closest('[class*="st-key-"]')?.className || '',
            legend: gd.querySelector('g.legend')?.getBoundingClientRect()?.toJSON() || null,
            plots: Array.from(gd.querySelectorAll('.nsewdrag')).map(r => r.getBoundingClientRect().toJSON()),
        }))"""
    )
    assert len(boxes) >= 4
    with_legend = [b for b in boxes if b["legend"] and b["legend"]["width"] > 0]
    assert len(with_legend) >= 2  # quality and speed keep a legend (the memory chart is one panel per strategy)
    for b in with_legend:
        assert b["plots"], b["key"]
        for plot in b["plots"]:
            assert not _overlaps(b["legend"], plot), (re.findall(r"st-key-\S+", b["key"]), b["legend"], plot)
    _shoot(page, tmp_path, "twelve-strategies")

    # The strategy picker draws a subset, each strategy in its own colour.
    used = lambda fig: {t["name"]: t["color"] for t in fig["data"] if t["name"] in TWELVE and t["meta"] == "used"}  # noqa: E731
    before = used(_figure(page, "compare_memory"))
    # Remove all but the first three chips with their own buttons. Each removal reruns the page, and
    # a click landing while a busy machine redraws can be lost: click each until its chip is gone.
    box = page.locator("[data-testid='stMultiSelect']").filter(
        has=page.get_by_role("combobox", name="Strategies shown")
    )
    chips = box.locator("[data-tag]")
    for name in TWELVE[3:]:
        chip = box.locator(f"[data-tag][aria-label='{name}']")
        for _ in range(6):
            if not chip.count():
                break
            try:
                box.get_by_role("button", name=f"Remove {name}", exact=True).click(timeout=10_000)
                chip.wait_for(state="detached", timeout=20_000)
            except PlaywrightTimeout:
                continue
    assert chips.count() == 3, chips.count()
    page.keyboard.press("Escape")
    page.wait_for_function(
        "() => (document.querySelector('.st-key-compare_memory .js-plotly-plot')?._fullData || [])"
        ".filter(t => t.meta === 'used').length === 3"
    )
    memory = _figure(page, "compare_memory")  # three strategies: back to one chart, with its legend
    after = used(memory)
    assert list(after) == TWELVE[:3] and all(after[s] == before[s] for s in after)
