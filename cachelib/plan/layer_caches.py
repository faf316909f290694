"""Which cache each layer gets, for a strategy on a backend or as a runtime allocates it.

Full-attention layers, by strategy (both backends unless noted):
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
"""

from __future__ import annotations

from dataclasses import replace

from ..core import rules as R
from ..core.formats import FORMATS
from ..core.layout import LayerLayout, rule_for
from ..spec import Spec, parse_spec
from .arch import Arch
from .runtimes import (
    Deployment,
    as_deployment,
    llama_cpp_settings,
    runtime_spec,
)
from .slot_bytes import _check_group, device_arch_of, recurrent_state_bytes, token_bytes


def deployment_of(deployment: Deployment | None, backend: str) -> Deployment:
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
    d = deployment_of(deployment, backend)
    return device_layout(device_arch_of(arch, d), parse_spec(spec), d, context)


def device_layout(dev: Arch, spec: Spec, d: Deployment, context: int | None, batch: int = 1) -> list[LayerLayout]:
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
    if d.kv_format is not None and FORMATS[d.kv_format].scaled and d.flash_attn != "off":
        block = FORMATS[d.kv_format].block  # flash attention: each head a whole number of blocks
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


def layer_rule(
    cache: LayerLayout, arch: Arch, backend: str, dtype: str, batch: int, kv_format: str | None = None
) -> R.Rule:
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
