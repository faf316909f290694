"""The rules of the importance caches (knorm, TOVA, H2O, SnapKV, PyramidKV): what their
evictions allocate."""

from __future__ import annotations

from .base import UNBOUNDED, Rule


class BudgetEachStep(Rule):
    """The importance caches that evict every step (``knorm``, ``tova``, ``h2o``; both backends,
    :mod:`cachelib.core.importance`): an update of ``n`` tokens first gathers the kept ``budget
    - 1`` tokens (one-token updates) or ``budget`` (longer ones) into new arrays while the old
    ones live, then concatenates the ``n`` new ones (old + new)."""

    kind = "BudgetEachStep"
    bounded = True

    def __init__(self, token_bytes: int, budget: int, kind: str | None = None):
        super().__init__(token_bytes, kind)
        self.budget = budget
        self.held = 0

    @property
    def capacity(self) -> int:
        return self.held

    @property
    def tokens_held(self) -> int:
        return self.held

    def update(self, n: int) -> int:
        tb = self.token_bytes
        keep = self.budget - 1 if n == 1 else self.budget
        peak = self.held * tb
        if self.held > keep:
            peak = (self.held + keep) * tb
            self.held = keep
        peak = max(peak, (2 * self.held + n) * tb if self.held else n * tb)
        self.held += n
        self.offset += n
        return peak

    def regular_steps(self) -> int:
        if self.held == self.budget:
            return UNBOUNDED
        return max(0, self.budget - self.held) if self.held < self.budget else 0

    def skip(self, k: int) -> None:
        if self.held < self.budget:
            self.held += k
        self.offset += k

    def settled(self) -> bool:
        return self.held == self.budget

    def cycle_key(self, n: int):
        return (self.held,)


class BudgetOnce(Rule):
    """The importance caches that compress once (``snapkv``; ``pyramidkv`` with each layer's own
    budget): updates concatenate (old + new); the first one-token update first gathers
    ``budget`` of the held tokens into new arrays when more are held, and from then on nothing
    is evicted."""

    kind = "BudgetOnce"

    def __init__(self, token_bytes: int, budget: int, kind: str | None = None):
        super().__init__(token_bytes, kind)
        self.budget = budget
        self.held = 0
        self.done = False

    @property
    def capacity(self) -> int:
        return self.held

    @property
    def tokens_held(self) -> int:
        return self.held

    def update(self, n: int) -> int:
        tb = self.token_bytes
        peak = self.held * tb
        if not self.done and n == 1:
            self.done = True
            if self.held > self.budget:
                peak = (self.held + self.budget) * tb
                self.held = self.budget
        peak = max(peak, (2 * self.held + n) * tb if self.held else n * tb)
        self.held += n
        self.offset += n
        return peak

    def regular_steps(self) -> int:
        return UNBOUNDED if self.done else 0

    def skip(self, k: int) -> None:
        self.held += k
        self.offset += k

    def cycle_key(self, n: int):
        if not self.done and n == 1:
            return None  # the compression is ahead
        return (self.done,)


class BudgetOnceHeads(BudgetOnce):
    """SnapKV with Ada-KV's per-head budgets (``snapkv:adaptive=1``): as :class:`BudgetOnce`,
    but at the compression the layer's ``kv_heads`` heads share ``budget x kv_heads`` slots
    unevenly, each at least ``safe``, stored padded to the largest head's count. The tokens held
    (the used bytes) are exact; the padded slots depend on the scores, so the allocation is
    planned at its bound, ``min(held, budget x kv_heads - (kv_heads - 1) x safe)`` (one head
    taking every slot the others need not keep): measured bytes are at most these."""

    kind = "BudgetOnceHeads"

    def __init__(self, token_bytes: int, budget: int, kv_heads: int, safe: int, kind: str | None = None):
        super().__init__(token_bytes, budget, kind=kind)
        self.kv_heads = kv_heads
        self.safe = safe
        self.slots = 0

    @property
    def capacity(self) -> int:
        return self.slots

    def update(self, n: int) -> int:
        tb = self.token_bytes
        peak = self.slots * tb
        if not self.done and n == 1:
            self.done = True
            if self.held > self.budget:
                padded = min(self.held, self.budget * self.kv_heads - (self.kv_heads - 1) * self.safe)
                peak = (self.slots + padded) * tb
                self.held, self.slots = self.budget, padded
        peak = max(peak, (2 * self.slots + n) * tb if self.slots else n * tb)
        self.held += n
        self.slots += n
        self.offset += n
        return peak

    def skip(self, k: int) -> None:
        self.held += k
        self.slots += k
        self.offset += k
