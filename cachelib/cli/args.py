"""Argparse types for every numeric option of the command line, so that each says the same
thing about a bad value: ``nan``, ``inf`` and out-of-range numbers are refused with the range
allowed (argparse turns the ``ArgumentTypeError`` into one line and exit code 2).

``memory_size`` for a memory size (a bare number is GiB, or the unit said: 24GiB, 24GB),
``finite_float(0, 1)`` for a share, ``int_range(min=1)`` (:data:`positive_int`) for counts;
:func:`add_model_arguments` for the model flags every command that runs a model shares.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable

from ..core.units import BACKENDS, parse_memory


def _number(v: float) -> str:
    return f"{v:,.0f}" if float(v).is_integer() and abs(v) >= 1e6 else f"{v:g}"


def _range_text(lo, hi, lo_open: bool = False) -> str:
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {_number(lo)}")
    if hi is not None:
        parts.append(f"<= {_number(hi)}")
    return " and ".join(parts)


def finite_float(
    min: float | None = None, max: float | None = None, *, min_open: bool = False
) -> Callable[[str], float]:
    """An argparse type: a finite number within [``min``, ``max``] (``min_open``: above ``min``)."""
    allowed = _range_text(min, max, min_open)

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number{' ' + allowed if allowed else ''}, got {text!r}")
        if (min is not None and (value < min or (min_open and value == min))) or (max is not None and value > max):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text}")
        return value

    parse.__name__ = "number"  # argparse names the type in its own messages
    return parse


def int_range(min: int | None = None, max: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer within [``min``, ``max``] (``1_000`` reads as 1000)."""
    allowed = _range_text(min, max)

    def parse(text: str) -> int:
        try:
            value = int(text.strip().replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if (min is not None and value < min) or (max is not None and value > max):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


positive_int = int_range(1)
non_negative_int = int_range(0)


def memory_size(text: str) -> int:
    """An argparse type: a memory size in bytes (a bare number is GiB; see parse_memory)."""
    try:
        return parse_memory(text, "size")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("size ").removeprefix("size: ")) from None


memory_size.__name__ = "size"
SIZE_HELP = "a bare number is GiB (2^30 bytes); or say the unit: 24GiB, 24GB (10^9 bytes), 512MiB"


def positive_memory_size(text: str) -> int:
    """:func:`memory_size`, above 0 (a limit of nothing is no limit)."""
    n = memory_size(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a size > 0, got {text!r}")
    return n


positive_memory_size.__name__ = "size"


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """``--model``, ``--backend`` and ``--device``: which model runs, on which backend and device
    (``profile``, ``evaluate`` and ``retrieval`` take the same three)."""
    p.add_argument("--model", default="smollm2", help="smollm2 (bundled), a preset, or a model folder")
    p.add_argument("--backend", default="mlx", choices=list(BACKENDS))
    p.add_argument("--device", default=None, help="cpu, metal/gpu (MLX), cuda[:N] or mps (torch); default: best")
