"""The OpenBLAS this process multiplies with on a Linux CPU, for setting its thread count.

MLX's Linux CPU wheel ships a slow reference BLAS (``mlx_cpu.libs/libblas-*.so``);
``scripts/bootstrap.sh`` links that file to Debian's OpenBLAS, so MLX multiplies with OpenBLAS
(~30x faster) while PyTorch keeps its own MKL (a preloaded OpenBLAS also took PyTorch's
few-row products: a decode step of SmolLM2-135M 3.2x slower, measured). :func:`openblas` finds
that library, or one preloaded into the process; None on macOS (Accelerate) or without it.
"""

from __future__ import annotations

import ctypes
import importlib.util
from functools import cache
from pathlib import Path

OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)


def mlx_blas() -> Path | None:
    """The BLAS file MLX's Linux CPU wheel loads (``mlx_cpu.libs/libblas-*.so*``), if installed."""
    spec = importlib.util.find_spec("mlx")
    for top in (spec.submodule_search_locations or []) if spec is not None else []:
        found = sorted(Path(top).parent.glob("mlx_cpu.libs/libblas-*.so*"))
        if found:
            return found[0]
    return None


@cache
def openblas() -> ctypes.CDLL | None:
    """A handle on the OpenBLAS MLX multiplies with (loading it, as MLX would), or on one preloaded
    into the process; None where there is none (macOS, or the wheel's reference BLAS unlinked)."""
    try:
        candidates = [ctypes.CDLL(None)]  # the process's symbols: a preloaded OpenBLAS
    except (OSError, TypeError):  # Windows: no such handle
        return None
    blas = mlx_blas()
    for path in [blas] if blas is not None else []:
        try:
            candidates.append(ctypes.CDLL(str(path)))
        except OSError:
            pass
    for lib in candidates:
        if getattr(lib, "openblas_set_num_threads", None) is not None:
            return lib
    return None


def set_openblas_threads(threads: int) -> bool:
    """Give OpenBLAS ``threads`` threads; False where the process has no OpenBLAS."""
    lib = openblas()
    if lib is None:
        return False
    lib.openblas_set_num_threads(threads)
    return True
