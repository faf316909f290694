"""The HTML report of a comparison (cachelib.profile.report, ``python -m cachelib report``): the data
behind each figure, the token streams and their first departure, the page itself, the command's
bad input, and (browser) the downloaded page opening offline in Chromium with its figures drawn."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest
from plotly.offline import get_plotlyjs

from cachelib.cli import main
from cachelib.profile import Profile, load_profile
from cachelib.profile.figure_data import memory_info, quality_info, speed_info
from cachelib.profile.report import ReportRun, report_html, report_tables, stream_segments, token_streams

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "profiles" / "examples" / "smollm2-mlx-256t.csv"


@pytest.fixture(scope="module")
def example():
    return load_profile(EXAMPLE, name="smollm2-mlx-256t")


def steps_profile(tokens: dict[str, list[int]], mode: str = "teacher-forced", **meta) -> Profile:
    strategies = list(tokens)
    p = Profile(
        {
            "schema_version": 1,
            "name": "t",
            "status": "complete",
            "strategies": json.dumps(strategies),
            "baseline": strategies[0],
            "mode": mode,
            "num_layers": 1,
            "num_kv_heads": 1,
            "head_dim": 2,
            "dtype": "float32",
            **meta,
        }
    )
    p.add(
        "steps",
        [
            {
                "strategy": s,
                "step": i,
                "phase": "prefill" if i == 0 else "decode",
                "position": 4 + i,
                "tokens_in": 1,
                "token_id": t,
                "cache_bytes_used": 16 * (5 + i),
                "cache_tokens_held": 5 + i,
                "cache_bytes_allocated": 1024,
                "kl": 0.0 if s == strategies[0] else 0.1 * i,
                "top1_agree": t == tokens[strategies[0]][i],
                "tokens_per_second": 10.0,
            }
            for s, ids in tokens.items()
            for i, t in enumerate(ids)
        ],
    )
    return p


def summary_tables(page: str) -> list[pd.DataFrame]:
    """The page's summary tables as the reader sees them (header row, then the cells' text)."""

    class Cells(HTMLParser):
        def __init__(self):
            super().__init__()
            self.tables, self.cell = [], None

        def handle_starttag(self, tag, attrs):
            if tag == "table" and ("class", "summary") in attrs:
                self.tables.append([])
            elif tag == "tr" and self.tables:
                self.tables[-1].append([])
            elif tag in ("td", "th") and self.tables:
                self.cell = ""

        def handle_data(self, data):
            if self.cell is not None:
                self.cell += data

        def handle_endtag(self, tag):
            if tag in ("td", "th") and self.cell is not None:
                self.tables[-1][-1].append(self.cell)
                self.cell = None

    parser = Cells()
    parser.feed(page)
    return [pd.DataFrame(rows[1:], columns=rows[0]) for rows in parser.tables]


def memory_of(*runs: ReportRun):
    t = report_tables(runs)
    return memory_info(t.steps, t.strategies, t.reference, t.colors)


def test_memory_lines_join_the_sampled_steps_of_a_profile_recorded_with_memory_every_4(example):
    info = memory_of(ReportRun.of(example))
    steps = example.frame("steps")
    recorded = steps[(steps["strategy"] == "standard") & steps["cache_bytes_used"].notna()]
    standard = next(s for s in info.series if s.strategy == "standard")
    assert standard.step.tolist() == recorded["step"].tolist() and len(standard.step) == 65  # 0, 4, ..., 252, 255
    assert standard.values["used"].tolist() == recorded["cache_bytes_used"].astype(float).tolist()  # bytes
    assert info.every == 4
    assert [s.strategy for s in info.series] == example.strategies
    assert len({s.color for s in info.series}) == len(example.strategies)  # one colour per strategy
    ((label, (_, reference)),) = info.references.items()
    assert label == "full cache, float32"
    assert reference[-1] == 46_080 * 301  # 30 layers x 3 KV heads x 64 x 2 x 4 bytes, 301 tokens
    assert standard.values["used"][-1] == reference[-1]  # the standard cache uses exactly the full cache's bytes


def test_quality_and_speed_lines_leave_out_the_baseline_and_the_prefill(example):
    t = report_tables([ReportRun.of(example)])
    quality = quality_info(t.steps, t.strategies, t.baselines, t.colors)
    assert [s.strategy for s in quality.series] == example.strategies[1:]
    steps = example.frame("steps")
    ring = steps[steps["strategy"] == "rotating:max_size=32,keep=4"]
    line = next(s for s in quality.series if s.strategy == "rotating:max_size=32,keep=4")
    assert line.values["agreement"][-1] == pytest.approx(ring["top1_agree"].astype(float).mean())
    speed = speed_info(t.steps, t.strategies, t.colors)
    assert speed.series and all(0 not in s.step for s in speed.series)  # decode steps only


def test_several_profiles_are_labelled_by_profile_and_share_a_full_cache_line_only_when_it_is_the_same(example):
    torch = load_profile(ROOT / "profiles" / "examples" / "smollm2-torch-256t.csv")
    info = memory_of(ReportRun.of(example, "mlx"), ReportRun.of(torch, "torch"))
    assert info.series[0].strategy == "mlx / standard" and info.series[-1].strategy == "torch / offloaded"
    assert len({s.color for s in info.series}) == len(info.series)  # 15 strategies, 15 colours
    assert list(info.references) == ["full cache, float32 (mlx, torch)"]  # same model, prompt, steps
    short = steps_profile({"standard": [1, 2, 3]})
    info = memory_of(ReportRun.of(example, "mlx"), ReportRun.of(short, "short"))
    assert list(info.references) == ["full cache, float32 (mlx)", "full cache, float32 (short)"]


def test_token_streams_find_the_first_departure_from_the_baseline():
    p = steps_profile({"standard": [5, 6, 7, 8], "ring": [5, 6, 9, 8], "same": [5, 6, 7, 8]})
    base, ring, same = token_streams(p.frame("steps"), p.strategies, p.baseline)
    assert ring.first_departure == 2 and ring.baseline_token == 7 and ring.differing_steps == 1
    assert same.first_departure is None and base.first_departure is None
    decode = lambda ids: "".join(f"<{i}>" for i in ids)  # noqa: E731
    # Teacher-forced: the baseline's text, the strategy's own choice where it departs, what it replaced.
    assert stream_segments(ring, base, "teacher-forced", decode) == [
        ("<5><6>", "same"),
        ("<9>", "departure"),
        ("<7>", "instead"),
        ("<8>", "after"),
    ]
    assert stream_segments(ring, base, "free-running", decode) == [
        ("<5><6>", "same"),
        ("<9>", "departure"),
        ("<8>", "after"),
    ]
    assert stream_segments(same, base, "teacher-forced", decode) == [("<5><6><7><8>", "same")]


def test_the_report_is_one_offline_page_with_the_summary_in_plain_words_and_escaped_user_text(example):
    hostile = steps_profile({"standard": [1, 2, 3], "quantized:bits=4": [1, 4, 3]}, prompt="<script>alert(1)</script>")
    page = report_html([example, hostile], ["example", "hostile"], decode=lambda ids: " ".join(map(str, ids)))
    plotly_js = get_plotlyjs()
    assert page.count(plotly_js) == 1  # plotly.js inlined once...
    rest = page.replace(plotly_js, "")
    assert "<script src" not in rest and "cdn.plot.ly" not in rest  # ...and nothing fetched from elsewhere
    assert page.count("Plotly.newPlot") == 3  # memory, quality, speed
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    table = summary_tables(rest)[0]
    standard = table[table["strategy"] == "standard"].iloc[0]
    assert standard["bytes/token held"] == "46,080" and standard["saved"] == "0%"
    ring = table[table["strategy"] == "rotating:max_size=64,keep=4"].iloc[0]
    assert ring["saved"] == "79%" and ring["tokens held"] == "64"  # 1 - 64 / 301 tokens
    assert "<li><b>rotating:max_size=64,keep=4</b> — saved 79% memory vs a float32 full cache at 301 tokens" in rest
    assert "first departs at step 1; 1 of 3 steps differ" in page
    assert "<span class='departure'>4</span><span class='instead'>2</span>" in page


def test_report_command_writes_the_page_and_refuses_bad_input_with_one_line(tmp_path, capsys):
    out = tmp_path / "out" / "report.html"
    assert main(["report", str(EXAMPLE), "--out", str(out)]) == 0
    assert f"report: {out} (1 profile" in capsys.readouterr().out
    assert out.read_text().count("Plotly.newPlot") == 3
    (tmp_path / "notes.csv").write_text("a,b\n1,2\n")
    for args, message in [
        ([str(tmp_path / "notes.csv"), "--out", str(out)], "not a cachelib profile"),
        ([str(EXAMPLE), "--out", str(tmp_path / "r.txt")], "use a .html or .htm name"),
        ([str(tmp_path / "missing.csv"), "--out", str(out)], "missing.csv"),
    ]:
        done = subprocess.run(
            [sys.executable, "-m", "cachelib", "report", *args], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and message in lines[0], done.stderr


@pytest.mark.browser
@pytest.mark.slow
def test_the_report_opens_offline_in_chromium_and_draws_its_figures(example, tmp_path, monkeypatch):
    chromium = Path("/usr/bin/chromium")
    if not chromium.exists():
        pytest.skip(f"no Chromium at {chromium}")
    sync_api = pytest.importorskip("playwright.sync_api")
    path = tmp_path / "report.html"
    path.write_text(report_html([example], ["smollm2-mlx-256t"]), encoding="utf-8")
    monkeypatch.delenv("LD_PRELOAD", raising=False)  # see test_browser.py
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=str(chromium), args=["--no-sandbox", "--disable-gpu"], headless=True
        )
        try:
            context = browser.new_context(offline=True)
            requests = []
            context.route(
                re.compile(r"^(?!file:).*"), lambda route: (requests.append(route.request.url), route.abort())
            )
            page = context.new_page()
            page.goto(path.as_uri())
            page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length === 3", timeout=60_000)
            traces = page.evaluate(
                "() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(d => (d.data || []).length)"
            )
            drawn = page.evaluate("() => document.querySelectorAll('.js-plotly-plot .scatterlayer .trace').length")
        finally:
            browser.close()
    assert requests == []  # nothing was fetched: the page is self-contained
    # used + allocated per strategy + full cache; KL + agreement; speed + the process's two counters
    assert traces == [2 * 8 + 1, 2 * 7, 8 + 2], traces
    assert drawn >= sum(traces)


def test_the_cli_summary_prints_bytes_per_token_held_and_what_saved_is_measured_against():
    from cachelib.cli import format_summary
    from cachelib.profile import summarize, verdict

    p = steps_profile({"standard": [5, 6, 7], "ring": [5, 6, 9]}, dtype="float16")
    printed = format_summary(summarize(p)).splitlines()
    assert printed[0].split()[:4] == ["strategy", "peak", "alloc", "B/token"]
    # The rows use 16 bytes a token held; a float16 full cache of this geometry takes 2 x 1 x 1 x 2 x 2 = 8.
    assert printed[1].split()[3:5] == ["16", "-100%"]
    assert printed[-1] == (
        "B/token = bytes used / tokens held; saved = 1 - bytes used / bytes used by a float16 full cache at 7 tokens"
    )
    assert (
        summarize(p)
        .pipe(lambda s: verdict(s.iloc[1], "standard"))
        .startswith("used 100% more memory vs a float16 full cache at 7 tokens")
    )


def test_streams_markdown_styles_the_departure_and_escapes_the_text():
    from app.streams import segments_markdown

    segments = [(" **not bold** ", "same"), (" [x](y)", "departure"), (" ok", "instead"), ("\n", "after")]
    assert segments_markdown(segments) == (
        r" \*\*not bold\*\* " + r" :orange-background[**\[x\](y)**]" + " ~~ok~~" + "\n"
    )


def _app_colors(views) -> dict[str, str]:
    """Strategy -> colour as the app's charts draw it (the combined view of the loaded profiles)."""
    from app.charts import cache_memory_figure
    from app.data import combine
    from app.figures import strategy_colors

    view = combine(views)
    fig = cache_memory_figure(
        view.steps, view.strategies, None, strategy_colors(view.strategies), small_multiples=False
    )
    return {t.name: t.line.color for t in fig.data if t.meta == "used"}


