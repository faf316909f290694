"""Resuming a sweep from its folder (index.csv + profiles), and the progress display. No Dask here."""

from __future__ import annotations

import csv
import io

import pytest

from cachelib.profile import Profile, save_profile
from cachelib.sweep import INDEX_COLUMNS, SweepEvent, load_index, parse_grid, plan_sweep, run_sweep
from cachelib.sweep.index import pending_row, write_index
from cachelib.sweep.progress import Progress

GRID = """\
name = "resume"
models = ["tiny-llama"]
devices = ["cpu"]
strategies = ["rotating:max_size=[8, 16, 24, 32]"]
prompts = ["hello"]
max_tokens = 4
"""


@pytest.fixture
def sweep(tmp_path):
    path = tmp_path / "grid.toml"
    path.write_text(GRID, encoding="utf-8")
    grid = parse_grid(GRID, path)
    return path, grid.points(), tmp_path / "out"


def _profile_file(folder, point, status="complete", reason=""):
    meta = {
        "schema_version": 1,
        "status": status,
        "reason": reason,
        "backend": point.backend,
        "model": point.model,
        "strategies": '["standard"]',
        "baseline": "standard",
        "name": point.id,
        "created": "2026-01-01T00:00:00+00:00",
        "finished": "2026-01-01T00:00:05+00:00",
    }
    save_profile(Profile(meta), folder / point.file)


def test_a_new_folder_runs_every_point_and_planning_writes_nothing(sweep):
    path, points, out = sweep
    plan = plan_sweep(path, out)
    assert [p.id for p in plan.todo] == [p.id for p in points]
    assert not out.exists()


def test_a_rerun_skips_finished_points_and_retries_failed_pending_and_lost_ones(sweep):
    path, points, out = sweep
    out.mkdir()
    rows = [pending_row(p) for p in points]
    rows[0].update(status="done", file=points[0].file, attempts="1")
    rows[1].update(status="failed", error="KilledWorker: ...", attempts="2")
    rows[2].update(status="done", file=points[2].file)  # its profile was deleted since
    rows[3].update(status="stopped", file=points[3].file, error="memory guard: ...")
    _profile_file(out, points[0])
    _profile_file(out, points[3], "incomplete", "memory guard: ...")
    write_index(out, rows)

    plan = plan_sweep(path, out)
    assert [p.id for p in plan.todo] == [points[1].id, points[2].id]
    assert plan.rows[points[0].id]["attempts"] == "1"  # kept as recorded
    assert plan.rows[points[1].id]["status"] == "pending" and plan.rows[points[1].id]["error"] == ""


def test_a_done_run_whose_profile_does_not_open_is_run_again_and_says_why(sweep):
    # a done row whose profile is 0 bytes used to be skipped forever (issue 17, item 5)
    path, points, out = sweep
    out.mkdir()
    rows = [pending_row(p) for p in points]
    rows[0].update(status="done", file=points[0].file)
    (out / points[0].file).write_bytes(b"")
    rows[1].update(status="done", file=points[1].file)
    (out / points[1].file).write_text("not,a\nprofile,at all\n", encoding="utf-8")
    rows[2].update(status="done", file=points[2].file)  # done, but its profile never closed
    _profile_file(out, points[2], "running")
    rows[3].update(status="stopped", file=points[3].file, error="memory guard: ...")
    _profile_file(out, points[3], "incomplete", "memory guard: ...")  # stopped early: that is what stopped means
    write_index(out, rows)

    plan = plan_sweep(path, out)
    assert [p.id for p in plan.todo] == [points[0].id, points[1].id, points[2].id]
    assert all(plan.rows[p.id]["status"] == "pending" for p in points[:3])
    why = plan.reruns
    assert set(why) == {points[0].id, points[1].id, points[2].id}
    assert "empty (0 bytes)" in why[points[0].id] and points[0].file in why[points[0].id]
    assert "does not open" in why[points[1].id] and points[1].file in why[points[1].id]
    assert "incomplete" in why[points[2].id]
    assert all(w.endswith("running it again") for w in why.values())


