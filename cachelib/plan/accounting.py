"""Exact KV-cache bytes of a model under a strategy: per layer, in total, and step by step.

:func:`cache_layout` says which cache class each layer of an :class:`~cachelib.plan.arch.Arch`
gets for a strategy spec on a backend (the same choice ``cachelib.mlx`` / ``cachelib.torch``
make); :func:`trace` replays a prefill then 1-token decode steps through those classes' byte
rules (:mod:`cachelib.core.rules`) and records every update; :func:`account` runs the same
replay fast (regular decode stretches are skipped in bulk) and returns the final state plus the
run's peaks. Bytes allocated equal what the real caches report as ``nbytes``; peaks add the
transient copies the rules model.

Byte sizes of one token slot (one layer, whole batch):
full precision ``B * H_kv * (D_k + D_v) * itemsize``; quantized ``B * H_kv * (D_k * bits_k / 8
+ D_v * bits_v / 8 + 2 * (D_k + D_v) / group_size * itemsize)`` (packed data + a scale and a
bias per group in the input dtype, as mlx-lm and our torch quantizer store them).

Which cache each layer gets. Full-attention layers, by strategy (both backends unless noted):
``standard`` KVCache(step); ``concat`` MLX ConcatenateKVCache, torch DynamicLayer; ``rotating``
RotatingKVCache(max_size, keep), a quantized ring with ``bits``; ``quantized``
QuantizedKVCache, or with ``start=N`` a KVCache converted at the first update that begins with
offset >= N;
``kivi`` QuantizedLayer(bits, group_size, residual); ``chunked`` ChunkedKVCache(chunk_size) with
its front trimmed before every update, as llama4 drives it; ``static`` StaticLayer(max_len);
``sliding`` MLX RotatingKVCache(window, keep=0), torch DynamicSlidingWindowLayer(window);
``offloaded`` torch DynamicLayer kept on the host. A model's own sliding-window layers keep
their window cache whatever the strategy (``sliding`` gives them its own window instead):
MLX RotatingKVCache(window, keep=0); torch
DynamicSlidingWindowLayer(window), StaticSlidingWindowLayer under ``static``, offloaded too
under ``offloaded`` (transformers' DynamicCache offloads every layer).

Which layers are the model's own sliding-window (or recurrent) layers is the runtime's rule
(:mod:`cachelib.plan.layouts`): on MLX what mlx-lm's model class builds (Gemma-2 and Mistral:
every layer full), on torch what transformers' ``DynamicCache(config=...)`` builds. Under a
:class:`~cachelib.plan.runtimes.Deployment` every count is one device's (its pipeline stage, its
tensor-parallel rank's KV heads, its KV format), and vLLM / llama.cpp allocate their own caches:
``PagedBlocks`` / ``PagedSlidingWindow`` (vLLM's blocks), ``llama_kv_cache`` (llama.cpp's cells,
the whole context at start).

Recurrent layers hold MLX ``ArraysCache`` state (conv ``(B, K-1, C)`` and SSM ``(B, C, N)`` in
the input dtype) or transformers ``LinearAttentionLayer`` state (conv ``(B, C, K)`` in the input
dtype, SSM ``(B, C, N)`` in float32, as transformers' Mamba computes it).

Offloading follows transformers' ``Cache``: before layer i updates, the next offloaded layer is
prefetched to the device; after its update, layer i goes back to the host. Between steps the
device holds the non-offloaded layers and the first offloaded layer (prefetched by the last).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from ..core import rules as R
from ..core.layout import LayerLayout, rule_for
from ..core.units import check_dtype
from ..spec import Spec, parse_spec
from .arch import Arch
from .runtimes import (
    Deployment,
    as_deployment,
    kv_format_check,
    largest_stage,
    llama_cpp_settings,
    prompt_last_alone,
    runtime_spec,
    stage_arches,
    stages,
)

CYCLE_KEYS = 4096  # distinct cycle keys a feed remembers before it starts looking afresh


# ---------------------------------------------------------------------------------------------
# per-token and per-state sizes


def _check_group(arch: Arch, group_size: int) -> None:
    dims = {arch.key_dim, arch.value_dim}
    if any(d % group_size for d in dims):
        ok = [g for g in (32, 64, 128) if all(d % g == 0 for d in dims)]
        raise ValueError(
            f"group_size={group_size} does not divide the cached head dims of {arch.name} "
            f"(keys {arch.key_dim}, values {arch.value_dim}); allowed: {', '.join(map(str, ok)) or 'none'}"
        )


def token_bytes(
    arch: Arch,
    dtype: str = "float16",
    *,
    batch: int = 1,
    key_bits: int | None = None,
    value_bits: int | None = None,
    group_size: int = 64,
    kv_format: str | None = None,
) -> int:
    """Bytes one token slot takes in one attention layer's cache (keys + values, whole batch).

    With ``key_bits``/``value_bits`` that side is stored quantized: ``D * bits / 8`` packed
    bytes plus ``2 * D / group_size`` scale and bias elements in ``dtype``. With ``kv_format``
    (``fp8``, ``q8_0``, ``q4_0``: :data:`cachelib.core.rules.KV_FORMATS`) each K and V row of
    ``kv_heads x head_dim`` elements is stored in that format instead of ``dtype``.
    """
    item = check_dtype(dtype)
    if (key_bits is None) != (value_bits is None):
        raise ValueError("give both key_bits and value_bits, or neither")
    if kv_format is not None:
        if key_bits is not None:
            raise ValueError(f"kv_format {kv_format!r} is a storage format of its own; it takes no bits")
        kv_format_check(arch, kv_format)
        rows = R.format_bytes(arch.kv_heads * arch.key_dim, kv_format)
        rows += R.format_bytes(arch.kv_heads * arch.value_dim, kv_format)
        return batch * rows
    if key_bits is None:
        return batch * arch.kv_heads * (arch.key_dim + arch.value_dim) * item
    _check_group(arch, group_size)

    def side(dim: int, bits: int) -> int:
        return dim * bits // 8 + 2 * (dim // group_size) * item

    return batch * arch.kv_heads * (side(arch.key_dim, key_bits) + side(arch.value_dim, value_bits))


def kv_bytes_per_token(
    arch: Arch,
    dtype: str = "float16",
    *,
    bits: int | None = None,
    key_bits: int | None = None,
    value_bits: int | None = None,
    group_size: int = 64,
    kv_format: str | None = None,
    deployment: Deployment | None = None,
) -> int:
    """Bytes one more token costs a full cache, summed over every attention layer (batch 1):
    the figure model cards quote (Llama-3.1-8B fp16: 131,072; fp8 KV: 65,536). With a
    ``deployment``: on one device of it (its stage's layers, its rank's KV heads, its
    ``kv_format``; Llama-3.1-70B at tp=8: 40,960)."""
    kb = key_bits if key_bits is not None else bits
    vb = value_bits if value_bits is not None else bits
    if deployment is not None:
        arch = device_arch_of(arch, deployment)
        kv_format = kv_format or deployment.kv_format
    per_layer = token_bytes(arch, dtype, key_bits=kb, value_bits=vb, group_size=group_size, kv_format=kv_format)
    return per_layer * arch.attention_layers


def device_arch_of(arch: Arch, deployment: Deployment) -> Arch:
    """The architecture one device of ``deployment`` holds (:func:`cachelib.plan.runtimes.device_arch`)."""
    stage_list = stage_arches(arch, deployment)
    return stage_list[largest_stage(stage_list)]


def quantized_storage_ratio(bits: int, group_size: int = 64, dtype: str = "float16") -> float:
    """Quantized bytes per element over ``dtype`` bytes per element (4-bit, group 64, fp16
    scales: 0.28125)."""
    item = check_dtype(dtype)
    if bits <= 0 or group_size <= 0:
        raise ValueError(f"bits and group_size must be positive, got bits={bits}, group_size={group_size}")
    return (bits / 8 + 2 * item / group_size) / item


def recurrent_state_bytes(arch: Arch, backend: str = "mlx", dtype: str = "float16", *, batch: int = 1) -> int:
    """Bytes of one recurrent layer's state (conv window + SSM state)."""
    item = check_dtype(dtype)
    rec = arch.recurrent
    if rec is None:
        return 0
    if backend == "mlx":  # conv (B, K-1, C), ssm (B, C, N), both in the input dtype
        return batch * rec.channels * ((rec.conv_kernel - 1) + rec.state_size) * item
    if backend == "ggml":  # llama.cpp llama_memory_recurrent: r (K-1)*C and s N*C, float32
        return batch * rec.channels * ((rec.conv_kernel - 1) + rec.state_size) * 4
    # transformers: conv (B, C, K) in the input dtype, ssm (B, C, N) in float32
    return batch * rec.channels * (rec.conv_kernel * item + rec.state_size * 4)


