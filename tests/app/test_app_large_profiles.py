"""Large profiles in the app (issue 17, item 13): a profile is read per table, the metadata and
the steps table first, the per-layer, slot and mask tables when a figure needs them, and the
page says how big each file is. A 213 MB profile took 34.5 s to open, every table parsed."""

from __future__ import annotations

import re

import pandas as pd
import pytest
from app_helpers import MAIN, plotly_figures
from streamlit.testing.v1 import AppTest

from app import data
from app.keys import Keys
from cachelib.core.units import human_bytes
from cachelib.profile import load_profile
from cachelib.profile.tables import read_table

TIMEOUT = 120
TABLES = ("steps", "layers", "slots", "masks")


def errors(at) -> list[str]:
    return [re.sub(r"\\(.)", r"\1", e.value) for e in at.error]


def profiles_page(profiles_dir, tiny_profiles, *names: str) -> AppTest:
    for name in names:
        (profiles_dir / name).write_bytes((tiny_profiles / "tiny-complete.csv").read_bytes())
    at = AppTest.from_file(str(MAIN), default_timeout=TIMEOUT)
    at.run()
    at.switch_page("views/profiles.py").run()
    assert not at.exception
    return at


def test_read_table_gives_each_table_as_load_profile_does(tiny_profiles):
    for path in (tiny_profiles / "tiny-complete.csv", tiny_profiles / "tiny-stopped.csv"):
        whole = load_profile(path)
        for table in TABLES:
            pd.testing.assert_frame_equal(read_table(path, table), whole.frame(table))
            pd.testing.assert_frame_equal(read_table(path.read_bytes(), table), whole.frame(table))


def test_a_bad_cell_of_one_table_is_named_by_its_line_when_that_table_is_read(tiny_profiles, tmp_path):
    lines = (tiny_profiles / "tiny-complete.csv").read_text(encoding="utf-8").splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith("layers,"))
    cells = lines[at].split(",")
    header = lines[0].rstrip("\n").split(",")
    cells[header.index("tokens_held")] = "lots"
    lines[at] = ",".join(cells)
    bad = tmp_path / "bad-layers.csv"
    bad.write_text("".join(lines), encoding="utf-8")
    assert len(read_table(bad, "steps"))  # the other tables read fine
    with pytest.raises(ValueError) as refused:
        read_table(bad, "layers", name="bad-layers.csv")
    assert str(refused.value) == f"bad-layers.csv, line {at + 1}, column 'tokens_held': 'lots' is not an integer"
    with pytest.raises(ValueError, match=re.escape(str(refused.value))):
        load_profile(bad, name="bad-layers.csv")  # the same words as the whole-file reader's


def test_the_profiles_page_reads_no_slot_or_mask_table_and_lists_each_files_size(profiles_dir, tiny_profiles):
    at = profiles_page(profiles_dir, tiny_profiles, "complete.csv")
    listing = at.dataframe[0].value.set_index("profile")
    assert listing.loc["complete.csv", "size"] == human_bytes((profiles_dir / "complete.csv").stat().st_size)
    at.multiselect(key="compare").select("complete.csv").run()
    assert not at.exception and not errors(at)
    view = at.session_state[Keys.LOADED]["complete"]
    assert set(view.tables.loaded) == {"steps", "layers"}  # the per-layer chart needs its table
    assert len(plotly_figures(at)) == 4
    assert any(f"{human_bytes(view.size_bytes)} file" in m.value for m in at.markdown)

    at.switch_page("views/inspector.py").run()  # its figures need every table
    assert not at.exception and not errors(at)
    assert set(at.session_state[Keys.LOADED]["complete"].tables.loaded) == set(TABLES)


def test_a_large_profile_shows_its_steps_charts_and_reads_the_per_layer_table_when_asked(
    profiles_dir, tiny_profiles, monkeypatch
):
    monkeypatch.setattr(data, "LARGE_BYTES", 1)  # every file counts as large
    at = profiles_page(profiles_dir, tiny_profiles, "big-a.csv", "big-b.csv")
    at.multiselect(key="compare").select("big-a.csv").select("big-b.csv").run()
    assert not at.exception and not errors(at)
    views = at.session_state[Keys.LOADED]
    assert all(set(v.tables.loaded) == {"steps"} for v in views.values())
    assert len(plotly_figures(at)) == 3  # memory, quality, speed: the steps table's charts
    size = human_bytes(sum(v.size_bytes for v in views.values()))
    toggle = at.toggle(key=Keys.read_table("compare", "layers"))
    assert toggle.label == f"Per-layer memory: read the layers table ({size} profile)"

    toggle.set_value(True).run()
    assert not at.exception and not errors(at)
    assert len(plotly_figures(at)) == 4
    assert all(set(v.tables.loaded) == {"steps", "layers"} for v in at.session_state[Keys.LOADED].values())


def test_a_large_profile_with_a_bad_layers_table_still_shows_its_steps_charts(profiles_dir, tiny_profiles, monkeypatch):
    monkeypatch.setattr(data, "LARGE_BYTES", 1)
    lines = (tiny_profiles / "tiny-complete.csv").read_text(encoding="utf-8").splitlines(keepends=True)
    at_line = next(i for i, line in enumerate(lines) if line.startswith("layers,"))
    header = lines[0].rstrip("\n").split(",")
    cells = lines[at_line].split(",")
    cells[header.index("capacity")] = "-inf"
    lines[at_line] = ",".join(cells)
    (profiles_dir / "broken.csv").write_text("".join(lines), encoding="utf-8")
    at = profiles_page(profiles_dir, tiny_profiles)
    at.multiselect(key="compare").select("broken.csv").run()
    assert not at.exception and not errors(at) and len(plotly_figures(at)) == 3
    at.toggle(key=Keys.read_table("compare", "layers")).set_value(True).run()
    assert not at.exception
    assert errors(at) == [f"broken.csv, line {at_line + 1}, column 'capacity': '-inf' is not an integer"]
    assert len(plotly_figures(at)) == 3
