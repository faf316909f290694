"""What a device is, for the speed model: :class:`Hardware` (the published devices are in
:mod:`cachelib.plan.hardware`, this machine's CPU is probed by :mod:`cachelib.plan.cpu_probe`;
both build on this module, which imports neither)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

CPU = "cpu"  # this machine's CPU, probed
T = 1e12  # TFLOP/s
GBS = 1e9  # GB/s (vendors' GB are 10^9 bytes)


@dataclass(frozen=True)
class Hardware:
    """One device: peak memory bandwidth (bytes/s), dense FLOP/s per compute dtype (a dtype
    missing from ``flops`` has no published figure), memory (bytes), the link tensor
    parallelism's all-reduce crosses (bytes/s, one direction; None: not given), its kind
    (``cuda``, ``apple``, ``cpu``: which calibration applies) and the sources of the figures."""

    name: str
    kind: str
    bandwidth: float
    flops: Mapping[str, float]
    memory_bytes: int
    link_bandwidth: float | None = None
    sources: tuple[str, ...] = ()
    note: str = ""

    def compute(self, dtype: str) -> float | None:
        """Dense FLOP/s at ``dtype`` (float16 and bfloat16 share a figure on every device here)."""
        return self.flops.get("float16" if dtype == "bfloat16" else dtype)