# ---------------------------------------------------------------------------------------------
# which cache each layer gets


def _deployment(deployment: Deployment | None, backend: str) -> Deployment:
    return as_deployment(deployment, backend)


def cache_layout(
    arch: Arch,
    spec: str | Spec,
    backend: str = "mlx",
    *,
    deployment: Deployment | None = None,
    context: int | None = None,
) -> list[LayerLayout]:
    """The cache class of every layer for ``spec`` on ``backend``: the strategy's table entry
    says what goes on full-attention layers and on the model's own sliding-window layers.

    Which layers slide is the runtime's own rule (:mod:`cachelib.plan.layouts`): on ``mlx``
    mlx-lm's ``make_cache`` (Gemma-2: every layer full), on ``torch`` transformers'
    ``DynamicCache(config=...)``. With a ``deployment`` (its backend wins over ``backend``) the
    layers are one device's: the largest pipeline stage's (see :mod:`cachelib.plan.runtimes`);
    vLLM and llama.cpp allocate their own caches (strategy ``standard`` only): paged blocks, and
    the whole ``-c`` context (``max_model_len``, else ``context``) at start; with neither, each
    moment is sized as ``-c`` = the tokens so far would allocate it (what a search over contexts
    needs).
    """
    d = _deployment(deployment, backend)
    return _layout(device_arch_of(arch, d), parse_spec(spec), d, context)


