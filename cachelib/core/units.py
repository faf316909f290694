"""Units and constants shared by every layer: backends, element sizes, the growth step, and
how byte counts are written for people."""

from __future__ import annotations

BACKENDS = ("mlx", "torch")

# Bytes per element of each floating dtype a cache may store keys and values in.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

# mlx-lm's growth step: KVCache, QuantizedKVCache and RotatingKVCache add this many token slots
# at a time (``step``); our step-grown torch caches follow it.
STEP = 256

# The largest token count or index a cache knob may take: MLX indexes arrays with int32, so a
# larger size would overflow there (PyTorch's int64 is wider); every size knob stops here.
INDEX_MAX = 2**31 - 1

GB = 10**9  # SI gigabyte: what --budget-gb counts
GiB = 2**30
MiB = 2**20


def check_backend_name(backend: str) -> str:
    """``backend`` when it is one of :data:`BACKENDS`, else a ``ValueError`` naming the choices."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    return backend


def check_dtype(dtype: str) -> int:
    """Bytes per element of ``dtype``; a ``ValueError`` naming the allowed dtypes otherwise."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; allowed: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def human_bytes(n: float | None) -> str:
    """SI units: 1 GB = 10^9 bytes."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"
