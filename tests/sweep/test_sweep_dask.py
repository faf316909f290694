"""Sweeps on a real local Dask cluster: the same numbers as running the points one by one, and a
worker killed mid-task ends as a failed point that a re-run completes without redoing the rest."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from distributed import Client

from cachelib.profile import load_profile, run_profile
from cachelib.sweep import load_grid, load_index, run_sweep

REPO = Path(__file__).resolve().parents[2]

# Columns that measure the machine, not the cache: they differ between any two runs.
MACHINE_COLUMNS = ["wall_seconds", "tokens_per_second", "device_active_bytes", "device_peak_bytes", "rss_bytes"]
RUN_IDENTITY = {"run_id", "created", "finished", "name", "path"}


def _write(tmp_path, text):
    path = tmp_path / "grid.toml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.bundled
@pytest.mark.slow
def test_sweep_on_two_workers_records_the_same_profiles_as_running_the_points_one_by_one(tmp_path, smollm2_mlx):
    # 2 strategies x 2 knob settings x 1 prompt, bundled model, 16 tokens: 2 runs of 3 strategies
    path = _write(
        tmp_path,
        """
models = ["smollm2"]
backends = ["mlx"]
devices = ["cpu"]
strategies = [
    { name = "rotating", max_size = [24, 40], keep = 4 },
    "quantized:bits=[4, 8],group_size=64",
]
prompts = ["What is a KV cache?"]
max_tokens = 16
""",
    )
    out = tmp_path / "sweep"
    result = run_sweep(path, out, workers=2)
    assert result.ok and result.count("done") == 2
    index = load_index(out)
    assert index["worker"].nunique() == 2  # both workers took a point

    expected = {
        "standard rotating:max_size=24,keep=4 quantized:bits=4,group_size=64": [
            "standard",
            "rotating:max_size=24,keep=4",
            "quantized:bits=4,group_size=64",
        ],
        "standard rotating:max_size=40,keep=4 quantized:bits=8,group_size=64": [
            "standard",
            "rotating:max_size=40,keep=4",
            "quantized:bits=8,group_size=64",
        ],
    }
    assert set(index["strategies"]) == set(expected)
    for _, row in index.iterrows():
        swept = load_profile(row["path"])
        run_profile(
            smollm2_mlx,
            expected[row["strategies"]],
            prompt="What is a KV cache?",
            max_tokens=16,
            out=tmp_path / "alone.csv",
        )
        alone = load_profile(tmp_path / "alone.csv")  # both sides read back from disk
        assert swept.complete and alone.complete
        assert {k: v for k, v in swept.meta.items() if k not in RUN_IDENTITY} == {
            k: v for k, v in alone.meta.items() if k not in RUN_IDENTITY
        }
        assert swept.name == row["point"]
        for table in ("steps", "layers", "slots", "masks"):
            a, b = swept.frame(table), alone.frame(table)
            if table == "steps":
                a, b = a.drop(columns=MACHINE_COLUMNS), b.drop(columns=MACHINE_COLUMNS)
            assert len(a) > 0, table
            pd.testing.assert_frame_equal(a, b, check_exact=True, obj=f"{row['point']} {table}")
        # the quantized caches quantized something and the rings evicted: the comparison is not vacuous
        assert swept.frame("layers")["key_bits"].notna().any()
        assert (swept.frame("layers")["evicted"].fillna(0) > 0).any()


@pytest.fixture
def dask_cli_cluster(tmp_path):
    """A scheduler and one worker started the way the README's "Sweeps" section tells a team to, as processes."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    info = tmp_path / "scheduler.json"
    common = ["--scheduler-file", str(info)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dask",
                "scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--no-dashboard",
                *common,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    try:
        deadline = time.monotonic() + 60
        while not info.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        address = json.loads(info.read_text())["address"]
        worker = [sys.executable, "-m", "dask", "worker", address, "--nthreads", "1", "--memory-limit", "0"]
        procs.append(subprocess.Popen(worker, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        with Client(address, timeout=60) as client:
            client.wait_for_workers(1, timeout=60)
        yield address
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


KILL_GRID = """
models = ["tiny-llama"]
devices = ["cpu"]
strategies = [{ name = "static", max_len = [512, 8, 256] }]
prompts = ["hello there"]
max_tokens = 64
"""


@pytest.mark.slow
def test_a_killed_worker_fails_its_point_after_one_retry_and_a_rerun_completes_only_the_failed(
    tmp_path, dask_cli_cluster
):
    path = _write(tmp_path, KILL_GRID)
    out = tmp_path / "sweep"
    ok, too_small, victim = [p.id for p in load_grid(path).points()]  # static:max_len=8 cannot hold the prompt

    started = []

    def kill_victim(event):
        if event.kind == "started":
            started.append(event.point)
            if event.point == victim:  # 64 steps: still running when its start reaches us
                os.kill(event.pid, signal.SIGKILL)

    first = run_sweep(path, out, workers=2, on_event=kill_victim)
    rows = {r["point"]: r for r in first.rows}
    assert {pid: r["status"] for pid, r in rows.items()} == {ok: "done", too_small: "failed", victim: "failed"}
    assert started.count(victim) == 2 and rows[victim]["attempts"] == "2"
    assert rows[victim]["error"].startswith("KilledWorker")
    # an exception is retried once too, then recorded, and the other points went on
    # refused before anything is allocated, by the planner's prediction, naming the strategy's knob
    assert rows[too_small]["attempts"] == "2" and "static: max_len=8" in rows[too_small]["error"]
    assert not (out / f"{victim}.csv").exists() and not (out / f"{too_small}.csv").exists()
    done_before = (out / rows[ok]["file"]).stat().st_mtime_ns
    index_before = load_index(out).set_index("point")

    # the re-run goes to a scheduler and worker started by hand, as on a real cluster
    events = []
    second = run_sweep(path, out, scheduler=dask_cli_cluster, on_event=events.append)
    assert not [e.message for e in events if e.kind == "note"]  # the worker offers what the points need
    started = [e.point for e in events if e.kind == "started"]
    rows = {r["point"]: r for r in second.rows}
    assert set(started) == {victim, too_small}  # the done point was not run again
    assert rows[victim]["status"] == "done" and rows[victim]["attempts"] == "1"
    assert load_profile(out / rows[victim]["file"]).complete
    assert rows[too_small]["status"] == "failed"
    assert (out / rows[ok]["file"]).stat().st_mtime_ns == done_before
    index_after = load_index(out).set_index("point")
    pd.testing.assert_series_equal(index_after.loc[ok], index_before.loc[ok])