def _layout(dev: Arch, spec: Spec, d: Deployment, context: int | None, batch: int = 1) -> list[LayerLayout]:
    spec = runtime_spec(spec, d)  # transformers' standard is its DynamicCache
    rt = d.profile
    if rt is not None and rt.runtime_cache:
        if not spec.reference:
            raise ValueError(
                f"runtime {rt.name} allocates its own cache; strategy {spec.name!r} does not apply there "
                "(use standard, which plans the runtime's own allocation)"
            )
        return _runtime_layout(dev, d, context, batch)
    spec.check_backend(d.backend)
    return _strategy_layout(dev, spec, d.backend)


def _strategy_layout(arch: Arch, spec: Spec, backend: str) -> list[LayerLayout]:
    strategy = spec.strategy
    full = strategy.plan(spec, backend)
    if spec.key_bits is not None:
        _check_group(arch, spec.get("group_size"))
        full = replace(full, key_bits=spec.key_bits, value_bits=spec.value_bits, group_size=spec.get("group_size"))
    window = arch.sliding_window or 0
    if strategy.every_attention_layer:
        sliding = replace(full, layer_type="sliding")
    else:
        own = strategy.plan_sliding(spec, backend, window) if strategy.plan_sliding else None
        sliding = own or _model_sliding(backend, window)
    recurrent = LayerLayout("ArraysCache" if backend == "mlx" else "LinearAttentionLayer", "recurrent")
    by_type = {"full": full, "sliding": sliding, "recurrent": recurrent}
    layout = [by_type[k] for k in arch.layer_kinds]
    if strategy.layered:  # each full-attention layer's descriptor depends on its depth (PyramidKV)
        index = [i for i, k in enumerate(arch.layer_kinds) if k == "full"]
        for n, i in enumerate(index):
            layout[i] = replace(layout[i], knobs=strategy.plan(spec, backend, layer=n, layers=len(index)).knobs)
    return layout


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to


def _runtime_layout(arch: Arch, d: Deployment, context: int | None, batch: int = 1) -> list[LayerLayout]:
    window = arch.sliding_window or 0
    if d.runtime == "vllm":
        if d.max_model_len and context and context > d.max_model_len:
            raise ValueError(
                f"vllm: context {context:,} is past max_model_len={d.max_model_len:,}; vLLM refuses "
                "such a request (raise max_model_len)"
            )
        block = d.paged_block
        by_type = {
            "full": LayerLayout("PagedBlocks", "full", (("block_size", block),)),
            "sliding": LayerLayout("PagedSlidingWindow", "sliding", (("window", window), ("block_size", block))),
            "recurrent": LayerLayout("MambaSpec", "recurrent"),
        }
    else:  # llama.cpp
        by_type = _llama_cpp_layout(arch, d, batch)
        by_type["recurrent"] = LayerLayout("llama_memory_recurrent", "recurrent")
    return [by_type[k] for k in arch.layer_kinds]


