"""One derivation of every profile figure (issue 32): the app's cache memory, quality and speed
figures and the HTML report's carry the same series (trace names, x and y, colours) for the
same profiles, and the data behind them is defined once in cachelib and app (read with ``ast``)."""

from __future__ import annotations

import ast
import math
from collections import Counter
from pathlib import Path

import pytest

from app import charts
from app.data import combine, run_view
from app.figures import strategy_colors
from cachelib.profile import load_profile
from cachelib.profile.report import ReportRun, report_figures

ROOT = Path(__file__).resolve().parents[2]
# the data behind the profile figures, and the helpers the app and the report each had a copy of
DEFINED_ONCE = ("MemoryInfo", "QualityInfo", "SpeedInfo", "full_cache_reference", "unique_names", "ci95")


def series(fig) -> set[tuple]:
    """(name, x, y, colour) of each line drawn (a line repeated in several panels counts once)."""

    def numbers(values) -> tuple:
        return tuple(
            None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)
            for v in (() if values is None else values)
        )

    return {(t.name, numbers(t.x), numbers(t.y), t.line.color) for t in fig.data}


def app_figures(views) -> dict:
    """The three figures as the app's Profiles page draws them (the run's colours, every strategy)."""
    view = combine(views)
    colors = strategy_colors(view.strategies)
    return {
        "memory": charts.cache_memory_figure(view.steps, view.strategies, view.reference, colors),
        "quality": charts.quality_figure(view.steps, view.strategies, view.baselines, colors),
        "speed": charts.speed_figure(view.steps, view.strategies, colors),
    }


@pytest.mark.parametrize("names", [["tiny-complete"], ["tiny-complete", "tiny-stopped"]])
def test_the_app_and_the_report_draw_the_same_series_of_the_same_profiles(tiny_profiles, names):
    profiles = [load_profile(tiny_profiles / f"{n}.csv", name=n) for n in names]
    app = app_figures([run_view(p, n) for p, n in zip(profiles, names)])
    report = report_figures([ReportRun.of(p, n) for p, n in zip(profiles, names)])
    assert list(app) == list(report)
    strategies = sum(len(p.strategies) for p in profiles)
    for name in app:
        drawn = series(app[name])
        assert drawn == series(report[name]), name
        colours = Counter(colour for *_, colour in drawn)
        assert len(colours) >= 2, (name, colours)  # something of several colours was drawn, not an empty chart
    memory = series(app["memory"])
    assert len({n for n, *_ in memory}) == strategies + 1  # every strategy, and one full-cache line
    assert any(n.startswith("full cache, float32") for n, *_ in memory)


def test_several_profiles_draw_each_runs_own_process_memory_never_a_maximum_over_runs(tiny_profiles):
    # Two runs, two processes: the RSS panel draws one line per profile, each that run's own readings.
    names = ["tiny-complete", "tiny-stopped"]
    profiles = [load_profile(tiny_profiles / f"{n}.csv", name=n) for n in names]
    # make the two runs' readings differ at every step, so a maximum over runs would show
    stopped = profiles[1].frame("steps")
    stopped["rss_bytes"] = stopped["rss_bytes"] * 3
    figures = [
        app_figures([run_view(p, n) for p, n in zip(profiles, names)])["speed"],
        report_figures([ReportRun.of(p, n) for p, n in zip(profiles, names)])["speed"],
    ]
    for fig in figures:
        for n, p in zip(names, profiles):
            steps = p.frame("steps")
            own = steps.groupby("step")["rss_bytes"].max().dropna()
            (line,) = [t for t in fig.data if t.name == f"{n}: process RSS"]
            assert list(line.x) == [float(s) for s in own.index]
            assert [round(y * 2**20) for y in line.y] == [int(b) for b in own], n
        assert not [t for t in fig.data if t.name == "process RSS"]  # no line mixing the two runs


def test_the_report_of_the_committed_example_draws_the_apps_lines():
    # 8 strategies: the app draws one panel per strategy; the report one plot; the lines are the same
    path = ROOT / "profiles" / "examples" / "smollm2-mlx-256t.csv"
    profile = load_profile(path, name="smollm2-mlx-256t")
    app = app_figures([run_view(profile, "smollm2-mlx-256t")])
    report = report_figures([ReportRun.of(profile, "smollm2-mlx-256t")])
    for name in app:
        assert series(app[name]) == series(report[name]), name


def trees(tops: tuple[str, ...], *words: str):
    """(path, syntax tree) of each .py file under ``tops`` whose text has one of ``words``."""
    for top in tops:
        for path in sorted((ROOT / top).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            if any(w in text for w in words):
                yield path, ast.parse(text, str(path))


def definitions(names: tuple[str, ...]) -> dict[str, list[str]]:
    """Name -> "path:line" of each class or function of that name defined in cachelib/ and app/."""
    found: dict[str, list[str]] = {}
    for path, tree in trees(("cachelib", "app"), *names):
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in names:
                found.setdefault(node.name, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_the_figure_data_and_the_shared_helpers_are_defined_once():
    found = definitions(DEFINED_ONCE)
    for name in DEFINED_ONCE:
        assert len(found.get(name, [])) == 1, f"{name} defined {len(found.get(name, []))} times: {found.get(name)}"
    for name in ("MemoryInfo", "QualityInfo", "SpeedInfo", "full_cache_reference", "unique_names"):
        assert found[name][0].startswith("cachelib/profile/figure_data.py:"), found[name]


def test_no_module_imports_a_unit_under_another_units_name():
    # ``human_gib as human_bytes`` hid core.units.human_bytes (SI), ``GiB as GB`` its GB (10^9): one name, one unit
    renamed = []
    for path, tree in trees(("cachelib", "app", "tests"), "units import"):
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("units"):
                renamed += [f"{path.relative_to(ROOT)}:{node.lineno}" for a in node.names if a.asname]
    assert renamed == []
