"""Shared fixtures: real models are loaded once per test session (once per worker when the suite
runs in parallel, see below)."""

from __future__ import annotations

import os

import pytest

from cachelib.core.blas import set_openblas_threads
from cachelib.core.threads import release_thread_streams

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# --- running in parallel (pytest-xdist, ``-n auto`` in pyproject.toml) --------------------------------


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core this process may run on (xdist's own count is the machine's
    physical cores, which a container limited to 2 of them does not see), at most 8: each worker
    that runs the bundled-model tests holds its own copy of the model on both backends.
    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` still decides where it is set (xdist reads it)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    return min(_cores(), 8)


def pytest_configure(config):
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:  # a worker: share the cores with the others instead of each taking them all
        _share_blas_threads(max(1, _cores() // int(workers)))


def _share_blas_threads(threads: int) -> None:
    """OpenBLAS (MLX multiplies with it on a Linux CPU: cachelib.core.blas) starts one thread per
    core in every process; two workers on 2 cores would run 4 and wait on each other. Set here for
    this worker, and in the environment for the processes it starts (the CLI, ``streamlit run``,
    dask workers), where OpenBLAS reads it as it loads."""
    os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
    set_openblas_threads(threads)  # False: no OpenBLAS (macOS, or MLX's reference BLAS unlinked)


@pytest.hookimpl(trylast=True)  # on the order pytest settled on (parametrized fixtures grouped)
def pytest_collection_modifyitems(config, items):
    """A worker runs whole modules (``--dist loadscope``: a module-scoped fixture, some of which run
    the bundled model for minutes, is set up once, as in a serial run), in the order the workers
    collect them (``--no-loadscope-reorder``). That order puts the modules with slow tests first,
    then those with bundled-model tests: the long ones start while the short ones can still fill
    in behind them, instead of one starting last and running on alone. Serial runs keep the
    collection order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return

    def rank(item) -> int:
        return 0 if item.get_closest_marker("slow") else 1 if item.get_closest_marker("bundled") else 2

    module_rank: dict = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        module_rank[module] = min(module_rank.get(module, 2), rank(item))
    items.sort(key=lambda item: module_rank[item.nodeid.split("::", 1)[0]])  # stable: a module's order stays


def pytest_unconfigure(config):
    # MLX 0.32 frees its compile cache (compiled functions hold Python objects) in a thread-local
    # destructor that runs after the interpreter is gone unless the thread clears its streams:
    # without this, the process segfaults at exit (rc 139) after every test passed.
    release_thread_streams()


# --- fixtures ----------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2_mlx():
    from cachelib.models import load

    return load("smollm2", "mlx")


@pytest.fixture(scope="session")
def smollm2_torch():
    from cachelib.models import load

    return load("smollm2", "torch")


@pytest.fixture(scope="session")
def load_model():
    """``load_model(name, backend)``: a cached loader for presets and the bundled model."""
    from cachelib.models import load

    cache: dict = {}

    def get(name: str, backend: str):
        if (name, backend) not in cache:
            cache[name, backend] = load(name, backend)
        return cache[name, backend]

    return get


@pytest.fixture(scope="session")
def kept_positions(load_model):
    """``kept_positions(name, backend, strategies, prompt, max_tokens)``: the positions each
    layer and KV head of each strategy held at each step of a profile (the ``ring`` probe's slot
    table, rows with a head), as (strategy, step, layer, head, positions) rows."""
    from cachelib.profile import Probes, run_profile

    probes = Probes(memory=1, ring=1, quant_error=0, quality=0, masks=0, system=0)

    def get(name: str, backend: str, strategies: list[str], prompt: str, max_tokens: int):
        profile = run_profile(
            load_model(name, backend), strategies, prompt=prompt, max_tokens=max_tokens, probes=probes
        )
        assert profile.complete, profile.meta["reason"]
        slots = profile.frame("slots")
        slots = slots[slots["head"].notna()]
        return slots[["strategy", "step", "layer", "head", "positions"]].reset_index(drop=True)

    return get