def _llama_cpp_layout(arch: Arch, d: Deployment, batch: int) -> dict[str, LayerLayout]:
    """llama.cpp's caches for ``batch`` sequences: with ``-c`` (``max_model_len``) the cells
    :func:`~cachelib.core.rules.llama_cpp_cells` allocates at start (``slots``: every stream's
    cells; ``limit``: one sequence's context, ``n_ctx_seq``, or its share of a unified KV);
    without, each moment as the smallest ``-c`` that holds the run so far."""
    slots, unified, swa_full, ubatch = llama_cpp_settings(d, batch)
    window = arch.sliding_window or 0
    if d.kv_format in ("q8_0", "q4_0") and d.flash_attn != "off":
        block = R.KV_FORMATS[d.kv_format][1]  # flash attention: each head a whole number of blocks
        if arch.key_dim % block or (not arch.latent and arch.value_dim % block):
            raise ValueError(
                f"llama.cpp -ctk/-ctv {d.kv_format} with flash attention needs head dims divisible "
                f"by {block} ({arch.name}: {arch.key_dim} / {arch.value_dim}); use -ctk/-ctv f16"
            )
    if d.max_model_len is None:
        per = batch if unified else slots
        knobs = (
            ("cells_step", R.LLAMA_CPP_PAD),
            ("per", per),
            ("parallel", slots),
            ("unified", int(unified)),
            ("swa_full", int(swa_full)),
            ("ubatch", ubatch),
            ("window", window),
            ("seqs", batch),
        )
        return {
            "full": LayerLayout("llama_kv_cache", "full", knobs),
            "sliding": LayerLayout("llama_kv_cache_swa", "sliding", knobs),
        }
    c = R.llama_cpp_cells(d.max_model_len, slots, unified, window=window, swa_full=swa_full, ubatch=ubatch)
    limit = c.n_ctx // batch if unified else c.n_ctx_seq
    return {
        "full": LayerLayout(
            "llama_kv_cache", "full", (("slots", c.full * c.streams), ("limit", limit), ("seqs", batch))
        ),
        "sliding": LayerLayout("llama_kv_cache_swa", "sliding", (("slots", c.swa * c.streams), ("seqs", batch))),
    }


def _model_sliding(backend: str, window: int) -> LayerLayout:
    """The cache a model's own sliding-window layer gets: mlx-lm a ring without sinks,
    transformers a sliding-window layer."""
    if backend == "mlx":
        return LayerLayout("RotatingKVCache", "sliding", (("max_size", window), ("keep", 0)))
    return LayerLayout("DynamicSlidingWindowLayer", "sliding", (("window", window),))


_RUNTIME_RULES = {
    "PagedBlocks",
    "PagedSlidingWindow",
    "MambaSpec",
    "llama_kv_cache",
    "llama_kv_cache_swa",
    "llama_memory_recurrent",
}


def _rule(cache: LayerLayout, arch: Arch, backend: str, dtype: str, batch: int, kv_format: str | None = None) -> R.Rule:
    fp = token_bytes(arch, dtype, batch=batch, kv_format=cache.kv_format or kv_format)
    if cache.kind in _RUNTIME_RULES:
        return _runtime_rule(cache, arch, dtype, batch, fp)
    q = None
    if cache.key_bits is not None:
        q = token_bytes(
            arch, dtype, batch=batch, key_bits=cache.key_bits, value_bits=cache.value_bits, group_size=cache.group_size
        )
    state = recurrent_state_bytes(arch, backend, dtype, batch=batch) if cache.layer_type == "recurrent" else 0
    return rule_for(cache, fp, q, state, kv_heads=arch.kv_heads)


def _runtime_rule(cache: LayerLayout, arch: Arch, dtype: str, batch: int, fp: int) -> R.Rule:
    kind = cache.kind
    if kind == "PagedBlocks":
        return R.Paged(fp, cache.knob("block_size"))
    if kind == "PagedSlidingWindow":
        return R.PagedSliding(fp, cache.knob("window"), cache.knob("block_size"))
    knobs = dict(cache.knobs)
    if kind in ("llama_kv_cache", "llama_kv_cache_swa"):  # cells count every sequence: one cell's bytes
        cell = fp // batch
        if "cells_step" in knobs:  # sized by the context so far
            return R.LlamaCppGrowing(
                cell,
                per=knobs["per"],
                slots=knobs["parallel"],
                unified=bool(knobs["unified"]),
                swa=cache.layer_type == "sliding",
                window=knobs["window"],
                swa_full=bool(knobs["swa_full"]),
                ubatch=knobs["ubatch"],
                seqs=knobs["seqs"],
                kind=kind,
            )
        return R.Preallocated(cell, knobs["slots"], knobs.get("limit"), kind=kind, seqs=knobs["seqs"])
    if kind == "MambaSpec":  # vLLM: conv (K-1, C) and SSM (C, N) state pages in the model dtype
        return R.RecurrentState(recurrent_state_bytes(arch, "mlx", dtype, batch=batch), kind=kind)
    return R.RecurrentState(recurrent_state_bytes(arch, "ggml", dtype, batch=batch), kind=kind)


