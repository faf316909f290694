"""The attention-capture hook on PyTorch: hands an importance cache the queries the attention
layer already has, without touching the model's code.

transformers looks up each layer's attention function by name (``config._attn_implementation``
in ``AttentionInterface``). :func:`capture` registers ``cachelib_capture_<impl>`` (``<impl>``:
the implementation the model used before, e.g. ``sdpa`` or ``eager``), selects it for the
duration of a ``with`` block and restores the previous name afterwards. The registered function
computes the attention output with the previous implementation, unchanged, and then, when the
layer the model has just updated is an :class:`~cachelib.torch.importance.ImportanceLayer`
waiting for queries, gives it the post-RoPE queries; the layer scores its keys from them.

How the function finds the layer: transformers' attention modules call
``cache.update(k, v, layer_idx)`` and then the attention function, in that order. An importance
layer that needs queries marks itself as awaiting in ``update``; the function takes the awaiting
layer whose held keys are the keys it was given (the same tensor object).

Cost: one extra ``q @ k^T`` and softmax over the keys held, in float32, per layer per step, for
the observation window only (SnapKV, at prefill), the last query (TOVA) or every query (H2O);
the layer reports the time as ``score_seconds`` in its view, and the profiler records it.
"""

from __future__ import annotations

import sys
import weakref
from contextlib import contextmanager
from typing import Iterator

from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

PREFIX = "cachelib_capture_"
_awaiting: list = []  # weak references to layers updated this step and not yet given queries


def expect(layer) -> None:
    """Called by an importance layer's ``update``: it waits for this step's queries."""
    _awaiting.append(weakref.ref(layer))
    if len(_awaiting) > 64:  # layers a capture-less run never served
        del _awaiting[:-64]


def _take(keys):
    for i in range(len(_awaiting) - 1, -1, -1):
        layer = _awaiting[i]()
        if layer is None or not layer.awaiting:
            del _awaiting[i]
        elif layer.keys is keys:
            del _awaiting[i]
            return layer
    return None


def _base_function(impl: str, module):
    if impl in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[impl]
    # "eager": the model's own function, defined next to its attention module
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise ValueError(f"attention capture: model module {type(module).__module__} has no eager_attention_forward")
    return fn


def _register(impl: str) -> str:
    name = PREFIX + impl
    if name in ALL_ATTENTION_FUNCTIONS:
        return name

    def attention(module, query, key, value, attention_mask, **kwargs):
        out = _base_function(impl, module)(module, query, key, value, attention_mask, **kwargs)
        layer = _take(key)
        if layer is not None:
            layer.observe(query, kwargs.get("scaling"))
        return out

    AttentionInterface.register(name, attention)
    # the masks the previous implementation was given (eager's for one transformers has no mask of)
    mask_impl = impl if impl in ALL_MASK_ATTENTION_FUNCTIONS else "eager"
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[mask_impl])
    return name


def _configs(model):
    seen = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation") and all(config is not c for c in seen):
            seen.append(config)
    return seen


@contextmanager
def capture(model) -> Iterator[None]:
    """Inside the block, ``model``'s attention layers hand their queries to importance caches
    (a no-op for every other cache). Re-entrant; the previous implementation is restored after."""
    model = getattr(model, "model", model) if hasattr(model, "info") else model
    configs = _configs(model)
    before = [c._attn_implementation for c in configs]
    try:
        for config, impl in zip(configs, before):
            if impl is not None and not impl.startswith(PREFIX):
                config._attn_implementation = _register(impl)
        yield
    finally:
        for config, impl in zip(configs, before):
            config._attn_implementation = impl
