"""The end of a thread that may have run MLX.

MLX (0.31.2 on: ml-explore/mlx#3727) gives every thread that evaluates its own streams, and asks
that a thread other than the main one destroy them before it ends, with ``mx.clear_streams()``:
Python has no thread-level exit hook for MLX to do it itself (ml-explore/mlx#4373; the call: #3395).
Left to the process's exit, MLX 0.32.4 ended a process whose worker thread had evaluated arrays with
``terminate called without an active exception`` (exit 134) in 3 to 5 of 10 runs here
(bench/README.md). The test suite's main thread calls it too, at the end of the session: without
it MLX 0.32 crashed that process at exit, after every test passed (tests/conftest.py).
"""

from __future__ import annotations

import sys


def release_thread_streams() -> None:
    """Destroy the MLX streams the calling thread created; call it last in a thread that may have
    run MLX, never in the middle: a thread that evaluates again afterwards finds its streams gone
    (``There is no Stream(cpu, 1) in current thread``). Nothing happens where MLX was never
    imported (a torch-only install) or the thread created no streams."""
    mx = sys.modules.get("mlx.core")
    if mx is not None and hasattr(mx, "clear_streams"):  # an older MLX has none (added by #3395)
        mx.clear_streams()
