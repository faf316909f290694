"""The attention-capture hook on MLX: hands an importance cache the queries the attention layer
already has, without touching the model's code.

mlx-lm's attention layers (``mlx_lm/models/llama.py`` and most others, 0.32.2) call the function
``scaled_dot_product_attention(queries, keys, values, cache=cache, scale=..., mask=...)`` that
their model module imports from ``mlx_lm.models.base``, right after
``cache.update_and_fetch(keys, values)``. :func:`capture` replaces that name in each model
module the model is built from, for the duration of a ``with`` block, with a wrapper that calls
the original unchanged and then, when the ``cache`` it was given is an
:class:`~cachelib.mlx.importance.ImportanceKVCache` waiting for queries, gives it the post-RoPE
queries; the original function is restored afterwards. A cache whose KV heads hold different
counts (Ada-KV, ``snapkv:adaptive=1``) exposes a per-head ``head_mask``; the wrapper merges it into
the mask it passes on (:func:`merge_head_mask`), so the padding is never attended.

Cost: one extra ``q @ k^T`` and softmax over the keys held, in float32, per layer per step, for
the observation window only (SnapKV, at prefill), the last query (TOVA) or every query (H2O),
computed lazily with the rest of the step (no host round trip per step; TOVA and H2O are
scored inside the next update's compiled call); the cache reports the host time spent queuing it
as ``score_seconds`` in its view, and the profiler records it. A decode step of TOVA or H2O on
the CPU in float32 costs no extra pass: there MLX's attention is plain ops (its fused kernel is
the GPU's), so the wrapper runs those same ops itself (:func:`last_query_attention`, the same
numbers) and hands the cache the softmax weights the attention computed
(``ImportanceKVCache.observe_weights``). The model modules to patch are found once per model.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from contextlib import contextmanager
from typing import Iterator

import mlx.core as mx

NAME = "scaled_dot_product_attention"
_patched: dict[str, tuple[object, int]] = {}  # module name -> (original function, depth)


_modules: dict[int, tuple[weakref.ref, list[str]]] = {}  # id(model) -> (the model, its modules to patch)


def _model_modules(model) -> list[str]:
    """The modules ``model``'s layers are defined in that call :data:`NAME`; walked once per model
    (a walk of every submodule costs ~1.5 ms, a decode step of a small model ~80 ms)."""
    key = id(model)
    known = _modules.get(key)
    if known is not None and known[0]() is model:
        return known[1]
    names = {type(model).__module__}
    for _, module in model.named_modules():
        names.add(type(module).__module__)
    found = sorted(n for n in names if hasattr(sys.modules.get(n), NAME))
    _modules[key] = (weakref.ref(model, lambda _, key=key: _modules.pop(key, None)), found)
    return found


def capturing() -> bool:
    """Whether some model runs inside :func:`capture` now."""
    return bool(_patched)


def merge_head_mask(mask, head_mask, queries):
    """``mask`` as mlx-lm passes it (None, ``"causal"``, a boolean or an additive array) with a
    cache's per-KV-head ``head_mask`` (B, H_kv, S) bool merged in: (B, H_q, L, S), the keys a
    mask hid or the head lacks (padding) hidden; a query head reads its KV group's row."""
    B, h_q, L, _ = queries.shape
    h_kv, S = head_mask.shape[1], head_mask.shape[-1]
    heads = mx.repeat(head_mask, h_q // h_kv, axis=1)[:, :, None, :]  # (B, H_q, 1, S)
    if mask is None and L == 1:
        return heads
    if mask is None or isinstance(mask, str):  # "causal": the queries are the last L positions
        mask = mx.arange(S)[None, :] <= mx.arange(S - L, S)[:, None]
    if mask.dtype == mx.bool_:
        return heads & mask
    return mx.where(heads, mask, mx.array(-mx.inf, mask.dtype))


def last_query_weights(queries: mx.array, keys: mx.array, scale: float) -> mx.array:
    """The softmax weights of ``queries`` (B, H_q, L, D) on ``keys`` (B, H_kv, T, D), no mask, by the
    ops MLX's own attention runs on the CPU (``mx.fast.scaled_dot_product_attention``'s fallback:
    the queries scaled first, a query head grouped with its KV head): (B, H_kv, H_q / H_kv, L, T),
    or (B, H_q, L, T) without grouped heads."""
    B, h_q, L, D = queries.shape
    h_kv = keys.shape[1]
    q = mx.array(scale, dtype=queries.dtype) * queries
    if h_q != h_kv:
        q = q.reshape(B, h_kv, h_q // h_kv, L, D)
        keys = mx.expand_dims(keys, 2)
    return mx.softmax(q @ keys.swapaxes(-1, -2), axis=-1, precise=True)


def last_query_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float):
    """``mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale)`` without a mask,
    as MLX computes it on the CPU (the same ops, so the same numbers), and its softmax weights:
    (output (B, H_q, L, D), weights as :func:`last_query_weights` gives them)."""
    B, h_q, L, D = queries.shape
    weights = last_query_weights(queries, keys, scale)
    if h_q == keys.shape[1]:
        return weights @ values, weights
    return (weights @ mx.expand_dims(values, 2)).reshape(B, h_q, L, values.shape[-1]), weights


def _hands_weights(cache, call: dict) -> bool:
    """Whether this attention call can hand ``cache`` its softmax weights: a cache that scores from
    them (TOVA, H2O) waiting for them, one query, no mask or sinks, float32, on the CPU (where
    :func:`last_query_attention` is what MLX's attention computes)."""
    if not getattr(cache, "takes_weights", False) or call.get("mask") is not None or call.get("sinks") is not None:
        return False
    q, k, v = call["queries"], call["keys"], call["values"]
    if q.shape[2] != 1 or not q.dtype == k.dtype == v.dtype == mx.float32 or call.get("scale") is None:
        return False
    return mx.default_device() == mx.cpu


def _wrap(original):
    signature = inspect.signature(original)
    names = list(signature.parameters)
    plain = all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in signature.parameters.values())
    after = [set(names[i:]) for i in range(len(names) + 1)]  # the names a call may give by keyword after i positional

    def arguments(args: tuple, kwargs: dict) -> dict:
        """The call's arguments by name: ``signature.bind``'s, without its cost for a plain call."""
        if plain and len(args) <= len(names) and kwargs.keys() <= after[len(args)]:
            return {**dict(zip(names, args)), **kwargs}
        return signature.bind(*args, **kwargs).arguments

    def scaled_dot_product_attention(*args, **kwargs):
        call = arguments(args, kwargs)
        cache = call.get("cache")
        if _hands_weights(cache, call):  # the attention's own weights score the keys: no second pass
            out, weights = last_query_attention(call["queries"], call["keys"], call["values"], call["scale"])
            cache.observe_weights(weights)
            return out
        head_mask = getattr(cache, "head_mask", None)
        if head_mask is not None:  # Ada-KV's padded heads: hide the padding per head
            bound = signature.bind(*args, **kwargs)
            bound.arguments["mask"] = merge_head_mask(call.get("mask"), head_mask, call["queries"])
            out = original(*bound.args, **bound.kwargs)
        else:
            out = original(*args, **kwargs)
        if getattr(cache, "awaiting", False) and hasattr(cache, "observe"):
            cache.observe(call["queries"], call.get("scale"))
        return out

    scaled_dot_product_attention.__wrapped__ = original
    return scaled_dot_product_attention


@contextmanager
def capture(model) -> Iterator[None]:
    """Inside the block, ``model``'s attention layers hand their queries to importance caches
    (a no-op for every other cache). Re-entrant; the original function is restored after."""
    model = getattr(model, "model", model) if hasattr(model, "info") else model
    names = _model_modules(model)
    for name in names:
        module = sys.modules[name]
        if name in _patched:
            original, depth = _patched[name]
            _patched[name] = (original, depth + 1)
        else:
            original = getattr(module, NAME)
            _patched[name] = (original, 1)
            setattr(module, NAME, _wrap(original))
    try:
        yield
    finally:
        for name in names:
            original, depth = _patched[name]
            if depth == 1:
                setattr(sys.modules[name], NAME, original)
                del _patched[name]
            else:
                _patched[name] = (original, depth - 1)
