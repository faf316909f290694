"""The allocation rules of each layer-cache class, replayed on integers.

A rule object keeps only the integers its cache class keeps (offset, slots allocated, ring
pointer, tokens quantized, ...) and the byte size of one token slot, and replays an update of
``n`` tokens exactly as the class allocates: mlx-lm 0.32 ``KVCache``, ``ConcatenateKVCache``,
``RotatingKVCache``, ``QuantizedKVCache`` (+ ``to_quantized``), ``ChunkedKVCache``,
``ArraysCache``; transformers 5.24 ``DynamicLayer``, ``DynamicSlidingWindowLayer``,
``StaticLayer``, ``StaticSlidingWindowLayer``, ``QuantizedLayer`` (KIVI residual) and
``LinearAttentionLayer``. ``bytes_allocated`` after an update equals the ``nbytes`` the real
cache reports (the sum of its arrays' logical sizes), byte for byte.

``update`` also returns the transient peak: the bytes the cache's arrays hold at the worst
moment inside the update, under one documented model: an array is freed when it is replaced, so
growth by concatenation holds old + new, ``to_quantized`` holds both copies, a KIVI update holds
its dequantized copy and the concatenated full-precision states it returns. Views (slices) are
counted as free. The transient is a model of the reference code, not a measurement.

Decode runs fast: ``regular_steps()`` says how many coming 1-token updates change bytes only
affinely and never downward (steady writes, or growth by exactly one token), so the caller may
``skip`` all but the last of them and still see the run's maximum. Long runs of equal updates
(prompt chunks, decode across growth steps) run fast too: ``cycle_key(n)`` is everything that
decides how the coming ``n``-token updates change a rule apart from the position fields they
shift, so once it repeats the updates go round a cycle, and the caller may shift the fields by
whole cycles (``fields`` / ``shift``) within ``cycle_horizon(n)``.

This package knows allocation arithmetic only: nothing of models, strategies or backends.

By idea: :mod:`.base` (the protocol), :mod:`.caches` (mlx-lm's and transformers' classes and
ours built like them), :mod:`.runtimes` (vLLM's and llama.cpp's own allocators and KV formats),
:mod:`.importance` (the evicting caches); everything is importable from here.
"""

from .base import UNBOUNDED, LayerBytes, Rule, ceil_steps
from .caches import (
    Chunked,
    Concatenate,
    DynamicSliding,
    Kivi,
    QuantizeAfter,
    RecurrentState,
    Rotating,
    Static,
    StaticSliding,
    StepGrowth,
)
from .importance import BudgetEachStep, BudgetOnce, BudgetOnceHeads
from .runtimes import (
    KV_FORMATS,
    LLAMA_CPP_PAD,
    LlamaCppCells,
    LlamaCppGrowing,
    Paged,
    PagedSliding,
    Preallocated,
    format_bytes,
    llama_cpp_cells,
)

__all__ = [
    "UNBOUNDED",
    "LayerBytes",
    "Rule",
    "ceil_steps",
    "Chunked",
    "Concatenate",
    "DynamicSliding",
    "Kivi",
    "QuantizeAfter",
    "RecurrentState",
    "Rotating",
    "Static",
    "StaticSliding",
    "StepGrowth",
    "BudgetEachStep",
    "BudgetOnce",
    "BudgetOnceHeads",
    "KV_FORMATS",
    "LLAMA_CPP_PAD",
    "LlamaCppCells",
    "LlamaCppGrowing",
    "Paged",
    "PagedSliding",
    "Preallocated",
    "format_bytes",
    "llama_cpp_cells",
]
