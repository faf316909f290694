"""Units and constants shared by every layer: backends, element sizes, the growth step, and
how byte counts are written for people."""

from __future__ import annotations

import math

BACKENDS = ("mlx", "torch")

# Bytes per element of each floating dtype a cache may store keys and values in.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

# mlx-lm's growth step: KVCache, QuantizedKVCache and RotatingKVCache add this many token slots
# at a time (``step``); our step-grown torch caches follow it.
STEP = 256

# The largest token count or index a cache knob may take: MLX indexes arrays with int32, so a
# larger size would overflow there (PyTorch's int64 is wider); every size knob stops here.
INDEX_MAX = 2**31 - 1

GB = 10**9  # SI gigabyte
GiB = 2**30  # what device memory is counted in: a "24 GB" GPU holds 24 GiB
MiB = 2**20

# Units a memory size may be written in (case-insensitive); a bare number is GiB.
MEMORY_UNITS = {"B": 1, "KiB": 2**10, "MiB": MiB, "GiB": GiB, "TiB": 2**40,
                "kB": 10**3, "MB": 10**6, "GB": GB, "TB": 10**12}  # fmt: skip
_UNIT_BY_LOWER = {u.lower(): u for u in MEMORY_UNITS}
MEMORY_LIMIT = 2**60  # bytes: more than any machine holds


def parse_memory(value: str | float | int, name: str = "memory") -> int:
    """Bytes of a memory size: ``24`` or ``"24"`` is 24 GiB; ``"24GiB"``, ``"24 GB"``
    (10^9 bytes), ``"512MiB"``, ``"1000000B"`` say their unit. A ``ValueError`` names ``name``,
    the units allowed and the range otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a size such as 24 (GiB), 24GiB or 24GB, got {value!r}")
    unit = "GiB"
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        text = str(value).strip()
        try:  # a bare number, inf and nan included (refused below)
            return parse_memory(float(text), name)
        except (TypeError, ValueError) as e:
            if "finite" in str(e) or "at most" in str(e):
                raise ValueError(str(e).replace(f"got {float(text)!r}", f"got {text!r}")) from None
        i = len(text)
        while i and text[i - 1].isalpha():
            i -= 1
        number_text, suffix = text[:i].strip(), text[i:]
        if suffix:
            if suffix.lower() not in _UNIT_BY_LOWER:
                raise ValueError(f"{name}: unknown unit {suffix!r} in {text!r}; allowed: {', '.join(MEMORY_UNITS)}")
            unit = _UNIT_BY_LOWER[suffix.lower()]
        try:
            number = float(number_text)
        except ValueError:
            raise ValueError(f"{name} must be a size such as 24 (GiB), 24GiB or 24GB, got {text!r}") from None
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{name} must be a finite size >= 0, got {value!r}")
    nbytes = round(number * MEMORY_UNITS[unit])
    if nbytes > MEMORY_LIMIT:
        raise ValueError(f"{name} must be at most {MEMORY_LIMIT // 2**40:,} TiB, got {value!r}")
    return nbytes


def memory_text(nbytes: int) -> str:
    """The shortest text :func:`parse_memory` reads back as exactly ``nbytes``: GiB when it
    can, else GB, else bytes."""
    for unit in ("GiB", "GB", "MiB", "MB"):
        short = f"{nbytes / MEMORY_UNITS[unit]:g}"
        if round(float(short) * MEMORY_UNITS[unit]) == nbytes:
            return short + unit
        exact = repr(nbytes / MEMORY_UNITS[unit])
        if round(float(exact) * MEMORY_UNITS[unit]) == nbytes and len(exact) < 12:
            return exact + unit
    return f"{nbytes}B"


def human_gib(n: float | None) -> str:
    """Binary units, as device memory is counted: 1 GiB = 2^30 bytes."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"


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