# ---------------------------------------------------------------------------------------------
# update schedules


@dataclass(frozen=True)
class Update:
    """``repeat`` consecutive cache updates of ``tokens`` tokens each."""

    tokens: int
    repeat: int = 1
    phase: str = "decode"  # prefill / decode


def _positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def schedule(
    context: int, prefill: int | None = None, prefill_chunk: int | None = None, *, last_alone: bool = False
) -> list[Update]:
    """The updates of a run that ends holding ``context`` tokens: a prompt of ``prefill`` tokens
    (default: all of ``context``) fed in chunks of at most ``prefill_chunk`` tokens (default: one
    update), then ``context - prefill`` one-token decode steps. ``last_alone``: the prompt's last
    token is its own update after the chunks (mlx-lm's ``generate_step``)."""
    context = _positive_int("context", context)
    prefill = context if prefill is None else _positive_int("prefill", prefill, 0)
    if prefill > context:
        raise ValueError(f"prefill={prefill} must be <= context={context}")
    out: list[Update] = []
    if prefill:
        chunked = prefill - 1 if last_alone else prefill
        if chunked:
            chunk = chunked if not prefill_chunk else _positive_int("prefill_chunk", prefill_chunk)
            whole, rest = divmod(chunked, chunk)
            if whole:
                out.append(Update(chunk, whole, "prefill"))
            if rest:
                out.append(Update(rest, 1, "prefill"))
        if last_alone:
            out.append(Update(1, 1, "prefill"))
    if context > prefill:
        out.append(Update(1, context - prefill, "decode"))
    return out


# ---------------------------------------------------------------------------------------------
# the whole-model replay


@dataclass(frozen=True)
class StepBytes:
    """The whole cache around one update."""

    index: int
    phase: str
    tokens: int
    offset: int  # tokens seen after the update
    bytes_allocated: int  # every array of every layer, wherever it lives (== sum of nbytes)
    bytes_used: int
    device_bytes: int  # what stays on the device after the update
    host_bytes: int  # offloaded layers' bytes on the host after the update
    peak_bytes: int  # device bytes at the worst moment inside the update (transients included)
    layer_bytes: tuple[int, ...] = ()  # bytes allocated per layer after the update


