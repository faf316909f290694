"""Every page of the app through Streamlit's AppTest: runs, stops, errors, loading and comparing.

A live run decodes in a background thread; a browser polls it from a fragment, here the test
reruns the page (``at.run()``) while it goes and once after it ends.
"""

from __future__ import annotations

import re
import time

import pytest
from app_helpers import MAIN, finish_run, plotly_figures
from streamlit.testing.v1 import AppTest

from app.data import run_view
from app.keys import Keys
from cachelib.profile import load_profile

ROOT = MAIN.parents[1]
TIMEOUT = 180  # seconds per script run: the first loads the bundled model on a busy 2-core machine


def new_app() -> AppTest:
    at = AppTest.from_file(str(MAIN), default_timeout=TIMEOUT)
    at.run()
    assert not at.exception
    return at


def errors(at) -> list[str]:
    """The error boxes' text as the page shows it (user text in them is markdown-escaped)."""
    return [re.sub(r"\\(.)", r"\1", e.value) for e in at.error]


def chart_titles(at) -> list[str]:
    out = []
    for fig in plotly_figures(at):
        title = fig["layout"].get("title", {})
        out.append(title.get("text", "") if isinstance(title, dict) else str(title))
    return out


@pytest.mark.bundled
def test_default_run_on_the_bundled_model_updates_live_then_keeps_its_charts_through_bad_input(profiles_dir):
    at = new_app()
    assert at.radio(key="backend").value in ("mlx", "torch")
    assert at.selectbox(key="model").value == "smollm2"
    assert at.text_area(key="prompt").value == "Explain what a KV cache is in two sentences."
    at.button(key="strategy_2_del").click().run()  # two strategies: standard (baseline) and the ring
    at.slider(key="max_tokens").set_value(32)
    at.button(key="run").click().run()
    assert not at.exception and not errors(at)

    assert [str(s) for s in at.session_state[Keys.LIVE].strategies] == ["standard", "rotating:max_size=64,keep=4"]
    finish_run(at)
    assert not at.exception and not errors(at)
    assert not at.get("progress")
    titles = chart_titles(at)
    assert len(titles) == 4 and titles[0].startswith("Cache memory")
    memory = plotly_figures(at)[0]
    names = {t["name"].split(" · ")[0] for t in memory["data"]}  # "strategy" or "strategy · used"
    assert {"standard", "rotating:max_size=64,keep=4"} <= names and any(n.startswith("full cache") for n in names)
    summary = at.dataframe[0].value
    assert summary["strategy"].tolist() == ["standard", "rotating:max_size=64,keep=4"]
    assert summary["steps"].tolist() == [32, 32]
    words = next(m.value for m in at.markdown if m.value.startswith("**In plain words**"))
    assert "**rotating:max\\_size=64,keep=4** — saved" in words and "vs a float32 full cache at" in words
    assert summary.iloc[0]["bytes/token held"] == 46_080  # 30 layers x 3 KV heads x 64 x 2 x 4 bytes

    files = list(profiles_dir.glob("*.csv"))
    assert len(files) == 1
    saved = load_profile(files[0])
    assert saved.complete and saved.meta["max_tokens"] == "32"

    # Bad input: an error that says what to fix; the results stay on screen.
    at.text_area(key="prompt").set_value("   ")
    at.button(key="run").click().run()
    assert errors(at) == ["the prompt is empty; type a prompt to decode from"]
    assert len(at.get("plotly_chart")) == 4 and len(at.dataframe) == 1
    at.text_area(key="prompt").set_value("Hello")
    at.text_input(key="strategy_1_rotating.keep").set_value("64").run()  # refused in its row; Run is off
    assert errors(at) == ["strategy 2 (rotating): rotating: keep=64 must be < max_size=64 (allowed: 0..63)"]
    assert at.button(key="run").disabled
    assert len(at.get("plotly_chart")) == 4 and not at.exception
    assert len(list(profiles_dir.glob("*.csv"))) == 1  # nothing ran


def test_strategy_rows_are_added_duplicated_removed_and_offer_each_strategys_knobs(profiles_dir):
    at = new_app()
    at.button(key="strategy_1_dup").click().run()  # a copy of the ring right after it
    at.button(key="strategy_add").click().run()  # a new standard row at the end
    at.selectbox(key="strategy_4_name").set_value("chunked").run()
    chunk = at.text_input(key="strategy_4_chunked.chunk_size")
    assert chunk.value == "256" and "from 1 to" in chunk.help  # required knob: a first value inside its range
    at.text_input(key="strategy_3_rotating.max_size").set_value("32")
    assert at.selectbox(key="strategy_2_quantized.bits").options == ["2", "3", "4", "5", "6", "8"]
    assert at.selectbox(key="strategy_1_rotating.bits").options[0] == "off"  # optional knob
    at.button(key="strategy_0_del").click().run()  # the ring becomes the baseline
    at.selectbox(key="model").set_value("tiny-llama").run()
    at.slider(key="max_tokens").set_value(2)
    at.button(key="run").click().run()
    assert not at.exception and not errors(at)
    run = at.session_state[Keys.LIVE]
    labels = [str(s) for s in run.strategies]  # the run holds the specs; their text labels the charts
    assert labels == [
        "rotating:max_size=64,keep=4",
        "rotating:max_size=32,keep=4",
        "quantized:bits=4,group_size=64",
        "chunked:chunk_size=256",
    ]
    finish_run(at)
    assert at.dataframe[0].value["strategy"].tolist() == labels


def test_bad_input_shows_what_to_fix_without_a_traceback(profiles_dir):
    at = new_app()
    at.text_input(key="strategy_1_rotating.keep").set_value("64").run()
    assert errors(at) == ["strategy 2 (rotating): rotating: keep=64 must be < max_size=64 (allowed: 0..63)"]
    assert at.button(key="run").disabled
    at.text_input(key="strategy_1_rotating.keep").set_value("4")

    at.radio(key="backend").set_value("torch").run()
    at.selectbox(key="strategy_2_quantized.bits").set_value(3).run()
    assert errors(at) == ["strategy 3 (quantized): quantized: key_bits=3 is not supported on torch; allowed: 2, 4, 8"]
    assert at.button(key="run").disabled
    at.selectbox(key="strategy_2_quantized.bits").set_value(4).run()

    at.radio(key="backend").set_value("mlx").run()
    at.selectbox(key="model").set_value("a local model folder…").run()
    at.text_input(key="model_folder").set_value(str(profiles_dir / "no-such-model"))
    at.button(key="run").click().run()
    assert len(errors(at)) == 1 and "no-such-model" in errors(at)[0]

    assert not at.exception
    assert Keys.LIVE not in at.session_state
    assert not list(profiles_dir.iterdir())


def test_charts_fill_in_while_the_run_goes_and_stop_keeps_what_was_recorded(profiles_dir):
    at = new_app()
    at.selectbox(key="model").set_value("tiny-llama").run()
    at.slider(key="max_tokens").set_value(2048)
    at.button(key="run").click().run()
    assert not errors(at)
    run = at.session_state[Keys.LIVE]
    deadline = time.monotonic() + TIMEOUT
    while run.step < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    at.run()
    # Mid-run: the progress bar, Stop, and the charts of what is recorded so far.
    assert at.get("progress") and len(at.get("plotly_chart")) == 4
    assert at.dataframe[0].value["steps"].min() >= 4
    assert at.button(key="run").disabled
    at.button(key="stop").click().run()
    finish_run(at)
    assert not at.exception and not errors(at)
    assert 3 <= run.step < 2047
    warning = " ".join(w.value for w in at.warning)
    assert "Incomplete profile" in warning and "stopped by request" in warning
    assert len(at.get("plotly_chart")) == 4
    saved = load_profile(next(profiles_dir.glob("*.csv")))
    assert saved.status == "incomplete" and int(saved.meta["steps_completed"]) == run.step + 1


def test_a_run_that_raises_shows_the_error_and_keeps_the_previous_results(profiles_dir, tiny_profiles):
    at = AppTest.from_file(str(MAIN), default_timeout=TIMEOUT)
    previous = load_profile(tiny_profiles / "tiny-complete.csv")
    at.session_state[Keys.CURRENT] = (previous, run_view(previous, "previous"))
    at.run()
    at.selectbox(key="model").set_value("tiny-llama").run()
    at.selectbox(key="strategy_1_name").set_value("static").run()
    at.text_input(key="strategy_1_static.max_len").set_value("8")
    at.button(key="run").click().run()
    finish_run(at)
    assert not at.exception
    assert len(errors(at)) == 1 and "max_len=8" in errors(at)[0]
    assert "previous" in at.markdown[0].value  # the earlier results are still what is shown
    assert len(at.get("plotly_chart")) == 4


