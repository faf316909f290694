"""``python -m cachelib plan`` imports only what planning needs (issue 29: the CLI under 1.5 s):
no other subcommand's module, no pandas once the evidence is cached, and its output is the same
whether the evidence was read from its files or from the cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAN = ["plan", "--model", "llama-3.1-8b", "--context", "32768", "--budget", "24GiB", "--runtime", "mlx-lm"]
# runs the CLI in a fresh interpreter, then prints the modules it imported
PROBE = (
    "import sys\nfrom cachelib.cli import main\ncode = main(sys.argv[1:])\n"
    "print('MODULES', ' '.join(sorted(m for m in sys.modules if m.startswith(('cachelib', 'pandas')))))\n"
    "sys.exit(code)\n"
)


def _plan(cache: Path) -> tuple[str, set[str]]:
    env = {**os.environ, "CACHELIB_HOME": str(cache)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *PLAN], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    out, _, modules = done.stdout.rpartition("MODULES ")
    return out, set(modules.split())


def test_plan_imports_neither_pandas_once_the_evidence_is_cached_nor_other_subcommands(tmp_path):
    cold, first = _plan(tmp_path)
    assert "pandas" in first  # the first read parses the evidence files
    warm, again = _plan(tmp_path)
    assert warm == cold and warm.startswith("answer: standard (no cache flag) on mlx-lm")
    assert not {m for m in again if m == "pandas" or m.startswith("pandas.")}
    others = {
        "cachelib.cli.evaluate",
        "cachelib.cli.report",
        "cachelib.cli.retrieval",
        "cachelib.sweep",
        "cachelib.profile.run",
        "cachelib.profile.store",
        "cachelib.profile.report",
    }
    assert not others & again
