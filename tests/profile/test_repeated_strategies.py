"""One rule for a repeated strategy, the same in the library, the CLI, the app and the reader: a
run refuses it before anything runs (one line naming both places), so every profile names each
strategy once and whatever is saved reopens. Every kind of run the app can start is saved here
and read back by the loader, the Profiles page's reader and the HTML report."""

from __future__ import annotations

import json
import re

import pytest

from cachelib.cli import main
from cachelib.profile import (
    Probes,
    check_distinct,
    list_profiles,
    load_profile,
    read_meta,
    run_profile,
    save_profile,
)
from cachelib.profile.report import report_html
from cachelib.spec import parse_spec

STRATEGIES = [
    "standard",
    "rotating:max_size=16,keep=2",
    "rotating:max_size=16,keep=3",
    "quantized:bits=4,group_size=32",
]


@pytest.mark.parametrize(
    "specs, says",
    [
        (
            ["standard", "rotating:max_size=16,keep=2", "rotating:max_size=16,keep=2"],
            "strategy 3 (rotating:max_size=16,keep=2) repeats strategy 2: ",
        ),
        (
            ["quantized:bits=4", "quantized:bits=4,group_size=64"],
            "strategy 2 (quantized:bits=4,group_size=64) repeats the baseline (quantized:bits=4): ",
        ),
    ],
)
def test_a_repeated_strategy_is_refused_before_anything_runs(tmp_path, specs, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        check_distinct([parse_spec(s) for s in specs])
    with pytest.raises(ValueError, match=re.escape(says)):
        run_profile("no-such-model-is-loaded", specs, prompt="hi", out=tmp_path / "x.csv")
    assert not list(tmp_path.iterdir())  # nothing written, not even a partial file


def test_the_cli_refuses_a_repeated_strategy_with_one_line(tmp_path, capsys):
    code = main(
        [
            "profile",
            "--model",
            "tiny-llama",
            "--strategy",
            "standard",
            "--strategy",
            "standard",
            "--prompt",
            "hi",
            "--out",
            str(tmp_path / "x.csv"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: strategy 2 (standard) repeats the baseline")


KINDS = {  # every kind of run the Live page can start (its run form's choices)
    "batch-prompt": dict(prompt="Hello there"),
    "one-by-one": dict(prompt="Hello there", one_by_one=True),
    "free-running": dict(prompt="Hello there", free_running=True),
    "evaluation-text": dict(text="The quick brown fox jumps over the lazy dog. " * 4),
    "sampled-probes": dict(prompt="Hello there", probes=Probes(memory=2, quality=2, masks=3, ring=2)),
    "probes-off": dict(prompt="Hello there", probes=Probes(masks=0, ring=0, quant_error=0)),
}


@pytest.mark.parametrize("kind", [*KINDS, "stopped"])
def test_every_kind_of_run_the_app_makes_is_saved_and_reopens(tmp_path, load_model, kind):
    model = load_model("tiny-llama", "mlx")
    options = KINDS.get(kind, dict(prompt="Hello there"))
    steps = iter(range(10**6))
    stop = (lambda: next(steps) >= 2) if kind == "stopped" else None
    out = tmp_path / f"{kind}.csv"
    profile = run_profile(model, STRATEGIES, max_tokens=5, out=out, name=kind, should_stop=stop, **options)
    assert profile.path == out
    (listed,) = list_profiles(tmp_path)
    meta = read_meta(listed.path, name=listed.name)  # what the Profiles page lists
    assert meta["status"] == ("incomplete" if kind == "stopped" else "complete")
    assert json.loads(meta["strategies"]) == STRATEGIES == json.loads(meta["specs"])
    again = load_profile(out)  # what the Profiles page loads and `cachelib report` reads
    assert again.strategies == STRATEGIES
    page = report_html([again], [kind])
    assert f"cachelib profile: {kind}" in page
    # The Profiles page's "Save as" writes the loaded profile again; that file reopens too, and
    # `python -m cachelib report` reads both.
    saved = save_profile(again, tmp_path / f"{kind}-copy.csv")
    assert load_profile(saved).strategies == STRATEGIES
    assert main(["report", str(out), str(saved), "--out", str(tmp_path / "report.html")]) == 0


def test_a_profile_of_an_older_version_that_labelled_a_copy_reopens(tmp_path, load_model):
    """Older versions ran a repeated spec and named the copy "spec#2" (its "specs" repeat): the
    names are distinct, so the file reads; a file naming one strategy twice does not."""
    model = load_model("tiny-llama", "mlx")
    out = tmp_path / "old.csv"
    run_profile(model, ["standard", "rotating:max_size=16,keep=2"], prompt="Hi", max_tokens=3, out=out)
    text = out.read_text()
    old = text.replace("rotating:max_size=16,keep=2", "standard#2")  # its label, in meta and rows
    specs = re.search(r'specs,"(\[[^\n]*\])"', old)
    assert specs is not None
    old = old.replace(specs.group(0), 'specs,"[""standard"", ""standard""]"')
    (tmp_path / "old.csv").write_text(old)
    assert load_profile(tmp_path / "old.csv").strategies == ["standard", "standard#2"]
    broken = old.replace('""standard#2""]', '""standard""]')
    (tmp_path / "twice.csv").write_text(broken)
    with pytest.raises(ValueError, match=r"names the strategy 'standard' twice"):
        load_profile(tmp_path / "twice.csv")
