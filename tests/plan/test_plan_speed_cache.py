"""This CPU's probes kept between plans (cachelib.plan.hardware): the bandwidth/matmul probe and the
attention probe are measured once per key (CPU, backend and its libraries, dtype, model shape,
threads) and read back from the cache file by the next plan; a changed key or ``--reprobe``
measures again; a corrupt or unreadable file is measured over, never a crash."""

from __future__ import annotations

import json
import os

import pytest

from cachelib.cli import main
from cachelib.plan import PlanRequest, preset
from cachelib.plan import cpu_probe as hw_mod
from cachelib.plan import speed as speed_mod
from cachelib.plan.hardware import AttentionProbe

ARCH = preset("smollm2")
FIT = {
    "bandwidth_fraction": 0.4,
    "compute_fraction": 0.2,
    "overhead_s": 0.0,
    "spread": 0.1,
    "source": "made up",
    "pair_s": 0.0,
    "row_s": 0.02,
    "attention_scale": 0.8,
    "compute_probe": "mlx",
}


@pytest.fixture
def counted(tmp_path, monkeypatch):
    """A cache file in ``tmp_path`` with a saved MLX fit that charges attention by the probe, and
    the probes replaced by counting fakes; fresh per-process memory (a new process each plan)."""
    path = tmp_path / "cpu_probe.json"
    path.write_text(json.dumps({"calibration": {"cachelib-mlx": FIT}}))
    monkeypatch.setattr(hw_mod, "PROBE_CACHE", path)
    calls = {"attention": 0, "cpu": 0}

    def measure(self, length, bits=None, group_size=64, queries=1):
        calls["attention"] += 1
        return 1e-6 * length * queries

    def measure_cpu(seconds=0.6, backend=None):
        calls["cpu"] += 1
        return 10e9, 50e9

    monkeypatch.setattr(AttentionProbe, "measure", measure)
    monkeypatch.setattr(hw_mod, "measure_cpu", measure_cpu)
    new_process()
    yield path, calls
    hw_mod.reprobe(False)
    new_process()


def new_process():
    hw_mod._PROBED.clear()
    speed_mod._attention_probe.cache_clear()


def plan_speed(context: int = 1024, dtype: str = "float32"):
    r = PlanRequest(
        ["standard"], context=context, batch=1, backend="mlx", runtime="cachelib", dtype=dtype, device="cpu"
    )
    return speed_mod.SpeedModel(ARCH, r, "cpu").speed("standard", 1)


def test_a_second_plan_reads_the_probes_from_the_cache(counted):
    path, calls = counted
    first = plan_speed()
    assert calls["attention"] > 0 and calls["cpu"] == 1
    assert first.efficiency.attention_scale == 0.8 and first.cost.probed_attention_s > 0
    measured = dict(calls)
    new_process()
    second = plan_speed()
    assert calls == measured  # nothing probed again
    assert second.step_s == first.step_s
    kept = json.loads(path.read_text())
    assert kept["calibration"]["cachelib-mlx"] == FIT  # the saved fit is left as it was
    (entry,) = kept["attention"].values()
    assert len(entry) == calls["attention"]


def test_a_changed_key_probes_again(counted, monkeypatch):
    path, calls = counted
    plan_speed()
    before = calls["attention"]
    new_process()
    plan_speed(dtype="float16")  # another dtype: other points
    assert calls["attention"] > before
    before = calls["attention"]
    new_process()
    threads = "3" if os.environ.get("OPENBLAS_NUM_THREADS") == "2" else "2"  # CI's workers run one already
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", threads)  # another thread regime
    plan_speed()
    assert calls["attention"] > before
    assert len(json.loads(path.read_text())["attention"]) == 3
    before = calls["attention"]
    new_process()
    plan_speed(context=4096)  # a new length: only it is measured
    assert 0 < calls["attention"] - before <= 2


@pytest.mark.parametrize(
    "text",
    ["{not json", "[1, 2]", '{"attention": []}', '{"attention": {"x": 1}}', "null"],
    ids=["not json", "a list", "attention a list", "a foreign key", "null"],
)
def test_a_corrupt_cache_is_probed_again_not_a_crash(counted, text):
    path, calls = counted
    path.write_text(text)
    s = plan_speed()  # no saved fit left: the whole peaks, +-50%, and no attention probe
    assert s.tokens_per_s.value > 0 and calls["cpu"] == 1
    got = json.loads(path.read_text())  # written over as valid JSON
    assert isinstance(got, dict) and got[hw_mod.cpu_identity()]["flops_float32_mlx"] == 50e9


def test_a_corrupt_attention_entry_is_measured_again(counted):
    path, calls = counted
    plan_speed()
    got = json.loads(path.read_text())
    (key,) = got["attention"]
    got["attention"][key] = {k: "fast" for k in got["attention"][key]}  # not numbers
    path.write_text(json.dumps(got))
    before = calls["attention"]
    new_process()
    plan_speed()
    assert calls["attention"] == 2 * before
    assert all(isinstance(v, float) for v in json.loads(path.read_text())["attention"][key].values())


def test_reprobe_measures_again_and_keeps_the_new_figures(counted):
    path, calls = counted
    plan_speed()
    measured = dict(calls)
    new_process()
    hw_mod.reprobe()
    plan_speed()
    assert calls == {k: 2 * v for k, v in measured.items()}
    new_process()
    hw_mod.reprobe(False)
    plan_speed()
    assert calls == {k: 2 * v for k, v in measured.items()}  # read back again


def test_the_cli_reprobe_flag(counted, capsys):
    path, calls = counted
    args = ["plan", "--model", "smollm2", "--context", "512", "--backend", "mlx", "--runtime", "cachelib"]
    args += ["--dtype", "float32", "--hardware", "cpu", "--no-default-evidence"]
    assert main(args) == 0
    measured = dict(calls)
    assert measured["attention"] > 0
    new_process()
    assert main(args) == 0
    assert calls == measured
    new_process()
    assert main([*args, "--reprobe"]) == 0
    assert calls["attention"] == 2 * measured["attention"] and calls["cpu"] == 2
    assert "tokens/s" in capsys.readouterr().out


def test_a_saved_fit_of_another_compute_probe_is_not_used(counted):
    path, _ = counted
    path.write_text(json.dumps({"calibration": {"cachelib-mlx": {**FIT, "compute_probe": None}}}))
    assert "not calibrated on this CPU" in plan_speed().efficiency.source
    old = {k: v for k, v in FIT.items() if k != "compute_probe"}  # a fit saved before the backend's own probe
    path.write_text(json.dumps({"calibration": {"cachelib-mlx": old}}))
    assert "not calibrated on this CPU" in plan_speed().efficiency.source


def test_the_probe_file_is_written_whole_through_a_file_of_its_own(tmp_path, monkeypatch):
    path = tmp_path / "cpu_probe.json"
    path.write_text('{"kept": 1}')
    seen = []
    real_replace = hw_mod.os.replace

    def replace(src, dst):
        seen.append(json.loads(open(src).read()))  # the new file is whole before it takes the name
        assert json.loads(path.read_text()) == {"kept": 1}  # and the old one stands until then
        real_replace(src, dst)

    monkeypatch.setattr(hw_mod.os, "replace", replace)
    hw_mod._write_probe_cache({"kept": 2}, path)
    assert seen == [{"kept": 2}] and json.loads(path.read_text()) == {"kept": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu_probe.json"]  # no file of its own left behind
    monkeypatch.setattr(hw_mod.os, "replace", lambda src, dst: (_ for _ in ()).throw(PermissionError(dst)))
    hw_mod._write_probe_cache({"kept": 3}, path)  # refused: the figures are not kept, nothing is left behind
    assert json.loads(path.read_text()) == {"kept": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu_probe.json"]
