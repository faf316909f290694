"""The formatter and the linter configured in pyproject.toml hold over the whole tree (CI runs them here)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ruff_check_finds_nothing():
    done = _ruff("check", "--no-cache", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_format_would_change_nothing():
    done = _ruff("format", "--check", "--no-cache", ".")
    assert done.returncode == 0, done.stdout + done.stderr