@pytest.mark.slow
def test_a_rerun_of_an_empty_done_profile_prints_why_and_leaves_a_profile_that_opens(tmp_path):
    from cachelib.profile import read_meta

    grid = tmp_path / "grid.toml"
    grid.write_text(GRID.replace("[8, 16, 24, 32]", "8"), encoding="utf-8")
    out = tmp_path / "out"
    first = run_sweep(grid, out, workers=1)
    (out / first.rows[0]["file"]).write_bytes(b"")
    log = io.StringIO()
    second = run_sweep(grid, out, workers=1, on_event=Progress(log, tty=False))
    assert second.ok
    assert f"was done but its profile {first.rows[0]['file']} is empty (0 bytes); running it again" in log.getvalue()
    assert read_meta(out / second.rows[0]["file"])["status"] == "complete"


def test_a_profile_written_before_its_index_row_counts_as_finished(sweep):
    path, points, out = sweep
    out.mkdir()
    _profile_file(out, points[1])
    _profile_file(out, points[2], "incomplete", "memory guard: step 3 would pass the limit")
    plan = plan_sweep(path, out)
    assert points[1] not in plan.todo and points[2] not in plan.todo
    assert plan.rows[points[1].id]["status"] == "done"
    assert plan.rows[points[2].id]["status"] == "stopped"
    assert "memory guard" in plan.rows[points[2].id]["error"]


def test_a_finished_sweep_reruns_nothing_and_keeps_rows_of_points_no_longer_in_the_grid(sweep):
    path, points, out = sweep
    out.mkdir()
    rows = []
    for p in points:
        _profile_file(out, p)
        rows.append(pending_row(p) | {"status": "done", "file": p.file})
    old = pending_row(points[0]) | {"point": "an-earlier-grid-point", "status": "done", "file": "old.csv"}
    write_index(out, [old, *rows])
    events = []
    result = run_sweep(path, out, on_event=events.append)  # nothing to run: no cluster starts
    assert result.ok and result.count("done") == len(points)
    assert [e.kind for e in events] == ["skipped"]
    index = load_index(out)
    assert list(index["point"]) == [p.id for p in points] + ["an-earlier-grid-point"]
    assert list(index.columns) == [*INDEX_COLUMNS, "path"]
    assert index.loc[0, "path"] == str(out / points[0].file)
    assert (out / "grid.toml").read_text() == GRID


def test_an_index_with_an_unknown_status_is_refused(sweep):
    path, points, out = sweep
    out.mkdir()
    write_index(out, [pending_row(points[0]) | {"status": "finished"}])
    with pytest.raises(ValueError, match="status 'finished'"):
        plan_sweep(path, out)


def test_the_index_is_plain_csv_with_the_documented_columns(sweep):
    path, points, out = sweep
    write_index(out, [pending_row(points[0])])
    with open(out / "index.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert tuple(row) == INDEX_COLUMNS
    assert row["strategies"] == "standard rotating:max_size=8" and row["status"] == "pending"
    assert row["mode"] == "teacher-forced" and row["input"] == "hello" and row["max_tokens"] == "4"


def test_progress_in_a_log_prints_one_line_per_point_that_ends():
    out = io.StringIO()
    progress = Progress(out, tty=False)
    progress(SweepEvent("started", "p1", attempt=1, total=3))
    progress(SweepEvent("done", "p1", seconds=2.5, total=3, done=1))
    progress(SweepEvent("failed", "p2", message="ValueError: too long", attempt=2, total=3, done=1, failed=1))
    assert out.getvalue().splitlines() == [
        "[1/3] done p1 in 2.5 s",
        "[2/3] failed p2 after 2 attempt(s): ValueError: too long",
    ]


def test_progress_on_a_terminal_redraws_one_bar_with_done_failed_left():
    out = io.StringIO()
    progress = Progress(out, tty=True)
    progress(SweepEvent("started", "p1", attempt=1, total=4, running=2))
    progress(SweepEvent("failed", "p2", message="boom", attempt=2, total=4, done=1, failed=1, running=1))
    progress.close()
    text = out.getvalue()
    assert "0 done, 0 failed, 4 left (2 running)" in text
    assert "failed p2 after 2 attempt(s): boom\n" in text
    last_bar = text.rstrip("\n").split("\r")[-1]
    assert last_bar.startswith("[" + "#" * 8 + "-" * 8 + " " * 14 + "] 1 done, 1 failed, 2 left (1 running)")
