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
layer registers itself in every ``update`` (:func:`expect`); the function takes the registered
layer whose held keys are the keys it was given (the same tensor object). Before calling the
previous implementation it fixes that layer's mask where needed (:func:`merge_head_mask`): a
layer whose KV heads hold different counts (Ada-KV, ``snapkv:adaptive=1``) gets its per-head
padding hidden, and a layer holding another count than the layer transformers sized the mask
from (PyramidKV) gets a mask of its own width. After it, a layer awaiting queries gets them.

Cost: one extra ``q @ k^T`` and softmax over the keys held, in float32, per layer per step, for
the observation window only (SnapKV, at prefill), the last query (TOVA) or every query (H2O);
the layer reports the time as ``score_seconds`` in its view, and the profiler records it.
"""

from __future__ import annotations

import sys
import weakref
from contextlib import contextmanager
from typing import Iterator

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

PREFIX = "cachelib_capture_"
_awaiting: list = []  # weak references to layers updated this step and not yet served
_depth = [0]  # capture blocks open now


def capturing() -> bool:
    """Whether some model runs inside :func:`capture` now."""
    return _depth[0] > 0


def expect(layer) -> None:
    """Called by an importance layer's ``update``, every step: the function below finds it by
    its keys, merges its mask when needed and hands it the queries it awaits."""
    _awaiting.append(weakref.ref(layer))
    if len(_awaiting) > 64:  # layers a capture-less run never served
        del _awaiting[:-64]


def _take(keys):
    for i in range(len(_awaiting) - 1, -1, -1):
        layer = _awaiting[i]()
        if layer is None:
            del _awaiting[i]
        elif layer.keys is keys:
            del _awaiting[i]
            return layer
    return None


def merge_head_mask(mask, head_mask: torch.Tensor | None, query: torch.Tensor, S: int | None = None):
    """The attention mask of an importance layer holding ``S`` slots, with its per-KV-head
    ``head_mask`` (B, H_kv, S) bool (None: every slot real) merged in: (B, H_q, q, S), boolean
    when ``mask`` is None or boolean (sdpa), else additive (eager). Every kept slot is older than
    the ``q`` new ones, so the causal part is "key ``j`` is visible to query ``i`` iff ``j <= S -
    q + i``"; a given mask of another width (transformers builds one mask per layer type, from
    the first layer's sizes, and PyramidKV's layers hold different counts) is replaced by it."""
    B, h_q, q, _ = query.shape
    if head_mask is None:
        head_mask = torch.ones((B, 1, S), dtype=torch.bool, device=query.device)
    h_kv, S = head_mask.shape[1], head_mask.shape[-1]
    heads = head_mask.repeat_interleave(h_q // h_kv, dim=1)[:, :, None, :]  # (B, H_q, 1, S)
    if mask is not None and mask.shape[-1] != S:
        mask = None if mask.dtype == torch.bool else torch.zeros((), dtype=mask.dtype, device=mask.device)
    if mask is None or mask.ndim == 0:
        slots = torch.arange(S, device=head_mask.device)
        causal = slots[None, :] <= slots[S - q :, None]
        keep = heads & causal
        if mask is None:
            return keep
        return torch.where(keep, mask, torch.finfo(mask.dtype).min)
    if mask.dtype == torch.bool:
        return heads & mask
    return torch.where(heads, mask, torch.finfo(mask.dtype).min)


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
        layer = _take(key)
        if layer is not None:
            resized = attention_mask is not None and attention_mask.shape[-1] != key.shape[-2]
            if layer.head_mask is not None or resized:  # Ada-KV's padded heads; PyramidKV's sizes
                attention_mask = merge_head_mask(attention_mask, layer.head_mask, query, key.shape[-2])
        out = _base_function(impl, module)(module, query, key, value, attention_mask, **kwargs)
        if layer is not None and layer.awaiting:
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
    _depth[0] += 1
    try:
        for config, impl in zip(configs, before):
            if impl is not None and not impl.startswith(PREFIX):
                config._attn_implementation = _register(impl)
        yield
    finally:
        _depth[0] -= 1
        for config, impl in zip(configs, before):
            config._attn_implementation = impl