class Replay:
    """A whole-model cache replayed on integers: one rule per distinct layer cache (identical
    layers share it), the layer order kept for peaks and offloading. :func:`trace`,
    :func:`account` and the solver drive it."""

    def __init__(
        self,
        caches: Sequence[LayerLayout],
        arch: Arch,
        backend: str,
        dtype: str,
        batch: int,
        kv_format: str | None = None,
    ):
        self.caches = list(caches)
        self.arch = arch  # the layers' architecture: one device's under a deployment
        self.first_layer = 0  # the model's index of the first layer here (a pipeline stage's start)
        self.stage_count = 1  # pipeline stages laid out alike
        groups: dict[LayerLayout, int] = {}
        for c in self.caches:
            groups.setdefault(c, len(groups))
        self.group_caches = list(groups)
        self.rules = [_rule(c, arch, backend, dtype, batch, kv_format) for c in self.group_caches]
        self.order = [groups[c] for c in self.caches]
        self.offloaded = [c.offloaded for c in self.caches]
        off = [i for i, o in enumerate(self.offloaded) if o]
        self.next_offloaded = {i: next((j for j in off if j > i), off[0]) for i in off}
        self.first_offloaded = off[0] if off else None
        self.counts = [self.order.count(g) for g in range(len(self.rules))]
        self.device_counts = [
            sum(1 for i, h in enumerate(self.order) if h == g and self.on_device(i)) for g in range(len(self.rules))
        ]
        self.offset = 0
        self.steps = 0

    def copy(self) -> Replay:
        twin = copy.copy(self)
        twin.rules = [r.copy() for r in self.rules]
        return twin

    def bounded(self) -> bool:
        """Whether no layer's cache can grow past a fixed size whatever comes."""
        return all(r.bounded for r in self.rules)

    def settled(self) -> bool:
        """Whether every coming 1-token update leaves every byte count and the peak as they are."""
        return all(r.settled() for r in self.rules)

    # -- state
    def totals(self) -> tuple[int, int]:
        alloc = sum(n * r.bytes_allocated for n, r in zip(self.counts, self.rules))
        used = sum(n * r.bytes_used for n, r in zip(self.counts, self.rules))
        return alloc, used

    def on_device(self, i: int) -> bool:
        if not self.offloaded[i]:
            return True
        first = self.first_offloaded
        return i == first and self.next_offloaded[first] != first

    def device_bytes(self) -> int:
        return sum(n * r.bytes_allocated for n, r in zip(self.device_counts, self.rules))

    # -- one update through every layer
    def update(self, n: int, phase: str, keep_layers: bool) -> StepBytes:
        before = [r.bytes_allocated for r in self.rules]
        trans = [r.update(n) for r in self.rules]
        after = [r.bytes_allocated for r in self.rules]
        self.offset += n
        peak = self._peak(before, trans, after)
        alloc, used = self.totals()
        device = self.device_bytes()
        step = StepBytes(
            self.steps,
            phase,
            n,
            self.offset,
            alloc,
            used,
            device,
            alloc - device,
            peak,
            tuple(after[g] for g in self.order) if keep_layers else (),
        )
        self.steps += 1
        return step

    def _peak(self, before: list[int], trans: list[int], after: list[int]) -> int:
        order = self.order
        if self.first_offloaded is None:
            running = sum(before[g] for g in order)
            peak = running
            for g in order:
                peak = max(peak, running - before[g] + trans[g])
                running += after[g] - before[g]
            return peak
        # offloading: the device holds resident layers, the layer updating and the one prefetched
        first = self.first_offloaded
        device = sum(before[g] for i, g in enumerate(order) if not self.offloaded[i]) + before[order[first]]
        present = {first}
        peak = device
        for i, g in enumerate(order):
            if self.offloaded[i]:
                j = self.next_offloaded[i]
                if j not in present:
                    device += before[order[j]] if j > i else after[order[j]]
                    present.add(j)
                peak = max(peak, device - before[g] + trans[g])
                device += after[g] - before[g]
                device -= after[g]
                present.discard(i)
            else:
                peak = max(peak, device - before[g] + trans[g])
                device += after[g] - before[g]
        return peak

    def regular_steps(self) -> int:
        return min(r.regular_steps() for r in self.rules)

    def skip(self, k: int) -> None:
        for r in self.rules:
            r.skip(k)
        self.offset += k
        self.steps += k

    def feed(self, n: int, count: int, phase: str) -> tuple[int, int]:
        """Apply ``count`` updates of ``n`` tokens; return the highest peak and the most device
        bytes among them. Exact, in time bounded by the updates' cycle, not by ``count``.

        1-token updates skip their regular stretches (the maximum is at a stretch's last step).
        Once every rule's ``cycle_key`` has come round three times at equal spacing, and every
        field moved by the same amounts between them, the updates go round a cycle: whole cycles
        are jumped over by shifting the fields, within every rule's ``cycle_horizon``, and the
        cycle after them is replayed. Bytes move affinely from cycle to cycle, so each moment's
        peak is a maximum of affine functions of the cycle's number, highest at the first or the
        last cycle, both replayed."""
        peak = resident = 0
        seen: dict = {}  # cycle key -> [(updates left, fields)] at its sightings
        left = count
        while left:
            key = self._cycle_key(n)
            if key is not None:
                marks = seen.setdefault(key, [])
                marks.append((left, [r.fields() for r in self.rules]))
                jumped = self._jump(n, marks, left) if len(marks) >= 3 else 0
                if jumped:
                    left -= jumped
                    seen.clear()
                    continue
                if len(seen) > CYCLE_KEYS:  # no cycle in sight: start looking afresh
                    seen.clear()
            k = 1  # updates this event makes: a regular stretch's skipped ones and the last
            if n == 1:
                k = max(1, min(self.regular_steps(), left))
                if k > 1:
                    self.skip(k - 1)
            step = self.update(n, phase, False)
            peak = max(peak, step.peak_bytes)
            resident = max(resident, step.device_bytes)
            left -= k
        return peak, resident

    def _cycle_key(self, n: int):
        keys = tuple(r.cycle_key(n) for r in self.rules)
        return None if any(k is None for k in keys) else keys

    def _jump(self, n: int, marks: list, left: int) -> int:
        """Shift the state by whole cycles seen in the last three ``marks``; the updates jumped."""
        (l0, f0), (l1, f1), (l2, f2) = marks[-3:]
        per_cycle = l1 - l2
        if per_cycle <= 0 or l0 - l1 != per_cycle:
            return 0
        deltas = []
        for a, b, c in zip(f0, f1, f2):
            if a.keys() != c.keys() or any(b[f] - a[f] != c[f] - b[f] for f in a):
                return 0
            deltas.append({f: c[f] - b[f] for f in c})
        # keep one whole cycle to replay, inside every horizon
        reach = min([left, *(r.cycle_horizon(n) for r in self.rules)])
        cycles = reach // per_cycle - 1
        if cycles < 1:
            return 0
        for r, d in zip(self.rules, deltas):
            r.shift(d, cycles)
        jumped = cycles * per_cycle
        self.offset += jumped * n
        self.steps += jumped
        return jumped


