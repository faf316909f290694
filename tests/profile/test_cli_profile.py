"""`python -m cachelib profile`: the same run from the command line; bad input exits 2 with one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cachelib.cli import main
from cachelib.profile import load_profile


def test_profile_command_writes_a_profile_and_prints_a_summary(tmp_path, capsys):
    out = tmp_path / "cli.csv"
    code = main(
        [
            "profile",
            "--model",
            "tiny-llama",
            "--backend",
            "torch",
            "--strategy",
            "standard",
            "--max-kv-size",
            "16",
            "--kv-bits",
            "4",
            "--prompt",
            "hello there",
            "--max-tokens",
            "12",
            "--sample-every",
            "4",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "rotating:max_size=16,keep=4,bits=4,group_size=64" in printed and "complete" in printed
    profile = load_profile(out)
    assert profile.strategies == ["standard", "rotating:max_size=16,keep=4,bits=4,group_size=64"]
    assert profile.frame("steps")["step"].max() == 11


@pytest.mark.parametrize(
    "args, message",
    [
        (["--strategy", "lru"], "unknown strategy 'lru'"),
        (["--strategy", "rotating:max_size=abc"], "must be an integer"),
        (["--strategy", "rotating:max_size=0"], "must be >= 1"),
        (["--max-tokens", "0"], "--max-tokens: must be >= 1"),
        (["--prompt", ""], "prompt is empty"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, message, tmp_path):
    base = ["--model", "tiny-llama", "--prompt", "hi", "--max-tokens", "2", "--out", str(tmp_path / "x.csv")]
    # Later flags win in argparse, so the bad value overrides the default above.
    proc = subprocess.run(
        [sys.executable, "-m", "cachelib", "profile", *base, *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr
