"""What the planner puts on one layer: a cache class with the knobs its byte rule needs, and
that class's byte rule (:mod:`cachelib.core.rules`).

A :class:`LayerLayout` names a class, not a strategy: a strategy's table entry
(:data:`cachelib.spec.STRATEGIES`) says which classes it puts on which layers, and
:func:`rule_for` knows how each class allocates. Classes that allocate alike share a rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import rules as R
from .units import STEP

EACH_STEP = "each step"
ONCE = "once"


@dataclass(frozen=True)
class LayerLayout:
    """The cache class one layer gets, with the knobs its byte rule needs."""

    kind: str  # the class whose allocation rules apply
    layer_type: str  # full / sliding / recurrent
    knobs: tuple[tuple[str, int], ...] = ()
    key_bits: int | None = None
    value_bits: int | None = None
    group_size: int | None = None
    offloaded: bool = False
    kv_format: str | None = None  # stored in a runtime's format (rules.KV_FORMATS), not the dtype
    # an importance cache (cachelib.core.importance): it keeps the `budget` knob's tokens, evicting
    # EACH_STEP or ONCE (at the first decode step); `kind` is then its strategy's name
    evicts: str | None = None

    def knob(self, name: str) -> int:
        return dict(self.knobs)[name]

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.knobs]
        if self.key_bits is not None:
            bits = self.key_bits if self.key_bits == self.value_bits else f"{self.key_bits}/{self.value_bits}"
            parts.append(f"bits={bits},group_size={self.group_size}")
        if self.kv_format is not None:
            parts.append(f"format={self.kv_format}")
        text = f"{self.kind}({', '.join(parts)})"
        return text + " offloaded" if self.offloaded else text


def rule_for(
    cache: LayerLayout, token_bytes: int, quantized_bytes: int | None, state_bytes: int, kv_heads: int = 1
) -> R.Rule:
    """The byte rule of ``cache``'s class. ``token_bytes`` is one full-precision token slot of the
    layer, ``quantized_bytes`` one quantized slot (None when the layer stores no quantized
    tokens), ``state_bytes`` a recurrent layer's whole state, ``kv_heads`` its KV heads (which
    share a budget unevenly under Ada-KV)."""
    kind = cache.kind
    # a quantized ring holds quantized slots; every other class says which slots it quantizes
    slot = quantized_bytes if quantized_bytes is not None else token_bytes
    if kind == "KVCache":
        return R.StepGrowth(token_bytes, cache.knob("step"))
    if kind == "FormatKVCache":  # token_bytes: one slot in the cache's kv_format
        return R.StepGrowth(token_bytes, cache.knob("step"), kind=kind)
    if kind in ("ConcatenateKVCache", "DynamicLayer"):
        return R.Concatenate(token_bytes, kind=kind)
    if kind == "RotatingKVCache":
        return R.Rotating(slot, cache.knob("max_size"), cache.knob("keep"))
    if kind == "QuantizedKVCache":
        start = cache.knob("start")
        if start == 0:
            return R.StepGrowth(quantized_bytes, STEP, kind="QuantizedKVCache")
        return R.QuantizeAfter(token_bytes, quantized_bytes, start)
    if kind == "QuantizedLayer":
        return R.Kivi(token_bytes, quantized_bytes, cache.knob("residual"))
    if kind == "ChunkedKVCache":
        return R.Chunked(token_bytes, cache.knob("chunk_size"))
    if kind == "StaticLayer":
        return R.Static(token_bytes, cache.knob("max_len"))
    if kind == "DynamicSlidingWindowLayer":
        return R.DynamicSliding(token_bytes, cache.knob("window"))
    if kind == "StaticSlidingWindowLayer":
        return R.StaticSliding(token_bytes, cache.knob("max_cache_len"), cache.knob("window"))
    if cache.evicts == EACH_STEP:  # importance caches (cachelib.core.importance)
        return R.BudgetEachStep(token_bytes, cache.knob("budget"), kind=kind)
    if cache.evicts == ONCE and "safe" in dict(cache.knobs):  # Ada-KV: heads share the budget unevenly
        return R.BudgetOnceHeads(token_bytes, cache.knob("budget"), kv_heads, cache.knob("safe"), kind=kind)
    if cache.evicts == ONCE:  # the layer's own budget (pyramidkv: its depth's)
        return R.BudgetOnce(token_bytes, cache.knob("budget"), kind=kind)
    if kind in ("ArraysCache", "LinearAttentionLayer"):
        return R.RecurrentState(state_bytes, kind=kind)
    raise ValueError(f"no byte rule for cache class {kind!r}")