def replay(
    arch: Arch,
    spec: str | Spec,
    backend: str = "mlx",
    *,
    batch: int = 1,
    dtype: str = "float16",
    deployment: Deployment | None = None,
    context: int | None = None,
) -> Replay:
    """An empty :class:`Replay` of the cache ``spec`` builds for ``arch`` on ``backend``; with a
    ``deployment``, of one device's cache (the largest pipeline stage, one tensor-parallel rank;
    ``context``: the run's, for runtimes that allocate it at start)."""
    spec = parse_spec(spec)
    check_dtype(dtype)
    _positive_int("batch", batch)
    d = _deployment(deployment, backend)
    return _stage_replays(arch, spec, d, dtype, batch, context)[0]


def _stage_replays(arch: Arch, spec: Spec, d: Deployment, dtype: str, batch: int, context: int | None) -> list[Replay]:
    """Replays of the distinct pipeline stages, the largest first, each with how many stages
    share its layout (``Replay.stage_count``)."""
    stage_list = stage_arches(arch, d)
    starts = [r.start for r in stages(arch, d.pp, d)]
    first = largest_stage(stage_list)
    order = [first] + [i for i in range(len(stage_list)) if i != first]
    seen: dict[tuple, Replay] = {}
    for i in order:
        a = stage_list[i]
        key = (a.layer_kinds,)
        if key in seen:
            seen[key].stage_count += 1
            continue
        run = Replay(_layout(a, spec, d, context, batch), a, d.backend, dtype, batch, d.kv_format)
        run.first_layer = starts[i]
        seen[key] = run
    return list(seen.values())


@dataclass(frozen=True)
class Trace:
    """Every update of a run, in order."""

    arch: str
    spec: str
    backend: str
    dtype: str
    batch: int
    layers: tuple[LayerLayout, ...]
    steps: tuple[StepBytes, ...]
    deployment: Deployment | None = None  # steps are one device's bytes under a deployment

    @property
    def peak_bytes(self) -> int:
        return max((s.peak_bytes for s in self.steps), default=0)

    def rows(self) -> list[dict]:
        """One plain dict per update (per-layer bytes left out), for tables and CSV."""
        keys = (
            "index",
            "phase",
            "tokens",
            "offset",
            "bytes_allocated",
            "bytes_used",
            "device_bytes",
            "host_bytes",
            "peak_bytes",
        )
        return [{k: getattr(s, k) for k in keys} for s in self.steps]


def trace(
    arch: Arch,
    spec: str | Spec,
    backend: str = "mlx",
    *,
    context: int | None = None,
    prefill: int | None = None,
    prefill_chunk: int | None = None,
    updates: Iterable[int] | None = None,
    batch: int = 1,
    dtype: str = "float16",
    deployment: Deployment | None = None,
) -> Trace:
    """Bytes after every update of a run: ``context`` tokens as :func:`schedule` splits them, or
    an explicit list of update sizes (``updates``, e.g. ``[100, 1, 1, 7, 1]``).

    With a ``deployment`` (its backend wins over ``backend``) every byte count is one device's:
    the largest pipeline stage on one tensor-parallel rank; the prompt goes in the runtime's
    chunks (``deployment.prefill_chunk``) unless ``prefill_chunk`` says otherwise."""
    spec = parse_spec(spec)
    d = _deployment(deployment, backend)
    if updates is not None:
        if context is not None or prefill is not None or prefill_chunk is not None:
            raise ValueError("give either updates or context/prefill/prefill_chunk, not both")
        plan = [Update(_positive_int("update size", int(n)), 1, "prefill" if n > 1 else "decode") for n in updates]
    else:
        if context is None:
            raise ValueError("context is required (or give updates)")
        plan = schedule(context, prefill, prefill_chunk or d.prefill_chunk, last_alone=prompt_last_alone(d.runtime))
    total = sum(u.tokens * u.repeat for u in plan)
    run = replay(arch, spec, backend, batch=batch, dtype=dtype, deployment=deployment, context=total)
    steps = [run.update(u.tokens, u.phase, True) for u in plan for _ in range(u.repeat)]
    return Trace(arch.name, str(spec), d.backend, dtype, batch, tuple(run.caches), tuple(steps), deployment)


