"""``python -m cachelib sweep``: bad input is one line and exit code 2, before anything runs."""

from __future__ import annotations

import pytest

from cachelib.cli import main
from cachelib.models import available_devices
from cachelib.profile import Profile, save_profile
from cachelib.sweep import GRID_KEYS, load_grid
from cachelib.sweep.index import pending_row, write_index

GRID = """\
name = "cli"
models = ["tiny-llama"]
devices = ["cpu"]
strategies = ["rotating:max_size=[8, 16]"]
prompts = ["hello"]
max_tokens = 4
"""


def _grid(tmp_path, text=GRID):
    path = tmp_path / "grid.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_bad_grid_exits_2_with_one_line_naming_the_line_and_writes_nothing(tmp_path, capsys):
    path = _grid(tmp_path, GRID.replace("max_tokens = 4", "max_tokens = 4\nstrategy = 'concat'"))
    out = tmp_path / "out"
    assert main(["sweep", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {path}:7: unknown key 'strategy'; keys: {', '.join(GRID_KEYS)}\n"
    assert not out.exists()


def test_a_missing_grid_file_exits_2(tmp_path, capsys):
    assert main(["sweep", str(tmp_path / "nope.toml")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'nope.toml'}: no such grid file\n"


def test_workers_with_a_scheduler_is_refused(tmp_path, capsys):
    assert main(["sweep", str(_grid(tmp_path)), "--scheduler", "tcp://127.0.0.1:8786", "--workers", "2"]) == 2
    assert "--workers sizes the local cluster" in capsys.readouterr().err


def test_a_scheduler_address_dask_cannot_use_exits_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["sweep", str(_grid(tmp_path)), "--scheduler", "nonsense://host:8786", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown address scheme 'nonsense'") and err.count("\n") == 1
    assert not out.exists()


def test_a_device_this_machine_lacks_is_refused_before_a_local_cluster_starts(tmp_path, capsys):
    if "metal" in available_devices("mlx"):
        pytest.skip("this machine has the Apple GPU")
    path = _grid(tmp_path, GRID.replace('devices = ["cpu"]', 'devices = ["metal"]'))
    assert main(["sweep", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: device 'metal' for mlx is not on this machine") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_dry_run_lists_the_points_and_their_resources_and_runs_nothing(tmp_path, capsys):
    path = _grid(tmp_path)
    out = tmp_path / "out"
    assert main(["sweep", str(path), "--out", str(out), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    ids = [p.id for p in load_grid(path).points()]
    assert lines == [
        f"run  {ids[0]}  [-]  standard rotating:max_size=8",
        f"run  {ids[1]}  [-]  standard rotating:max_size=16",
        f"2 points, 2 to run -> {out}",
    ]
    assert not out.exists()


def test_a_finished_sweep_reports_its_points_and_exits_0_without_starting_a_cluster(tmp_path, capsys):
    path = _grid(tmp_path)
    out = tmp_path / "out"
    rows = []
    for p in load_grid(path).points():
        meta = {"schema_version": 1, "status": "complete", "backend": "mlx", "model": p.model}
        meta |= {"strategies": '["standard"]', "baseline": "standard", "name": p.id}
        save_profile(Profile(meta), out / p.file)
        rows.append(pending_row(p) | {"status": "done", "file": p.file})
    write_index(out, rows)
    assert main(["sweep", str(path), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"sweep: 2 points: 2 done, 0 stopped, 0 failed -> {out / 'index.csv'}\n"
    assert "2 of 2 points finished earlier" in captured.err