def test_profiles_page_lists_loads_and_compares_profiles(profiles_dir, tiny_profiles):
    (profiles_dir / "sweep-a").mkdir()
    (profiles_dir / "complete.csv").write_bytes((tiny_profiles / "tiny-complete.csv").read_bytes())
    (profiles_dir / "sweep-a" / "point-1.csv").write_bytes((tiny_profiles / "tiny-stopped.csv").read_bytes())
    (profiles_dir / "not-a-profile.csv").write_text("a,b\n1,2\n")
    at = new_app()
    at.switch_page("views/profiles.py").run()
    assert not at.exception
    listing = at.dataframe[0].value.set_index("profile")
    assert listing.loc["sweep-a/point-1.csv", "status"] == "incomplete"
    assert listing.loc["not-a-profile.csv", "status"] == "not a profile"

    at.multiselect(key="compare").select("complete.csv").select("sweep-a/point-1.csv").run()
    assert not at.exception and not errors(at)
    warning = " ".join(w.value for w in at.warning)
    assert "sweep-a/point-1: stopped by request" in warning
    figures = plotly_figures(at)
    assert len(figures) == 4
    names = {t["name"].split(" · ")[0] for t in figures[0]["data"]}  # "strategy" or "strategy · used"
    assert {"complete / standard", "sweep-a/point-1 / rotating:max_size=16,keep=2"} <= names
    quality = {t["name"] for t in figures[1]["data"]}
    assert "complete / standard" not in quality  # each profile's baseline is its own reference
    summary = at.dataframe[1].value
    assert summary["strategy"].tolist()[0] == "complete / standard"

    at.multiselect(key="compare").select("not-a-profile.csv").run()
    assert errors(at) == ["not-a-profile.csv: not a cachelib profile (no 'table' column)"]
    assert len(at.get("plotly_chart")) == 4 and not at.exception

    # The selection survives a visit to another page.
    at.switch_page("views/live.py").run()
    at.switch_page("views/profiles.py").run()
    assert at.multiselect(key="compare").value == ["complete.csv", "sweep-a/point-1.csv", "not-a-profile.csv"]


def test_profiles_page_saves_the_current_run_under_a_name(profiles_dir, tiny_profiles):
    at = AppTest.from_file(str(MAIN), default_timeout=TIMEOUT)
    profile = load_profile(tiny_profiles / "tiny-complete.csv")
    at.session_state[Keys.CURRENT] = (profile, run_view(profile, "tiny-complete"))
    at.run()
    at.switch_page("views/profiles.py").run()
    assert at.get("download_button")

    def save_as(name: str) -> None:
        at.text_input(key="save_name").set_value(name)
        next(b for b in at.button if b.label == "Save").click().run()

    save_as("kept-run")
    assert not at.exception and not errors(at)
    assert load_profile(profiles_dir / "kept-run.csv").name == "kept-run"
    save_as("kept-run")
    assert errors(at) == [f"a profile named 'kept-run' already exists in {profiles_dir}; choose another name"]
    save_as("no/slashes")
    assert "is not allowed" in errors(at)[0]


def test_inspector_steps_through_slots_masks_and_quantization_error(profiles_dir, tiny_profiles):
    at = AppTest.from_file(str(MAIN), default_timeout=TIMEOUT)
    profile = load_profile(tiny_profiles / "tiny-complete.csv")
    view = run_view(profile, "tiny-complete")
    # Known error values on the quantized strategy's rows, so the panels' numbers can be checked.
    quantized = view.layers["strategy"] == "quantized:bits=4,group_size=32"
    view.layers.loc[quantized, "key_rel_rms"] = 0.01 * (view.layers.loc[quantized, "layer"] + 1)
    view.layers.loc[quantized, "value_rel_rms"] = 0.02
    at.session_state[Keys.CURRENT] = (profile, view)
    at.run()
    at.switch_page("views/inspector.py").run()
    assert not at.exception
    at.selectbox(key="insp_strategy").set_value("rotating:max_size=16,keep=2").run()
    at.select_slider(key="insp_step").set_value(20).run()
    assert not at.exception
    figures = plotly_figures(at)
    # slots, masks in slot and temporal order, the mask over the run, kept positions (layers x
    # positions, positions x steps); an unquantized ring: one line, no empty error frames
    assert len(figures) == 6
    assert any("no quantization error recorded" in c.value for c in at.caption)
    ring = figures[0]
    slots = [p for row in ring["data"][0]["z"] for p in row if p is not None]
    steps = profile.frame("steps")
    newest = steps[(steps["strategy"] == "rotating:max_size=16,keep=2") & (steps["step"] == 20)]["position"].item()
    assert len(slots) == 16 and slots[:2] == [0, 1] and max(slots) == newest  # the sinks, then the newest 14
    assert sorted(slots[2:]) == list(range(newest - 13, newest + 1))
    assert any("keep region (2 sink slots)" == t["name"] for t in ring["data"])
    assert "temporal order · step 16" in figures[2]["layout"]["title"]["text"]  # masks every 8 steps
    at.button(key="insp_play").click().run()
    assert at.select_slider(key="insp_step").value == 21
    at.selectbox(key="insp_strategy").set_value("quantized:bits=4,group_size=32").run()
    heat, bars = plotly_figures(at)[4:]
    assert [t["name"] for t in bars["data"]] == ["keys", "values"]
    assert bars["data"][0]["y"] == pytest.approx([0.01, 0.02, 0.03, 0.04])  # one bar per layer at step 21
    assert len(heat["data"][0]["z"]) == 4 and len(heat["data"][0]["z"][0]) == 24  # layers x steps