@pytest.mark.parametrize("count", [1, 2])
def test_the_report_gives_each_strategy_the_apps_colour_binary_byte_axes_and_a_title_that_counts(example, count):
    from app.data import run_view
    from cachelib.profile.report import report_figures

    torch = load_profile(ROOT / "profiles" / "examples" / "smollm2-torch-256t.csv", name="smollm2-torch-256t")
    profiles = [(example, "smollm2-mlx-256t"), (torch, "smollm2-torch-256t")][:count]
    app = _app_colors([run_view(p, n) for p, n in profiles])
    runs = [ReportRun.of(p, n) for p, n in profiles]
    figures = report_figures(runs)
    report = {t.name: t.line.color for t in figures["memory"].data if t.line.dash == "solid"}
    assert len(app) == sum(len(p.strategies) for p, _ in profiles) and report == app
    quality = {t.name: t.line.color for t in figures["quality"].data if t.showlegend is not False}
    assert all(app[name] == color for name, color in quality.items())
    assert figures["memory"].layout.yaxis.title.text.startswith("MiB")  # 2^20 bytes, as the summary table
    top = max(max(t.y) for t in figures["memory"].data)
    assert 1 < top < 2**14  # MiB, not bytes (~13.9 MiB for 301 float32 tokens)
    page = report_html(runs)
    title = re.search(r"<h1>(.*?)</h1>", page).group(1)
    assert title == (
        "cachelib profile: smollm2-mlx-256t"
        if count == 1
        else "cachelib comparison: smollm2-mlx-256t + smollm2-torch-256t"
    )


def test_report_figures_keep_their_plot_size_and_every_legend_entry_however_many_series(example):
    from cachelib.profile.palette import LEGEND_ROW
    from cachelib.profile.report import report_figures

    torch = load_profile(ROOT / "profiles" / "examples" / "smollm2-torch-256t.csv")
    one = report_figures([ReportRun.of(example, "mlx")])
    two = report_figures([ReportRun.of(example, "mlx"), ReportRun.of(torch, "torch")])
    for name in one:
        a, b = one[name].layout, two[name].layout
        plot_a, plot_b = a.height - a.margin.t - a.margin.b, b.height - b.margin.t - b.margin.b
        assert plot_a == plot_b  # the plot keeps its height; the legend below adds its rows
        entries = sum(1 for t in two[name].data if t.showlegend is not False and t.name)
        assert b.legend.orientation == "v" and b.legend.yref == "container" and b.margin.b >= entries * LEGEND_ROW
