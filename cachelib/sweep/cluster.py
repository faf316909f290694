"""Where a sweep runs: a local Dask cluster sized to this machine, or a scheduler's workers.

Every worker is one process that runs one profile at a time (``nthreads=1``), so runs never
share a process, and a run on an accelerator holds that device's Dask resource (``GPU=1`` for
CUDA, ``MLX=1`` for the Apple GPU), so two profiles never share a device. The local cluster gives
CPU runs ``workers`` processes and each accelerator the points need one worker of its own. This
module knows Dask deployment; it does not know grids beyond a point's backend, device and resources.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Sequence

from .grid import Point

GIB = 2**30
# Scheduler setting: a task whose worker dies is tried on a second worker, then fails (KilledWorker).
ALLOWED_FAILURES = 1
# A local cluster listens on loopback only: its dashboard serves logs, call stacks and file paths.
# To share a cluster, start `dask scheduler` / `dask worker` yourself and pass --scheduler.
LOOPBACK = "127.0.0.1"


def default_workers() -> int:
    """Local CPU workers: one per two cores (each run's BLAS uses threads), one per 4 GiB of memory."""
    cores = os.cpu_count() or 1
    try:
        import psutil

        by_memory = max(1, int(psutil.virtual_memory().total // (4 * GIB)))
    except Exception:  # psutil missing: count cores only
        by_memory = cores
    return max(1, min(cores // 2, by_memory))


def check_local_devices(points: Sequence[Point]) -> None:
    """Refuse points whose device this machine lacks, before any cluster starts."""
    from ..models import available_devices

    seen = set()
    for p in points:
        if (p.backend, p.device) in seen:
            continue
        seen.add((p.backend, p.device))
        have = available_devices(p.backend)
        if p.device not in have:
            raise ValueError(
                f"device {p.device!r} for {p.backend} is not on this machine (it has: {', '.join(have)}); "
                "run the sweep on a cluster that has it (--scheduler) or change 'devices'"
            )


def _cuda_count() -> int:
    try:
        import torch

        n = torch.cuda.device_count()
    except Exception:  # torch without CUDA support
        n = 0
    if n == 0:
        from ..models import available_devices

        n = 1 if "cuda" in available_devices("mlx") else 0
    return n


def worker_specs(points: Sequence[Point], workers: int | None = None) -> dict[str, dict]:
    """Nanny options per local worker: ``workers`` CPU workers (default: sized to the machine, none
    when no point runs on the CPU), one ``GPU=1`` worker per CUDA device (each seeing only its
    own through CUDA_VISIBLE_DEVICES) and one ``MLX=1`` worker for the Apple GPU, if points need them."""
    needs = {r for p in points for r in p.resources}
    cpu_points = any(not p.resources for p in points)
    n_cpu = workers if workers is not None else (default_workers() if cpu_points else 0)
    specs: dict[str, dict] = {f"cpu-{i}": _nanny({}) for i in range(n_cpu)}
    if "GPU" in needs:
        for i in range(_cuda_count()):
            specs[f"gpu-{i}"] = _nanny({"GPU": 1}, {"CUDA_VISIBLE_DEVICES": str(i)})
    if "MLX" in needs:
        specs["mlx"] = _nanny({"MLX": 1})
    return specs


def _nanny(resources: dict[str, int], env: dict[str, str] | None = None) -> dict:
    from distributed import Nanny

    options = {
        "nthreads": 1,
        "memory_limit": 0,  # Dask must not pause or kill a run for the memory a model needs
        "resources": resources or None,
        "host": LOOPBACK,
        "dashboard": False,
        "dashboard_address": f"{LOOPBACK}:0",  # a worker's HTTP server (metrics) runs even without a dashboard
        "silence_logs": logging.CRITICAL,
    }
    if env:
        options["env"] = env
    return {"cls": Nanny, "options": options}


def start_local_cluster(points: Sequence[Point], workers: int | None = None):
    """A local cluster of worker processes for ``points`` (see :func:`worker_specs`)."""
    from distributed import Scheduler, SpecCluster

    specs = worker_specs(points, workers)
    if not specs:
        raise ValueError("the local cluster would have no workers; give --workers >= 1")
    scheduler = {
        "cls": Scheduler,
        "options": {
            "host": LOOPBACK,
            "dashboard": has_dashboard(),
            # ":0" would bind every interface (Dask reads an empty host as 0.0.0.0)
            "dashboard_address": f"{LOOPBACK}:0",
            "allowed_failures": ALLOWED_FAILURES,
        },
    }
    return SpecCluster(workers=specs, scheduler=scheduler, silence_logs=logging.CRITICAL, name="cachelib-sweep")


def has_dashboard() -> bool:
    """Dask's dashboard needs bokeh; without it the local cluster runs without one."""
    return importlib.util.find_spec("bokeh") is not None


def remote_notes(client, points: Sequence[Point]) -> list[str]:
    """What a scheduler's workers lack for ``points``: resources nobody offers, shared processes."""
    workers = client.scheduler_info(n_workers=-1).get("workers", {})
    address = client.scheduler.address
    notes = []
    if not workers:
        notes.append(f"no workers are connected to {address} yet; the points wait until some join")
    offered = {r for w in workers.values() for r in (w.get("resources") or {})}
    for resource in sorted({r for p in points for r in p.resources} - offered):
        devices = sorted({p.device for p in points if resource in p.resources})
        notes.append(
            f"no worker offers {resource}=1, so the points on {', '.join(devices)} wait until one joins "
            f'(dask worker {address} --nthreads 1 --resources "{resource}=1")'
        )
    for addr, w in workers.items():
        if w.get("nthreads", 1) > 1:
            notes.append(
                f"worker {addr} runs {w['nthreads']} tasks at once: profiles on it share one process "
                "and its memory; start workers with --nthreads 1"
            )
    return notes