def test_inspector_without_a_run_says_where_to_start():
    at = new_app()
    at.switch_page("views/inspector.py").run()
    assert not at.exception
    assert "Nothing to inspect yet" in at.info[0].value


def test_any_loaded_profile_downloads_as_csv_parquet_and_an_html_report(profiles_dir, tiny_profiles):
    from app import exports

    (profiles_dir / "examples").mkdir()
    committed = ROOT / "profiles" / "examples" / "smollm2-torch-256t.csv"
    (profiles_dir / "examples" / committed.name).write_bytes(committed.read_bytes())
    (profiles_dir / "complete.csv").write_bytes((tiny_profiles / "tiny-complete.csv").read_bytes())
    at = new_app()
    at.switch_page("views/profiles.py").run()
    at.multiselect(key="compare").select("examples/smollm2-torch-256t.csv").select("complete.csv").run()
    assert not at.exception and not errors(at)
    labels = [b.proto.label for b in at.get("download_button")]
    assert labels == ["Download CSV", "Download Parquet", "HTML report"] * 2 + ["HTML report of the comparison"]

    # What the buttons send: the file itself, the same profile as Parquet, one offline page.
    path = profiles_dir / "complete.csv"
    assert exports.export_bytes(path, "csv") == path.read_bytes()
    parquet = profiles_dir.parent / "out.parquet"
    parquet.write_bytes(exports.export_bytes(path, "parquet"))
    assert load_profile(parquet) == load_profile(path)
    with pytest.raises(ValueError, match="unknown export format 'xlsx'"):
        exports.export_bytes(path, "xlsx")
    page = exports.report_bytes(at.session_state[Keys.LOADED]).decode()
    assert page.count("Plotly.newPlot") == 3  # memory, quality, speed of both profiles
    assert "<h2>examples/smollm2-torch-256t</h2>" in page and "<h2>complete</h2>" in page
    assert "46,080" in page  # standard's bytes per token held, the bundled float32 model


def test_a_bad_upload_is_one_error_and_the_rest_of_the_page_keeps_working(profiles_dir, tiny_profiles):
    (profiles_dir / "complete.csv").write_bytes((tiny_profiles / "tiny-complete.csv").read_bytes())
    good = (tiny_profiles / "tiny-complete.csv").read_bytes()
    newer = re.sub(rb"schema_version,1\b", b"schema_version,2", good)
    assert newer != good
    at = new_app()
    at.switch_page("views/profiles.py").run()
    at.multiselect(key="compare").select("complete.csv").run()
    assert len(at.get("plotly_chart")) == 4
    for name, data, message in [
        ("notes.csv", b"a,b\n1,2\n", "notes.csv: not a cachelib profile (no 'table' column)"),
        ("future.csv", newer, "future.csv: profile schema version 2 is not supported; this cachelib reads version 1"),
        ("binary.csv", bytes(range(256)) * 4, "binary.csv"),
    ]:
        at.file_uploader(key="upload").set_value((name, data, "text/csv")).run()
        assert not at.exception
        assert len(errors(at)) == 1 and errors(at)[0].startswith(message), errors(at)
        assert len(at.get("plotly_chart")) == 4  # the loaded comparison is still drawn
        assert at.multiselect(key="compare").value == ["complete.csv"]
    at.file_uploader(key="upload").set_value(("mine.csv", good, "text/csv")).run()
    assert not errors(at) and "upload: mine.csv" in at.multiselect(key="compare").value


def test_generated_text_shows_each_strategys_first_departure_from_the_baseline(profiles_dir, tiny_profiles):
    from cachelib.profile.report import token_streams

    (profiles_dir / "complete.csv").write_bytes((tiny_profiles / "tiny-complete.csv").read_bytes())
    at = new_app()
    at.switch_page("views/profiles.py").run()
    at.multiselect(key="compare").select("complete.csv").run()
    assert not at.exception
    text = [m.value for m in at.markdown]
    profile = load_profile(tiny_profiles / "tiny-complete.csv")
    for s in token_streams(profile.frame("steps"), profile.strategies, profile.baseline)[1:]:
        header = next(t for t in text if t.startswith(f"**{s.strategy.replace('_', chr(92) + '_')}** — "))
        stream = text[text.index(header) + 1]
        if s.first_departure is None:
            assert "the same 24 tokens as the baseline" in header and ":orange-background[" not in stream
        else:
            assert f"first departs at step {s.first_departure}; {s.differing_steps} of 24 steps differ" in header
            assert stream.count(":orange-background[") == 1 and "~~" in stream  # teacher-forced: what it replaced
