"""Units and constants shared by every layer: backends, element sizes, the growth step, and
how byte counts are written for people."""

from __future__ import annotations

import math
import re

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
MEMORY_UNITS = {
    "B": 1,
    "KiB": 2**10,
    "MiB": MiB,
    "GiB": GiB,
    "TiB": 2**40,
    "kB": 10**3,
    "MB": 10**6,
    "GB": GB,
    "TB": 10**12,
}
_UNIT_BY_LOWER = {u.lower(): u for u in MEMORY_UNITS}
MEMORY_LIMIT = 2**60  # bytes: more than any machine holds


INT64_MAX = 2**63 - 1


def _range_text(minimum: int, maximum: int) -> str:
    return f"{minimum:,} to {maximum:,} bytes ({maximum / 2**40:,.0f} TiB)"


def check_bytes(name: str, value, minimum: int = 0, maximum: int = MEMORY_LIMIT, optional: bool = False) -> int | None:
    """``value`` when it is a whole number of bytes within [``minimum``, ``maximum``] (at most
    int64); None passes when ``optional``; else a ``ValueError`` naming ``name`` and the range."""
    if value is None and optional:
        return None
    maximum = min(maximum, INT64_MAX)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        shown = clip_input(repr(value))
        raise ValueError(f"{name} must be a whole number of bytes from {_range_text(minimum, maximum)}, got {shown}")
    return value


def to_bytes(number: float | int, unit: str, name: str, shown, minimum: int = 0, maximum: int = MEMORY_LIMIT) -> int:
    """``number`` ``unit``s (a key of :data:`MEMORY_UNITS`) in bytes, checked after scaling:
    finite and within [``minimum``, ``maximum``] (never past int64), else a ``ValueError`` naming
    ``name``, the range and ``shown`` (the input, cut to 100 characters). Never an OverflowError."""
    text = clip_input(shown)
    maximum = min(maximum, INT64_MAX)
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise ValueError(f"{name} must be a size such as 24 (GiB), 24GiB or 24GB, got {text}")
    if isinstance(number, float) and not math.isfinite(number):
        raise ValueError(f"{name} must be a finite size >= 0, got {text}")
    scale = MEMORY_UNITS[unit]
    # compared before scaling, so 1e300 GiB or an int of 400 digits never reaches float overflow
    if number < 0 or number > maximum / scale * (1 + 1e-12):
        low = "a finite size >= 0" if number < 0 else f"a size from {_range_text(minimum, maximum)}"
        raise ValueError(f"{name} must be {low}, got {text}")
    nbytes = number * scale if isinstance(number, int) else round(number * scale)
    if not minimum <= nbytes <= maximum:
        raise ValueError(f"{name} must be a size from {_range_text(minimum, maximum)}, got {text}")
    return int(nbytes)


def clip_message(message: str, most: int = 100) -> str:
    """``message`` with every run of more than ``most`` non-space characters (an input it quotes:
    a 100 KB path, spec or number) cut to its head and tail, ``most`` characters in all (a path
    keeps its file name), so a one-line error stays one short line."""
    head = most // 2

    def cut(m: re.Match) -> str:
        run = m.group()
        return run[:head] + "..." + run[-(most - head - 3) :]

    return re.sub(rf"\S{{{most + 1},}}", cut, message)


def clip_input(text, most: int = 100) -> str:
    """``text`` as an error message quotes it: at most ``most`` characters."""
    text = str(text)
    return text if len(text) <= most else text[: most - 3] + "..."


def parse_memory(value: str | float | int, name: str = "memory", maximum: int = MEMORY_LIMIT) -> int:
    """Bytes of a memory size: ``24`` or ``"24"`` is 24 GiB; ``"24GiB"``, ``"24 GB"``
    (10^9 bytes), ``"512MiB"``, ``"1000000B"`` say their unit. A ``ValueError`` names ``name``,
    the units allowed and the range otherwise (:func:`to_bytes`: checked after scaling)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a size such as 24 (GiB), 24GiB or 24GB, got {value!r}")
    if isinstance(value, (int, float)):
        return to_bytes(value, "GiB", name, repr(value), maximum=maximum)
    text = str(value).strip()
    shown = clip_input(text)
    i = len(text)
    while i and text[i - 1].isalpha():
        i -= 1
    number_text, suffix = text[:i].strip(), text[i:]
    unit = "GiB"
    if suffix and number_text and suffix.lower() not in ("inf", "nan", "infinity"):
        if suffix.lower() not in _UNIT_BY_LOWER:
            raise ValueError(f"{name}: unknown unit {suffix[:20]!r} in {shown!r}; allowed: {', '.join(MEMORY_UNITS)}")
        unit = _UNIT_BY_LOWER[suffix.lower()]
    else:
        number_text = text
    if len(number_text) > 100:
        raise ValueError(f"{name} must be a size such as 24 (GiB), 24GiB or 24GB, got {shown!r}")
    try:
        number = float(number_text)
    except ValueError:
        raise ValueError(f"{name} must be a size such as 24 (GiB), 24GiB or 24GB, got {shown!r}") from None
    return to_bytes(number, unit, name, repr(clip_input(text)), maximum=maximum)


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


def check_backend(backend: str) -> str:
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
