"""Devices and runtimes as data, for the speed model (:mod:`cachelib.plan.speed`).

- :data:`HARDWARE`: published peak memory bandwidth and dense FLOPs per compute dtype of GPUs
  and Apple silicon, each figure with the vendor page it comes from. Dense means without 2:4
  sparsity (NVIDIA's headline tensor figures are sparse: the dense figure is half of them).
- :func:`probe_cpu`: this machine's CPU, measured at run time by a short copy (bandwidth) and a
  float32 matmul (compute, through the backend's own library) probe, cached in memory and in
  ``~/.cache/cachelib/cpu_probe.json``.
- :class:`AttentionProbe`: what a decode step's attention costs on this CPU at a length of
  context, measured at run time as a kernel: the backend's own single-query attention of one
  layer's shape, timed bare over as many layers' K/V as the model has.
- :data:`CALIBRATION`: published decode measurements the runtimes' achievable fractions are
  fitted on, each runtime on its own (llama.cpp's llama-bench ``tg128``, vLLM's
  ``benchmark_latency.py``, mlx-lm's ``mlx_lm.benchmark``). The measurements the model is checked
  against are kept apart, in ``tests/plan/test_plan_speed.py``; nothing here reads them.

Nothing here computes a step's time: that is :mod:`cachelib.plan.speed`.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from ..core.home import cache_dir

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


def _gpu(name, bandwidth_gbs, fp16_tflops, memory_gb, *, fp8=None, fp32=None, link_gbs=None, sources=(), note=""):
    flops = {"float16": fp16_tflops * T}
    if fp8 is not None:
        flops["fp8"] = fp8 * T
    if fp32 is not None:
        flops["float32"] = fp32 * T
    return Hardware(
        name,
        "cuda",
        bandwidth_gbs * GBS,
        flops,
        int(memory_gb * 1e9),
        None if link_gbs is None else link_gbs * GBS,
        tuple(sources),
        note,
    )


H100 = "https://www.nvidia.com/en-us/data-center/h100/"  # H100 datasheet (SXM and PCIe/NVL columns)
H200 = "https://www.nvidia.com/en-us/data-center/h200/"
A100 = (
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
L40S = "https://www.nvidia.com/en-us/data-center/l40s/"
L4 = "https://www.nvidia.com/en-us/data-center/l4/"  # L4 datasheet: 300 GB/s, FP16 tensor 242 TFLOPS with sparsity
A10 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf"
ADA = "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"  # RTX 4090, table 2
GA102 = "https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf"  # RTX 3090
NEWS = "https://www.apple.com/newsroom/"
M1_PRO_MAX = NEWS + "2021/10/introducing-m1-pro-and-m1-max-the-most-powerful-chips-apple-has-ever-built/"
M1_ULTRA = NEWS + "2022/03/apple-unveils-m1-ultra-the-worlds-most-powerful-chip-for-a-personal-computer/"
M2_PRO_MAX = NEWS + "2023/01/apple-unveils-m2-pro-and-m2-max-next-generation-chips-for-next-level-workflows/"
M2_ULTRA = "https://www.apple.com/newsroom/2023/06/apple-introduces-m2-ultra/"
M3 = NEWS + "2023/10/apple-unveils-m3-m3-pro-and-m3-max-the-most-advanced-chips-for-a-personal-computer/"
M3_ULTRA = "https://www.apple.com/newsroom/2025/03/apple-reveals-m3-ultra-taking-apple-silicon-to-a-new-extreme/"
M4 = "https://www.apple.com/newsroom/2024/05/apple-introduces-m4-chip/"
M4_PRO_MAX = "https://www.apple.com/newsroom/2024/10/apple-introduces-m4-pro-and-m4-max/"


def _apple(name, bandwidth_gbs, memory_gb, source, fp32_tflops=None):
    # Apple publishes FP32 TFLOPS for the M1 family only; its GPUs issue FP16 at the FP32 rate.
    flops = {} if fp32_tflops is None else {"float32": fp32_tflops * T, "float16": fp32_tflops * T}
    note = (
        ""
        if fp32_tflops
        else ("Apple publishes no FLOPs for this chip: decode is planned bandwidth-bound, prefill is not predicted")
    )
    return Hardware(name, "apple", bandwidth_gbs * GBS, flops, int(memory_gb * 1e9), None, (source,), note)


HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        _gpu(
            "h100-sxm",
            3350,
            989.5,
            80,
            fp8=1979,
            fp32=67,
            link_gbs=450,
            sources=(H100,),
            note="NVLink 900 GB/s bidirectional",
        ),
        _gpu("h100-pcie", 2000, 756.5, 80, fp8=1513, fp32=51, link_gbs=64, sources=(H100,), note="PCIe Gen5 x16"),
        _gpu("h200", 4800, 989.5, 141, fp8=1979, fp32=67, link_gbs=450, sources=(H200,)),
        _gpu("a100-40gb", 1555, 312, 40, fp32=19.5, link_gbs=300, sources=(A100,), note="SXM; no FP8 tensor cores"),
        _gpu("a100-80gb", 2039, 312, 80, fp32=19.5, link_gbs=300, sources=(A100,), note="SXM; no FP8 tensor cores"),
        _gpu("l40s", 864, 362.05, 48, fp8=733, fp32=91.6, link_gbs=32, sources=(L40S,), note="PCIe Gen4 x16"),
        _gpu("l4", 300, 121, 24, fp8=242.5, fp32=30.3, link_gbs=32, sources=(L4,), note="PCIe Gen4 x16"),
        _gpu(
            "a10g",
            600,
            125,
            24,
            fp32=31.2,
            link_gbs=32,
            sources=(A10,),
            note="the A10 datasheet: AWS's A10G has no NVIDIA sheet of its own",
        ),
        _gpu(
            "rtx-4090",
            1008,
            165.2,
            24,
            fp8=330.3,
            fp32=82.6,
            link_gbs=32,
            sources=(ADA,),
            note="FP16 tensor with FP32 accumulate, dense",
        ),
        _gpu(
            "rtx-3090",
            936,
            71,
            24,
            fp32=35.6,
            link_gbs=32,
            sources=(GA102,),
            note="FP16 tensor with FP32 accumulate, dense",
        ),
        _apple("m1-pro", 200, 32, M1_PRO_MAX, 5.2),
        _apple("m1-max", 400, 64, M1_PRO_MAX, 10.4),
        _apple("m1-ultra", 800, 128, M1_ULTRA, 21),
        _apple("m2-pro", 200, 32, M2_PRO_MAX),
        _apple("m2-max", 400, 96, M2_PRO_MAX),
        _apple("m2-ultra", 800, 192, M2_ULTRA),
        _apple("m3-pro", 150, 36, M3),
        _apple("m3-max", 400, 128, M3),
        _apple("m3-ultra", 819, 512, M3_ULTRA),
        _apple("m4", 120, 32, M4),
        _apple("m4-pro", 273, 64, M4_PRO_MAX),
        _apple("m4-max", 546, 128, M4_PRO_MAX),
    )
}
CPU = "cpu"  # this machine's CPU, probed


def hardware_names() -> list[str]:
    return [*HARDWARE, CPU]


def hardware(name: str, backend: str | None = None) -> Hardware:
    """A device by name (``cpu`` probes this machine, its FLOP/s ``backend``'s own matmul's: None,
    numpy's); ValueError naming the allowed names."""
    if name == CPU:
        return probe_cpu(backend=backend)
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; allowed: {', '.join(hardware_names())}")
    return HARDWARE[name]


# ---------------------------------------------------------------------------------------------
# this machine's CPU


_PROBED: dict[str, Hardware] = {}  # compute probe -> this CPU, probed in this process
_REPROBE = [False]  # plan --reprobe: measure again, ignoring the caches
PROBE_CACHE = cache_dir() / "cpu_probe.json"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


COMPUTE_PROBES = ("numpy", "mlx", "torch")  # whose matmul the compute probe times


def _matmul(probe: str, n: int = 512):
    """A function multiplying two ``n`` x ``n`` float32 matrices as ``probe`` does it: numpy (its own
    OpenBLAS), MLX (``mx.eval(a @ a)``: the BLAS MLX's CPU backend calls, Debian's OpenBLAS here) or
    torch (its own MKL, under its OpenMP threads)."""
    if probe == "mlx":
        import mlx.core as mx

        a = mx.ones((n, n), dtype=mx.float32)
        mx.eval(a)
        return lambda: mx.eval(a @ a)
    if probe == "torch":
        import torch

        a = torch.ones(n, n, dtype=torch.float32)

        def run():
            with torch.inference_mode():
                a @ a

        return run
    if probe != "numpy":
        raise ValueError(f"no compute probe {probe!r}; allowed: {', '.join(COMPUTE_PROBES)}")
    import numpy as np

    a = np.ones((n, n), dtype=np.float32)
    return lambda: a @ a


def measure_cpu(seconds: float = 0.6, backend: str | None = None) -> tuple[float, float]:
    """(bytes/s, float32 FLOP/s) of this machine now: the medians of repeated 64 MiB copies
    (bytes read + written, both arrays touched first) and 512^3 float32 matmuls, each run for
    about ``seconds / 2`` (at least 5 times). Medians, not bests: on a shared machine a run
    sees the load it sees, and so does the work it predicts. The matmul is ``backend``'s own
    (``mlx``, ``torch``; None: numpy's): each library multiplies through its own BLAS and threads
    (measured: at load 8 numpy's two-thread OpenBLAS read 5-17 GFLOP/s where MLX's read 22-57, and
    idle numpy's read ~155), so the rate a backend's prefill is predicted from is its own."""
    import numpy as np

    src = np.ones(8 * 2**20, dtype=np.float64)  # 64 MiB, past the caches
    dst = np.zeros_like(src)

    def median_rate(work, amount: float) -> float:
        rates, end = [], time.perf_counter() + seconds / 2
        while time.perf_counter() < end or len(rates) < 5:
            t = time.perf_counter()
            work()
            rates.append(amount / max(time.perf_counter() - t, 1e-9))
        return sorted(rates)[len(rates) // 2]

    bw = median_rate(lambda: np.copyto(dst, src), 2 * src.nbytes)
    matmul = _matmul(backend or "numpy")
    matmul()  # first call: allocation, BLAS threads started
    fl = median_rate(matmul, 2 * 512**3)
    return bw, fl


def cpu_hardware(bandwidth: float, flops: float, source: str) -> Hardware:
    """This CPU as a :class:`Hardware` with the given figures (float16 at the float32 rate)."""
    return Hardware(
        CPU,
        "cpu",
        bandwidth,
        {"float32": flops, "float16": flops},
        0,
        None,
        (source,),
        f"{_cpu_model()} x{os.cpu_count()}; float16 taken at the float32 rate",
    )


def cpu_identity() -> str:
    """This CPU as the probes' caches key it: its model name and core count."""
    return f"{_cpu_model()} x{os.cpu_count()}"


def _read_probe_cache() -> dict:
    """:data:`PROBE_CACHE` as a dict; {} where it is missing, unreadable or not a JSON object (it
    is then probed again and written over)."""
    try:
        got = json.loads(PROBE_CACHE.read_text())
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def _write_probe_cache(cached: dict) -> None:
    try:
        PROBE_CACHE.parent.mkdir(parents=True, exist_ok=True)
        PROBE_CACHE.write_text(json.dumps(cached, indent=1))
    except OSError:
        pass  # a read-only home: the probe is simply not kept


def probe_cpu(*, refresh: bool = False, backend: str | None = None) -> Hardware:
    """This machine's CPU as a :class:`Hardware`, its figures measured (:func:`measure_cpu`) once
    and cached in :data:`PROBE_CACHE` under the CPU's model name and core count; its FLOP/s are
    ``backend``'s own matmul's (None: numpy's), each kept under its own name."""
    key, name = cpu_identity(), backend or "numpy"
    if name in _PROBED and not refresh:
        return _PROBED[name]
    cached = _read_probe_cache()
    entry = cached.get(key)
    field_ = "flops_float32" if backend is None else f"flops_float32_{backend}"
    if refresh or _REPROBE[0] or not isinstance(entry, dict) or not _numbers(entry, "bandwidth", field_):
        bw, fl = measure_cpu(backend=backend)
        entry = entry if isinstance(entry, dict) and not refresh and not _REPROBE[0] else {}
        if not _numbers(entry, "bandwidth"):
            entry["bandwidth"] = bw
        entry[field_] = fl
        entry["measured"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        cached[key] = entry
        _write_probe_cache(cached)
    source = f"probed {entry['measured']}: 64 MiB copy, 512^3 float32 matmul through {name} ({PROBE_CACHE})"
    _PROBED[name] = cpu_hardware(entry["bandwidth"], entry[field_], source)
    return _PROBED[name]


def _numbers(entry: dict, *fields: str) -> bool:
    return all(isinstance(entry.get(f), (int, float)) and entry[f] > 0 for f in fields)


def _versions(packages: tuple[str, ...]) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for p in packages:
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = "-"
    return out


def reprobe(on: bool = True) -> None:
    """Measure this CPU again on the next ask (``plan --reprobe``): its bandwidth and matmul
    (:func:`probe_cpu`) and the attention (:class:`AttentionProbe` with a cache file), each kept
    afresh; ``on=False`` goes back to reading the caches."""
    _REPROBE[0] = on
    _PROBED.clear()


# ---------------------------------------------------------------------------------------------
# this CPU's attention, as a kernel

ATTENTION_PROBE_BYTES = 512 * 2**20  # the most K/V one probe holds over its layers
# The most K/V of one layer probed: a longer one (far past the caches, K/V streamed) takes the per-key
# rate of the longest that fits, which keeps a plan's probe to seconds (MLX's float16 attention on the
# CPU takes ~0.5 s a layer at 4,096 keys of Llama-3.1-8B's shape).
ATTENTION_PROBE_LAYER_BYTES = 64 * 2**20


def _attention_mlx(heads, kv_heads, head_dim, length, copies, bits, group_size, dtype, batch, queries=1):
    """A function running the attention MLX runs for one decode step (``queries`` 1) or one prefill
    chunk of ``queries`` tokens ending at ``length`` (causal, as mlx-lm masks a chunk) over ``copies``
    layers' K/V: ``mx.fast.scaled_dot_product_attention`` (dense), or mlx-lm's quantized attention
    over packed codes, scales and biases (``quantized_scaled_dot_product_attention``, as for mlx-lm's
    ``QuantizedKVCache`` and cachelib's quantized caches with equal key and value bits)."""
    import mlx.core as mx

    dt = getattr(mx, dtype)
    key = mx.random.key(0)
    q = mx.random.normal((batch, heads, queries, head_dim), key=key).astype(dt)
    mask = "causal" if queries > 1 else None
    kv = []
    for i in range(copies):
        k, v = (
            mx.random.normal((batch, kv_heads, length, head_dim), key=mx.random.key(2 * i + j + 1)).astype(dt)
            for j in (0, 1)
        )
        if bits is not None:
            k, v = tuple(mx.quantize(k, group_size, bits)), tuple(mx.quantize(v, group_size, bits))
        kv.append((k, v))
    mx.eval(q, kv)
    scale = head_dim**-0.5
    if bits is None:
        attend = lambda k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)  # noqa: E731
    else:
        from mlx_lm.models.base import quantized_scaled_dot_product_attention as qsdpa

        attend = lambda k, v: qsdpa(q, k, v, scale=scale, mask=mask, group_size=group_size, bits=bits)  # noqa: E731
    return lambda: mx.eval([attend(k, v) for k, v in kv])


def _attention_torch(heads, kv_heads, head_dim, length, copies, bits, group_size, dtype, batch, queries=1):
    """A function running torch's ``scaled_dot_product_attention`` of ``queries`` queries (the last of
    ``length`` positions, causal: a boolean mask, as transformers passes a chunk's) against ``length``
    keys (grouped heads shared, as transformers' sdpa attention asks for) over ``copies`` layers'
    K/V; a quantized cache hands attention its K/V decoded, so ``bits`` is unused."""
    import torch
    import torch.nn.functional as F

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, queries, head_dim, generator=g).to(dt)
    mask = None
    if queries > 1:
        mask = torch.arange(length)[None, :] <= torch.arange(length - queries, length)[:, None]
    kv = [
        tuple(torch.randn(batch, kv_heads, length, head_dim, generator=g).to(dt) for _ in (0, 1)) for _ in range(copies)
    ]
    gqa = heads != kv_heads

    def run():
        with torch.inference_mode():
            for k, v in kv:
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

    return run


class AttentionProbe:
    """Seconds one layer's single-query attention takes on this CPU at ``length`` keys, for one
    model's shape (``heads`` query heads against ``kv_heads`` of ``head_dim``) on ``backend``,
    measured as a kernel: the backend's attention (:func:`_attention_mlx`, :func:`_attention_torch`)
    timed bare over ``layers`` layers' K/V in turn (a step's attention finds in the CPU's caches
    what is left of its model's K/V, not one layer's over and over; at most
    :data:`ATTENTION_PROBE_BYTES` of it), divided by their number. Each (bits, group size, length)
    is measured once, when first asked for, or given in ``points`` (``{(bits, group_size,
    length): seconds}``). A length whose one layer's K/V passes
    :data:`ATTENTION_PROBE_LAYER_BYTES` takes the per-key rate of the longest (halved) that fits.
    With ``cache`` (a JSON file: the plan gives :data:`PROBE_CACHE`), each point is kept there under
    :meth:`cache_key` when measured and read back by the next probe of the same key: a plan at
    ``--hardware cpu`` probes each length once per machine, libraries and threads, not per run."""

    def __init__(
        self,
        backend: str,
        heads: int,
        kv_heads: int,
        head_dim: int,
        layers: int,
        dtype: str = "float32",
        points: Mapping | None = None,
        seconds: float = 0.15,
        run_seconds: float = 0.3,
        cache: Path | None = None,
    ):
        if backend not in ("mlx", "torch"):
            raise ValueError(f"no attention probe for backend {backend!r}; allowed: mlx, torch")
        self.backend, self.heads, self.kv_heads, self.head_dim = backend, heads, kv_heads, head_dim
        self.layers, self.dtype, self.budget, self.run_seconds = max(1, layers), dtype, seconds, run_seconds
        self.cache = cache
        self.points: dict = {**(self._cached() if cache is not None else {}), **dict(points or {})}

    def cache_key(self) -> str:
        """What a measured point depends on, as the cache file keys it: the backend and its libraries'
        versions, the dtype, the model's attention shape and layers, this CPU and the threads its BLAS
        and OpenMP run, and how the probe measures. A point measured under any other is measured again."""
        return json.dumps(
            {
                "backend": self.backend,
                "versions": _versions(("mlx", "mlx-lm") if self.backend == "mlx" else ("torch",)),
                "dtype": self.dtype,
                "shape": [self.heads, self.kv_heads, self.head_dim, self.layers],
                "cpu": cpu_identity(),
                "threads": [os.environ.get(v, "") for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")],
                "probe": [ATTENTION_PROBE_BYTES, ATTENTION_PROBE_LAYER_BYTES, self.budget, self.run_seconds],
            },
            sort_keys=True,
        )

    def _cached(self) -> dict:
        """The points kept for :meth:`cache_key` in :attr:`cache` (none under ``plan --reprobe``, and
        none from an unreadable file or entry: those are measured again and written over)."""
        if _REPROBE[0]:
            return {}
        try:
            got = json.loads(self.cache.read_text())["attention"][self.cache_key()]
            out = {}
            for k, v in got.items():
                bits, group, *lengths = json.loads(k)  # length, and a chunk's queries
                if isinstance(v, (int, float)) and v > 0 and len(lengths) in (1, 2):
                    out[(None if bits is None else int(bits), int(group), *map(int, lengths))] = float(v)
            return out
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}

    def _keep(self, key: tuple, seconds: float) -> None:
        """Add one measured point to :attr:`cache` (the rest of the file as it is; an unreadable one
        started afresh)."""
        try:
            got = json.loads(self.cache.read_text())
        except (OSError, ValueError):
            got = {}
        if not isinstance(got, dict):
            got = {}
        attention = got.get("attention")
        if not isinstance(attention, dict):
            attention = got["attention"] = {}
        mine = attention.get(self.cache_key())
        if not isinstance(mine, dict):
            mine = attention[self.cache_key()] = {}
        mine[json.dumps(list(key))] = seconds
        try:
            self.cache.parent.mkdir(parents=True, exist_ok=True)
            self.cache.write_text(json.dumps(got, indent=1))
        except OSError:
            pass  # a read-only home: the point is simply not kept

    def _bytes(self, length: int, bits: int | None, queries: int = 1) -> float:
        """One layer's K/V at ``length`` keys, and a chunk's float32 scores where ``queries`` > 1."""
        per = 4 if self.dtype == "float32" else 2
        per = bits / 8 + 4 / 64 * per if bits is not None else per  # codes + a scale and a bias per group
        scores = 4 * self.heads * queries * length if queries > 1 else 0
        return 2 * self.kv_heads * length * self.head_dim * per + scores

    def measure(self, length: int, bits: int | None = None, group_size: int = 64, queries: int = 1) -> float:
        """Median seconds of one layer's attention of ``queries`` queries (1: a decode step; more: a
        causal prefill chunk ending at ``length``) at ``length`` keys, measured now (not kept): at
        least 3 runs and ``seconds`` of them, each over as many layers' K/V as memory and
        ``run_seconds`` a run allow (a slow kernel, MLX's float16 on the CPU, over fewer)."""
        copies = max(1, min(self.layers, int(ATTENTION_PROBE_BYTES // max(self._bytes(length, bits, queries), 1))))
        make = _attention_mlx if self.backend == "mlx" else _attention_torch
        shape = (self.heads, self.kv_heads, self.head_dim, length)
        run = make(*shape, 1, bits, group_size, self.dtype, 1, queries)
        run()  # first call: allocation, kernel selection
        t = time.perf_counter()
        run()
        copies = max(1, min(copies, int(self.run_seconds / max(time.perf_counter() - t, 1e-9))))
        if copies > 1:
            run = make(*shape, copies, bits, group_size, self.dtype, 1, queries)
            run()
        times, end = [], time.perf_counter() + self.budget
        while time.perf_counter() < end or len(times) < 3:
            t = time.perf_counter()
            run()
            times.append((time.perf_counter() - t) / copies)
        return sorted(times)[len(times) // 2]

    def seconds(self, length: int, bits: int | None = None, group_size: int = 64, queries: int = 1) -> float:
        """Seconds of one layer's attention at ``length`` keys (batch 1): of one query (a decode step),
        or of a causal chunk of ``queries`` tokens ending at ``length``. A chunk whose scores and K/V
        pass :data:`ATTENTION_PROBE_LAYER_BYTES` is measured with its keys halved down to its queries,
        then both halved (a chunk of as many queries as keys), and scaled by the query-key pairs: the
        scores are computed whole, masked or not, where they are materialised."""
        length, queries = max(1, int(length)), max(1, min(int(queries), int(length)))
        fits, q = length, queries
        while fits > 1 and self._bytes(fits, bits, q) > ATTENTION_PROBE_LAYER_BYTES:
            if fits > q:
                fits = max(q, fits // 2)
            else:
                q = fits = fits // 2
        key = (bits, group_size, fits) if queries == 1 else (bits, group_size, fits, q)
        if key not in self.points:
            self.points[key] = self.measure(fits, bits, group_size, q)
            if self.cache is not None:
                self._keep(key, self.points[key])
        return self.points[key] * length * queries / (fits * q)


# ---------------------------------------------------------------------------------------------
# published measurements the runtimes' fractions are fitted on (the check set lives in the tests)


@dataclass(frozen=True)
class Measurement:
    """One published decode speed: ``tokens_per_s`` per session of ``model`` (a preset or a config
    dict) with ``weights_gib`` of weights (as the runtime printed its size) or ``weight_bits`` per
    parameter, on ``hardware`` (``tp`` of them) under ``runtime``, ``batch`` sessions at ``depth``
    tokens of context (the prompt; ``test`` ``tgN`` generates N after it), K/V in ``kv_format``."""

    source: str
    model: str
    weights_gib: float
    hardware: str
    runtime: str
    tokens_per_s: float
    depth: int = 0
    batch: int = 1
    kv_format: str | None = None
    flash_attn: bool = False
    test: str = "tg128"  # llama-bench's test: 128 tokens generated after `depth` tokens
    params: Mapping = field(default_factory=dict, compare=False)
    # Bits per weight as the runtime holds them (None: ``weights_gib`` says the bytes): 16 for
    # bf16, b + 32 / group for MLX's affine b-bit quantization (a 16-bit scale and bias per group).
    weight_bits: float | None = None
    version: str = ""  # the runtime's version (or commit) where the source gives it
    tp: int = 1  # tensor-parallel devices the run spreads over (the figure is one session's, as above)


def mlx_bits(bits: int, group_size: int = 64) -> float:
    """Bits per weight of MLX's affine quantization: the codes plus a 16-bit scale and a 16-bit
    bias per ``group_size`` weights (mlx.core.quantize, mlx 0.32: scales and biases in the dtype)."""
    return bits + 32 / group_size


PR_4766 = "https://github.com/ggml-org/llama.cpp/pull/4766"  # ggerganov's llama-bench run, RTX 4090, 2024-01
DISC_4167 = "https://github.com/ggml-org/llama.cpp/discussions/4167"  # Apple silicon, build 8e672ef, Llama-2-7B

# vLLM on CUDA: benchmark_latency.py's defaults (--input-len 32 --output-len 128, one request) on
# Meta-Llama-3-8B in bf16 (--load-format dummy: the same shapes). Its "Avg latency" covers the 32-token
# prefill and 127 decode steps; the prefill forward costs about one decode step (PR #11081's forward
# times on H100: 7.51 ms for 32 tokens, 6.5 ms for 1), so 128 / latency is the decode rate within ~1%.
# H100 and L4 runs of vLLM's main branch in December 2024 (the page came with vLLM PR #11078).
VLLM_TORCH_COMPILE = "https://docs.vllm.ai/en/latest/design/torch_compile.html"
# mlx-lm on Apple silicon: its own benchmark table (mlx_lm.benchmark -p 2048 -g 128: generation after a
# 2,048-token prompt, batch 1), Qwen3-4B-Instruct-2507 on a 64 GB M4 Max, mlx 0.29.2.dev, mlx-lm 0.28.2.
MLX_LM_BENCHMARKS = "https://github.com/ml-explore/mlx-lm/blob/main/mlx_lm/BENCHMARKS.md"

CALIBRATION: tuple[Measurement, ...] = (
    # llama.cpp CUDA: Llama-2-7B (llama-bench "llama 7B") F16 12.55 GiB and Q8_0 6.67 GiB, tg128, RTX 4090.
    Measurement(PR_4766, "llama-2-7b", 12.55, "rtx-4090", "llama.cpp", 61.03),
    Measurement(PR_4766, "llama-2-7b", 6.67, "rtx-4090", "llama.cpp", 98.13),
    # llama.cpp Metal: Llama-2-7B Q4_0 (3.56 GiB) tg128 on an M1 Pro (16-core GPU) and an M2 Ultra (76-core GPU).
    Measurement(DISC_4167, "llama-2-7b", 3.56, "m1-pro", "llama.cpp", 36.4),
    Measurement(DISC_4167, "llama-2-7b", 3.56, "m2-ultra", "llama.cpp", 94.3),
    # Prompt processing (pp512, one 512-token forward) of the same runs: the fraction of peak compute.
    Measurement(PR_4766, "llama-2-7b", 12.55, "rtx-4090", "llama.cpp", 11048.22, test="pp512"),
    Measurement(DISC_4167, "llama-2-7b", 3.56, "m1-pro", "llama.cpp", 266, test="pp512"),
    # vLLM CUDA: Meta-Llama-3-8B bf16 (the llama-3.1-8b shapes), batch 1, 32 + 128 tokens, CUDA graphs:
    # H100 "Avg latency: 0.9704469823899369 seconds", L4 "Avg latency: 7.81603614680001 seconds".
    Measurement(
        VLLM_TORCH_COMPILE,
        "llama-3.1-8b",
        0,
        "h100-sxm",
        "vllm",
        128 / 0.97045,
        depth=32,
        weight_bits=16,
        version="main, 2024-12 (PR #11078)",
    ),
    Measurement(
        VLLM_TORCH_COMPILE,
        "llama-3.1-8b",
        0,
        "l4",
        "vllm",
        128 / 7.81604,
        depth=32,
        weight_bits=16,
        version="main, 2024-12 (PR #11078)",
    ),
    # mlx-lm Metal: Qwen3-4B-Instruct-2507 bf16 / 8-bit / 4-bit (group 64), Generation (128) tok/sec.
    Measurement(
        MLX_LM_BENCHMARKS, "qwen3-4b", 0, "m4-max", "mlx-lm", 52.47, depth=2048, weight_bits=16, version="0.28.2"
    ),
    Measurement(
        MLX_LM_BENCHMARKS,
        "qwen3-4b",
        0,
        "m4-max",
        "mlx-lm",
        86.907,
        depth=2048,
        weight_bits=mlx_bits(8),
        version="0.28.2",
    ),
    Measurement(
        MLX_LM_BENCHMARKS,
        "qwen3-4b",
        0,
        "m4-max",
        "mlx-lm",
        134.52,
        depth=2048,
        weight_bits=mlx_bits(4),
        version="0.28.2",
    ),
)

# Llama-2-7B's config (https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json), for the measurements.
LLAMA_2_7B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "intermediate_size": 11008,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "torch_dtype": "float16",
    "tie_word_embeddings": False,
}

# Qwen3-4B(-Instruct-2507)'s config (https://huggingface.co/Qwen/Qwen3-4B-Instruct-2507/blob/main/config.json).
QWEN3_4B = {
    "model_type": "qwen3",
    "hidden_size": 2560,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 9728,
    "vocab_size": 151936,
    "max_position_embeddings": 262144,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
}

# Qwen2.5-72B(-Instruct)'s config (https://huggingface.co/Qwen/Qwen2.5-72B-Instruct/blob/main/config.json).
QWEN2_5_72B = {
    "model_type": "qwen2",
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 29568,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}
