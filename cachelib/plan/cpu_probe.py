"""This machine's CPU for the speed model (:mod:`cachelib.plan.speed`), measured at run time and
kept between runs in :data:`PROBE_CACHE` (``~/.cache/cachelib/cpu_probe.json``):

- :func:`probe_cpu`: its bandwidth (a 64 MiB copy) and its float32 matmul rate through the backend's
  own library, under the CPU's model name and core count;
- :class:`AttentionProbe`: what a decode step's (or a prefill chunk's) attention costs at a length
  of context, the backend's own attention of one layer's shape timed bare over as many layers' K/V
  as the model has, each point under what it depends on (:meth:`AttentionProbe.cache_key`);
- :func:`reprobe`: measure again (``plan --reprobe``).

Every name here is importable from :mod:`cachelib.plan.hardware` too.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from ..core.home import cache_dir

if TYPE_CHECKING:
    from .hardware_base import Hardware


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
    """This CPU as a :class:`~cachelib.plan.hardware.Hardware` with the given figures (float16 at the
    float32 rate)."""
    from .hardware_base import CPU, Hardware

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


def _write_probe_cache(cached: dict, path: Path | None = None) -> None:
    """Write ``cached`` to ``path`` (default :data:`PROBE_CACHE`) whole or not at all: through a
    file of this process's own, renamed over it, so a plan and a bench writing at once never
    leave a torn file (the later one's figures stand)."""
    path = PROBE_CACHE if path is None else path
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a read-only home: the probe is simply not kept


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
    K/V. With ``bits``, each layer's K/V is held as ``bits``-bit codes (cachelib's torch codec) and
    decoded whole to ``dtype`` before attention, as a quantized cache's ``update`` hands attention
    every held slot decoded each step (measured, SmolLM2 4-bit, batch 1: that decode took 1.9x the
    SDPA's time at 8,192 tokens and 3.4x at 256; its rate per key is not the SDPA's)."""
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
    if bits is None:
        decode = lambda held: held  # noqa: E731
    else:
        from ..torch.storage import QuantizedCodec

        codec = QuantizedCodec(bits, group_size)
        kv = [(codec.encode(k), codec.encode(v)) for k, v in kv]
        decode = lambda held: codec.decode(held, dt)  # noqa: E731

    def run():
        with torch.inference_mode():
            for k, v in kv:
                F.scaled_dot_product_attention(q, decode(k), decode(v), attn_mask=mask, enable_gqa=gqa)

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
                bits, group, *lengths = json.loads(k)  # length, a chunk's queries, a batch's rows
                if isinstance(v, (int, float)) and v > 0 and len(lengths) in (1, 2, 3):
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
        _write_probe_cache(got, self.cache)

    def _bytes(self, length: int, bits: int | None, queries: int = 1) -> float:
        """One layer's K/V at ``length`` keys (held as codes on torch: and decoded), and a chunk's
        float32 scores where ``queries`` > 1."""
        per = 4 if self.dtype == "float32" else 2
        if bits is not None:  # codes + a scale and a bias per group; torch's decoded copy beside them
            per = bits / 8 + 4 / 64 * per + (per if self.backend == "torch" else 0)
        scores = 4 * self.heads * queries * length if queries > 1 else 0
        return 2 * self.kv_heads * length * self.head_dim * per + scores

    def measure(
        self, length: int, bits: int | None = None, group_size: int = 64, queries: int = 1, batch: int = 1
    ) -> float:
        """Median seconds of one layer's attention of ``queries`` queries (1: a decode step; more: a
        causal prefill chunk ending at ``length``) at ``length`` keys, for ``batch`` rows at once,
        measured now (not kept): at least 3 runs and ``seconds`` of them, each over as many layers'
        K/V as memory and ``run_seconds`` a run allow (a slow kernel, MLX's float16 on the CPU, over
        fewer)."""
        layer = max(self._bytes(length, bits, queries) * batch, 1)
        copies = max(1, min(self.layers, int(ATTENTION_PROBE_BYTES // layer)))
        make = _attention_mlx if self.backend == "mlx" else _attention_torch
        shape = (self.heads, self.kv_heads, self.head_dim, length)
        run = make(*shape, 1, bits, group_size, self.dtype, batch, queries)
        run()  # first call: allocation, kernel selection
        t = time.perf_counter()
        run()
        copies = max(1, min(copies, int(self.run_seconds / max(time.perf_counter() - t, 1e-9))))
        if copies > 1:
            run = make(*shape, copies, bits, group_size, self.dtype, batch, queries)
            run()
        times, end = [], time.perf_counter() + self.budget
        while time.perf_counter() < end or len(times) < 3:
            t = time.perf_counter()
            run()
            times.append((time.perf_counter() - t) / copies)
        return sorted(times)[len(times) // 2]

    def seconds(
        self, length: int, bits: int | None = None, group_size: int = 64, queries: int = 1, rows: int = 1
    ) -> float:
        """Seconds of one layer's attention at ``length`` keys (batch 1): of one query (a decode step),
        or of a causal chunk of ``queries`` tokens ending at ``length``. A chunk whose scores and K/V
        pass :data:`ATTENTION_PROBE_LAYER_BYTES` is measured with its keys halved down to its queries,
        then both halved (a chunk of as many queries as keys), and scaled by the query-key pairs: the
        scores are computed whole, masked or not, where they are materialised.

        ``rows`` sessions' single-query attention (a decode step of a batch) is measured as the batch:
        the kernel run over ``rows`` rows of ``length`` keys at once (the rows of a batch that do not
        fit :data:`ATTENTION_PROBE_LAYER_BYTES` halved, then its keys, and scaled back). Neither one
        row's time ``rows`` times nor one row's at ``rows`` x ``length`` keys is the batch's on this
        CPU (SmolLM2's 30 layers, a batch of 4 at 1,024 keys against those two: MLX float32 57 ms
        against 67 and 104, torch 39 against 41 and 47; MLX 8-bit at 2,048 keys 392 against 350 and
        370). A chunk's (``queries`` > 1) is ``rows`` times one row's."""
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows must be an int >= 1 (sessions in the step), got {rows!r}")
        if rows > 1 and queries > 1:
            return rows * self.seconds(length, bits, group_size, queries)
        if rows > 1:
            length = max(1, int(length))
            fits, batch = length, rows
            while self._bytes(fits, bits) * batch > ATTENTION_PROBE_LAYER_BYTES and (batch > 1 or fits > 1):
                if batch > 1:
                    batch = max(1, batch // 2)
                else:
                    fits = max(1, fits // 2)
            if batch == 1:
                return rows * self.seconds(length, bits, group_size)
            key = (bits, group_size, fits, 1, batch)
            return self._point(key, fits, bits, group_size, 1, batch) * length * rows / (fits * batch)
        length, queries = max(1, int(length)), max(1, min(int(queries), int(length)))
        fits, q = length, queries
        while fits > 1 and self._bytes(fits, bits, q) > ATTENTION_PROBE_LAYER_BYTES:
            if fits > q:
                fits = max(q, fits // 2)
            else:
                q = fits = fits // 2
        key = (bits, group_size, fits) if queries == 1 else (bits, group_size, fits, q)
        return self._point(key, fits, bits, group_size, q) * length * queries / (fits * q)

    def _point(self, key: tuple, *measure_args) -> float:
        """The seconds kept under ``key``, measured (:meth:`measure` of ``measure_args``) and kept in
        :attr:`cache` the first time it is asked for."""
        if key not in self.points:
            self.points[key] = self.measure(*measure_args)
            if self.cache is not None:
                self._keep(key, self.points[key])
        return self.points[key]
