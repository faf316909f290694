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
as ``score_seconds`` in its view, and the profiler records it.
"""

from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager
from typing import Iterator

import mlx.core as mx

NAME = "scaled_dot_product_attention"
_patched: dict[str, tuple[object, int]] = {}  # module name -> (original function, depth)


def _model_modules(model) -> list[str]:
    names = {type(model).__module__}
    for _, module in model.named_modules():
        names.add(type(module).__module__)
    return sorted(n for n in names if hasattr(sys.modules.get(n), NAME))


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


def _wrap(original):
    signature = inspect.signature(original)

    def scaled_dot_product_attention(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        cache = bound.arguments.get("cache")
        head_mask = getattr(cache, "head_mask", None)
        if head_mask is not None:  # Ada-KV's padded heads: hide the padding per head
            given = bound.arguments.get("mask")
            bound.arguments["mask"] = merge_head_mask(given, head_mask, bound.arguments["queries"])
            out = original(*bound.args, **bound.kwargs)
        else:
            out = original(*args, **kwargs)
        if getattr(cache, "awaiting", False) and hasattr(cache, "observe"):
            cache.observe(bound.arguments["queries"], bound.arguments.get("scale"))
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
