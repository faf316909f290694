"""The backend-free rules of the importance-based caches (``knorm``, ``snapkv``, ``pyramidkv``,
``tova``, ``h2o``): when a layer evicts, down to how many tokens, which of its tokens are
protected, which slots it keeps given per-slot scores, and (``pyramidkv``) each layer's budget.

Both backends score keys on their own arrays (``cachelib.mlx.importance``,
``cachelib.torch.importance``, one formula each); PyTorch brings the float32 scores to the host
and chooses the kept slots here, with numpy, and MLX applies the same rule on the device
(``cachelib.mlx.importance.select_slots``, tested against :func:`select`), so that MLX and PyTorch
keep the same positions on the same scores: scores are compared at 12 significant bits
(:func:`comparable`), ties go to the older slot, and the kept slots stay in position order.

Timing, the same for every method: an update of ``n`` tokens first evicts (when the policy says
so) and then appends the ``n`` new tokens; attention then sees everything held, and the
attention-capture hook (``cachelib.*.hooks``) hands the layer that step's queries, from which it
scores the keys it holds for the next eviction. So:

- evicting every step (``knorm``, ``tova``, ``h2o``): before a one-token update the layer keeps
  ``budget - 1`` tokens, so a decode step attends over exactly ``budget`` tokens (as a ring of
  that size does); before a longer update (a prefill chunk) it keeps ``budget``, so the chunk
  attends over ``budget`` older tokens and itself; a prompt given in one update is attended in
  full and cut at the first decode step;
- compressing once (``snapkv``, ``pyramidkv``): at the first one-token update the layer keeps
  ``budget`` of the prompt's tokens, and from then on appends without evicting (as SnapKV does).
  ``pyramidkv`` scores as ``snapkv`` does; only its budget differs by layer
  (:func:`pyramid_budgets`). With Ada-KV's per-head budgets (``snapkv:adaptive=1``) a layer
  keeps ``budget x heads`` slots shared unevenly by its KV heads (:func:`select_heads`), padded
  per head to the largest count (:func:`keep_slots` marks the padding ``-1``).

This module knows integers and numpy arrays only: nothing of MLX, PyTorch or models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Mapping

import numpy as np

from .units import INDEX_MAX

POOLINGS = ("avg", "max")


@dataclass(frozen=True)
class Method:
    """What an importance strategy is, as its entry of the strategy table gives it
    (``Strategy.importance`` in :mod:`cachelib.spec`); every rule here reads these facts, never a
    strategy's name. ``mlx`` and ``torch`` name each backend's scorer class as ``"module:Class"``
    (imported only when that backend builds a cache)."""

    mlx: str | None  # the MLX scorer (cachelib.mlx.importance.Scorer)
    torch: str | None  # the PyTorch scorer (cachelib.torch.importance.Scorer)
    needs_queries: bool = True  # scores with the step's attention (the capture hook's queries)
    compress_once: bool = False  # evicts once, at the first one-token update; else every step
    window: str | None = None  # the knob of the scorer's window, whose newest tokens are never evicted
    protect_newest: int = 0  # newest tokens never evicted beyond the window's (TOVA: the newest one)
    per_head: bool = False  # offers Ada-KV's per-head budgets (knobs adaptive= and safeguard=)
    # budgets by depth: (knob values, layer, layers) -> the layer's budget; None: every layer keeps `budget`
    layer_budget: Callable[[Mapping[str, Any], int, int], int] | None = None
    # the tokens the layer that keeps least keeps, from the knob values; None: `budget`
    smallest_budget: Callable[[Mapping[str, Any]], int] | None = None

    def scorer_name(self, backend: str) -> str | None:
        return {"mlx": self.mlx, "torch": self.torch}.get(backend)


@dataclass(frozen=True)
class Policy:
    """What one layer of an importance cache does: its method (the strategy's name and its
    facts), its token budget, and the knobs of its scores (``window``: SnapKV's observation
    window, H2O's recent window)."""

    name: str  # the strategy's name (messages, the cache's introspected kind)
    method: Method
    budget: int
    window: int = 0
    kernel: int = 5
    pooling: str = "avg"
    # Ada-KV (methods with per_head only): None keeps `budget` tokens on every KV head; a percent
    # 0..100 keeps `budget x heads` per layer, each head at least `safeguard`% of `budget` (see select_heads)
    safeguard: int | None = None

    def __post_init__(self):
        if not isinstance(self.method, Method):
            raise ValueError(f"{self.name}: method must be the strategy's importance facts (a Method)")
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 1:
            raise ValueError(f"{self.name}: budget must be an integer >= 1, got {self.budget!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"{self.name}: pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if self.safeguard is not None:
            if not self.method.per_head:
                raise ValueError(f"{self.name}: per-head budgets (safeguard) are not an option of this method")
            value = self.safeguard
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 100:
                raise ValueError(f"{self.name}: safeguard must be a percent 0..100, got {value!r}")

    @property
    def adaptive(self) -> bool:
        """Whether the KV heads of a layer share its budget unevenly (Ada-KV)."""
        return self.safeguard is not None

    def safe(self, keep: int) -> int:
        """Ada-KV: the tokens every head keeps by its own scores when a layer keeps ``keep`` per
        head on average (its window included)."""
        return min(keep, max(self.protected(keep), keep * self.safeguard // 100))

    @property
    def needs_queries(self) -> bool:
        return self.method.needs_queries

    @property
    def compress_once(self) -> bool:
        return self.method.compress_once

    def protected(self, keep: int) -> int:
        """How many of the newest held tokens an eviction down to ``keep`` never drops: SnapKV's
        (and PyramidKV's) observation window, H2O's recent window, TOVA's newest token."""
        return min(self.window + self.method.protect_newest, keep)


def pyramid_budgets(budget: int, window: int, beta: int, layers: int) -> tuple[int, ...]:
    """PyramidKV's token budget of each of ``layers`` full-attention layers, bottom (index 0) to
    top: an arithmetic sequence from ``2 * budget - budget / beta`` down to ``budget / beta``,
    whose mean is ``budget`` (the budgets of kvpress 0.5.5's ``PyramidKVPress``, without its
    cap at the prompt length: a layer whose budget exceeds the prompt keeps all of it).

    Made exact integers that sum to ``budget * layers``: each layer gets the floor of its real
    budget, and the layers with the largest fractional parts (ties: the lower layer) one token
    more; the sequence stays non-increasing. Every budget must be >= ``window`` (the observation
    window is always kept): ``budget >= window * beta`` guarantees it for any layer count."""
    for name, value, low in (("budget", budget, 1), ("window", window, 1), ("beta", beta, 1), ("layers", layers, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"pyramidkv: {name} must be an integer >= {low}, got {value!r}")
    if layers == 1:
        real = [Fraction(budget)]
    else:
        top = Fraction(budget, beta)
        bottom = 2 * budget - top
        real = [bottom - (bottom - top) * i / (layers - 1) for i in range(layers)]
    out = [math.floor(r) for r in real]
    short = budget * layers - sum(out)  # 0 <= short < layers: the real budgets sum to budget * layers
    for i in sorted(range(layers), key=lambda i: (out[i] - real[i], i))[:short]:
        out[i] += 1
    if out[-1] < window:
        raise ValueError(
            f"pyramidkv: budget={budget} with beta={beta} gives the top layer {out[-1]} tokens, fewer than "
            f"window={window} (every layer keeps its observation window); allowed budget: "
            f"{window * beta}..{max_budget(beta)}, or a beta of at most {max(1, budget // window)}"
        )
    return tuple(out)


def max_budget(beta: int, limit: int = INDEX_MAX) -> int:
    """The largest PyramidKV ``budget`` whose bottom layer (``2 * budget - budget / beta``)
    stays within ``limit`` tokens."""
    # 2b - b/beta <= limit  <=>  b * (2 beta - 1) <= limit * beta
    return limit * beta // (2 * beta - 1)


def pyramid_layer_budget(values: Mapping[str, Any], layer: int, layers: int) -> int:
    """PyramidKV's budget of full-attention layer ``layer`` of ``layers`` (:func:`pyramid_budgets`)."""
    return pyramid_budgets(values["budget"], values["window"], values["beta"], layers)[layer]


def pyramid_smallest_budget(values: Mapping[str, Any]) -> int:
    """About the tokens PyramidKV's top layer keeps: budget / beta."""
    return max(1, values["budget"] // values["beta"])


def policy_of(spec, layer: int = 0, layers: int = 1) -> Policy:
    """The policy of full-attention layer ``layer`` of ``layers`` (its index among the model's
    full-attention layers and their count) for an importance strategy spec (a
    :class:`cachelib.spec.Spec`); every layer gets the same policy unless the method's budgets
    differ by depth (``layer_budget``)."""
    method = spec.strategy.importance
    if method is None:
        raise ValueError(f"{spec.name} is not an importance strategy (its table entry has no importance facts)")
    values = spec.values
    budget = values["budget"]
    if method.layer_budget is not None:
        if not 0 <= layer < layers:
            raise ValueError(
                f"{spec.name}: layer {layer} is not one of the {layers} full-attention layers (0..{layers - 1})"
            )
        budget = method.layer_budget(values, layer, layers)
    return Policy(
        spec.name,
        method,
        budget,
        window=values[method.window] if method.window else 0,
        kernel=values.get("kernel") or 5,
        pooling="max" if values.get("max_pool") else "avg",
        safeguard=values["safeguard"] if values.get("adaptive") else None,
    )


def evict_to(policy: Policy, held: int, n: int, compressed: bool) -> int | None:
    """How many tokens a layer holding ``held`` keeps before appending ``n`` new ones, or None
    when it evicts nothing now (see the module docstring for the timing)."""
    if policy.compress_once:
        if compressed or n != 1 or held <= policy.budget:
            return None
        return policy.budget
    keep = policy.budget - 1 if n == 1 else policy.budget
    return keep if held > keep else None


def compresses_now(policy: Policy, n: int, compressed: bool) -> bool:
    """Whether this update ends the compress-once phase (the first one-token update)."""
    return policy.compress_once and not compressed and n == 1


SCORE_BITS = 12  # significant bits at which scores are compared


def comparable(scores: np.ndarray) -> np.ndarray:
    """``scores`` rounded to :data:`SCORE_BITS` significant bits (relative step 2.4e-4): the
    float noise between two backends' scores, and exact ties that rounding splits (two equal
    tokens' keys differ only by their RoPE rotation, so their norms tie), then break by age on
    both backends alike instead of by the last bit."""
    mantissa, exponent = np.frexp(np.asarray(scores, dtype=np.float64))
    return np.ldexp(np.round(mantissa * (1 << SCORE_BITS)) / (1 << SCORE_BITS), exponent)


def select(scores: np.ndarray, keep: int, protect: int) -> np.ndarray:
    """The slots to keep: per (batch, head), the newest ``protect`` slots and the ``keep -
    protect`` highest-scoring others, ties to the older slot; sorted ascending.

    ``scores`` is ``(B, H, T)`` (slot order = position order); returns ``(B, H, keep)`` int64.
    """
    scores = comparable(scores)
    B, H, T = scores.shape
    if not 0 <= keep <= T:
        raise ValueError(f"select: cannot keep {keep} of {T} slots")
    if np.isnan(scores).any():
        raise ValueError("select: the scores hold NaN (a slot was never scored)")
    protect = min(protect, keep)
    free = T - protect
    chosen = np.argsort(-scores[..., :free], axis=-1, kind="stable")[..., : keep - protect]
    newest = np.broadcast_to(np.arange(free, T, dtype=np.int64), (B, H, protect))
    return np.sort(np.concatenate([chosen.astype(np.int64), newest], axis=-1), axis=-1)


def select_heads(scores: np.ndarray, keep: int, protect: int, safe: int) -> tuple[np.ndarray, np.ndarray]:
    """Ada-KV's slots: per batch row, ``keep x H`` slots over the row's ``H`` KV heads, each head
    keeping its newest ``protect`` slots and its ``safe - protect`` best-scored others, and the
    rest of the row's slots going to the best-scored (head, slot) pairs left across all heads
    (ties: the older slot, then the lower head).

    ``scores`` is ``(B, H, T)``; returns ``(slots, counts)``: ``slots`` ``(B, H, M)`` int64, each
    head's kept slots ascending and then ``-1`` up to ``M``, the largest count of any head;
    ``counts`` ``(B, H)``, summing to ``keep x H`` on every row."""
    scores = comparable(scores)
    B, H, T = scores.shape
    protect = min(protect, keep)
    if not 0 <= keep <= T or not protect <= safe <= keep:
        raise ValueError(f"select_heads: cannot keep {keep} of {T} slots with {safe} safe and {protect} protected")
    if np.isnan(scores).any():
        raise ValueError("select_heads: the scores hold NaN (a slot was never scored)")
    free = T - protect
    order = np.argsort(-scores[..., :free], axis=-1, kind="stable")  # (B, H, free), best first
    chosen = np.zeros((B, H, T), dtype=bool)
    chosen[..., free:] = True
    rest = keep * H - safe * H  # slots the row's heads compete for
    for b in range(B):
        for h in range(H):
            chosen[b, h, order[b, h, : safe - protect]] = True
        left = order[b, :, safe - protect :]  # (H, free - safe + protect) candidate slots per head
        head = np.broadcast_to(np.arange(H)[:, None], left.shape).ravel()
        slot = left.ravel()
        score = np.take_along_axis(scores[b, :, :free], left, axis=-1).ravel()
        best = np.lexsort((head, slot, -score))[:rest]  # by score, then older slot, then lower head
        chosen[b, head[best], slot[best]] = True
    counts = chosen.sum(-1)
    M = int(counts.max())
    slots = np.full((B, H, M), -1, dtype=np.int64)
    for b in range(B):
        for h in range(H):
            kept = np.flatnonzero(chosen[b, h])
            slots[b, h, : len(kept)] = kept
    return slots, counts


def keep_slots(policy: Policy, scores: np.ndarray, keep: int) -> np.ndarray:
    """The slots an eviction down to ``keep`` (per head, on average) keeps: ``(B, H, M)``
    int64, ascending per head; ``-1`` marks padding, which only Ada-KV's uneven heads have
    (:func:`select_heads`)."""
    if policy.adaptive:
        return select_heads(scores, keep, policy.protected(keep), policy.safe(keep))[0]
    return select(scores, keep, policy.protected(keep))


def tokens_used(positions: np.ndarray | None) -> int:
    """The tokens batch row 0 holds per KV head on average: its non-padding slots over its heads
    (an integer: Ada-KV's heads share ``budget x heads`` slots)."""
    if positions is None:
        return 0
    return int((positions[0] >= 0).sum()) // positions.shape[1]