# ---------------------------------------------------------------------------------------------
# final state + peaks, fast


@dataclass(frozen=True)
class LayerAccount:
    index: int
    layer_type: str
    kind: str
    tokens_held: int
    capacity: int
    bytes_allocated: int
    bytes_used: int
    on_device: bool


@dataclass(frozen=True)
class Account:
    """A run's end state and worst moments. Byte counts cover the whole batch."""

    arch: str
    spec: str
    backend: str
    dtype: str
    batch: int
    context: int
    prefill: int
    prefill_chunk: int | None
    layers: tuple[LayerAccount, ...]
    bytes_allocated: int  # after the last update: every array of the cache (== sum of nbytes)
    bytes_used: int  # the slots that hold tokens (+ recurrent state)
    device_bytes: int  # after the last update, on the device
    host_bytes: int  # after the last update, offloaded to the host
    peak_bytes: int  # device: the worst moment of the run, transients included
    max_resident_bytes: int  # device: the most held between updates
    deployment: Deployment | None = None  # every count above is one device's under a deployment
    devices: int = 1  # devices the deployment spreads the cache over (tp x pp)
    total_bytes_allocated: int | None = None  # summed over every device (None: one device, bytes_allocated)

    @property
    def total_bytes(self) -> int:
        """Bytes allocated at the end over every device of the deployment (replicated KV heads
        counted on each rank that holds them)."""
        return self.bytes_allocated if self.total_bytes_allocated is None else self.total_bytes_allocated

    @property
    def bytes_per_token(self) -> float:
        """Bytes allocated at the end per token of context (whole batch)."""
        return self.bytes_allocated / self.context


def account(
    arch: Arch,
    spec: str | Spec,
    backend: str = "mlx",
    *,
    context: int,
    prefill: int | None = None,
    prefill_chunk: int | None = None,
    batch: int = 1,
    dtype: str = "float16",
    deployment: Deployment | None = None,
) -> Account:
    """The cache after a run of ``context`` tokens (see :func:`schedule`), per layer and in
    total, with the run's peak and resident maxima. Equal to the last step of :func:`trace`,
    computed in time bounded by the updates' cycles (:meth:`Replay.feed`), not by tokens.

    With a ``deployment`` (its backend wins over ``backend``; the prompt goes in its runtime's
    chunks unless ``prefill_chunk`` is given) the layers and every byte count are one device's:
    the largest pipeline stage (most layers, then most full-attention layers) on one
    tensor-parallel rank, which is what must fit in one device's memory. ``total_bytes`` sums
    every device: each stage's bytes times ``tp`` (KV heads replicated past their count are
    counted on every rank that holds them), so it is ``bytes_allocated x devices`` only when
    the stages are alike."""
    spec = parse_spec(spec)
    check_dtype(dtype)
    _positive_int("batch", batch)
    d = _deployment(deployment, backend)
    plan = schedule(context, prefill, prefill_chunk or d.prefill_chunk, last_alone=prompt_last_alone(d.runtime))
    runs = _stage_replays(arch, spec, d, dtype, batch, context)
    total = 0
    for i, run in enumerate(runs):
        peak = resident = 0
        for u in plan:
            p, r = run.feed(u.tokens, u.repeat, u.phase)
            peak, resident = max(peak, p), max(resident, r)
        total += run.totals()[0] * run.stage_count * d.tp
        if i == 0:
            first = (peak, resident)
    run = runs[0]
    peak, resident = first
    alloc, used = run.totals()
    device = run.device_bytes()
    layers = []
    for i, (cache, g) in enumerate(zip(run.caches, run.order)):
        s = run.rules[g].state()
        layers.append(
            LayerAccount(
                run.first_layer + i,
                cache.layer_type,
                s.kind,
                s.tokens_held,
                s.capacity,
                s.bytes_allocated,
                s.bytes_used,
                run.on_device(i),
            )
        )
    prefill_tokens = sum(u.tokens * u.repeat for u in plan if u.phase == "prefill")
    return Account(
        arch.name,
        str(spec),
        d.backend,
        dtype,
        batch,
        context,
        prefill_tokens,
        prefill_chunk or d.prefill_chunk,
        tuple(layers),
        alloc,
        used,
        device,
        alloc - device,
        peak,
        resident,
        deployment,
        d.devices,
        total if deployment is not None else None,
    )
