"""The backend-free rules of the importance-based caches (``knorm``, ``snapkv``, ``tova``,
``h2o``): when a layer evicts, down to how many tokens, which of its tokens are protected, and
which slots it keeps given per-slot scores.

Both backends score keys on their own arrays (``cachelib.mlx.importance``,
``cachelib.torch.importance``, one formula each), bring the float32 scores to the host, and
choose the kept slots here, with numpy, so that MLX and PyTorch keep the same positions on the
same scores: scores are compared at 12 significant bits (:func:`comparable`), ties go to the
older slot, and the kept slots stay in position order.

Timing, the same for every method: an update of ``n`` tokens first evicts (when the policy says
so) and then appends the ``n`` new tokens; attention then sees everything held, and the
attention-capture hook (``cachelib.*.hooks``) hands the layer that step's queries, from which it
scores the keys it holds for the next eviction. So:

- evicting every step (``knorm``, ``tova``, ``h2o``): before a one-token update the layer keeps
  ``budget - 1`` tokens, so a decode step attends over exactly ``budget`` tokens (as a ring of
  that size does); before a longer update (a prefill chunk) it keeps ``budget``, so the chunk
  attends over ``budget`` older tokens and itself; a prompt given in one update is attended in
  full and cut at the first decode step;
- compressing once (``snapkv``): at the first one-token update the layer keeps
  ``budget`` of the prompt's tokens, and from then on appends without evicting (as SnapKV does).

This module knows integers and numpy arrays only: nothing of MLX, PyTorch or models.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

METHODS = ("knorm", "snapkv", "tova", "h2o")
NEEDS_QUERIES = ("snapkv", "tova", "h2o")  # methods that score with attention
COMPRESS_ONCE = ("snapkv",)
POOLINGS = ("avg", "max")


@dataclass(frozen=True)
class Policy:
    """What one layer of an importance cache does: its method, its token budget, and the knobs
    of its scores (``window``: SnapKV's observation window, H2O's recent window)."""

    method: str
    budget: int
    window: int = 0
    kernel: int = 5
    pooling: str = "avg"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown importance method {self.method!r}; choose one of: {', '.join(METHODS)}")
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 1:
            raise ValueError(f"{self.method}: budget must be an integer >= 1, got {self.budget!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"{self.method}: pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")

    @property
    def needs_queries(self) -> bool:
        return self.method in NEEDS_QUERIES

    @property
    def compress_once(self) -> bool:
        return self.method in COMPRESS_ONCE

    @property
    def scoring(self) -> str:
        """The scoring rule of the method."""
        return self.method

    def protected(self, keep: int) -> int:
        """How many of the newest held tokens an eviction down to ``keep`` never drops: SnapKV's
        observation window, H2O's recent window, TOVA's newest token."""
        if self.method in ("snapkv", "h2o"):
            return min(self.window, keep)
        if self.method == "tova":
            return min(1, keep)
        return 0


def policy_of(spec) -> Policy:
    """The layer policy of an importance strategy spec (a :class:`cachelib.spec.Spec`)."""
    values = spec.values
    return Policy(
        spec.name,
        values["budget"],
        window=values.get("window") or values.get("recent") or 0,
        kernel=values.get("kernel") or 5,
        pooling="max" if values.get("max_pool") else "avg",
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
