"""Importance-based eviction on MLX: the key scores (:func:`score_keys`) and the layer cache that
keeps a fixed budget of the best-scored tokens (:class:`ImportanceKVCache`), for ``knorm``,
``snapkv``, ``pyramidkv`` (SnapKV's scores, a budget per layer), ``tova`` and ``h2o``.

The scores are the PyTorch module's formulas (:mod:`cachelib.torch.importance` documents
exactly what each computes), written on MLX arrays; when a layer evicts and which slots it keeps
is decided by the rules of :mod:`cachelib.core.importance`, shared with PyTorch, so both backends
keep the same positions on the same inputs (here on MLX arrays, :func:`select_slots`, with no
host round trip per layer). Methods that score with attention get each step's queries
from the attention-capture hook (:mod:`cachelib.mlx.hooks`); without it they refuse to evict.
"""

from __future__ import annotations

import functools
import time

import mlx.core as mx
import numpy as np

from ..core.importance import Policy, compresses_now, evict_to, keep_slots, policy_of, tokens_used
from ..introspect import CacheView
from ..spec import STRATEGIES
from . import hooks
from .base import LayerCache, array_bytes, attention_mask, check_trim, dtype_name


def attention_weights(keys: mx.array, queries: mx.array, scale: float | None = None) -> mx.array:
    """Causal softmax weights of ``queries`` (B, H_q, Tq, D) on ``keys`` (B, H_kv, T, D), the
    queries being the last ``Tq`` positions: (B, H_q, Tq, T) float32."""
    B, h_kv, T, D = keys.shape
    h_q, tq = queries.shape[1], queries.shape[2]
    if h_q % h_kv:
        raise ValueError(f"attention_weights: {h_q} query heads are not a multiple of {h_kv} key heads")
    if tq > T:
        raise ValueError(f"attention_weights: {tq} queries but only {T} keys (queries are the last keys' positions)")
    scale = D**-0.5 if scale is None else float(scale)
    k = mx.repeat(keys.astype(mx.float32), h_q // h_kv, axis=1)  # (B, H_q, T, D)
    logits = (queries.astype(mx.float32) @ k.transpose(0, 1, 3, 2)) * scale  # (B, H_q, Tq, T)
    q_pos = mx.arange(T - tq, T)[:, None]
    hidden = mx.arange(T)[None, :] > q_pos
    logits = mx.where(hidden, mx.array(-mx.inf, mx.float32), logits)
    return mx.softmax(logits, axis=-1, precise=True)


def _last_query_weights(keys: mx.array, queries: mx.array, scale: float | None = None) -> mx.array:
    """:func:`attention_weights` of the last query only (it sees every key, so no mask), computed as
    MLX's attention computes them on the CPU (:func:`cachelib.mlx.hooks.last_query_weights`, the
    weights the hook hands over): (B, H_q, T) float32, query head h reading KV head h // (H_q / H_kv)."""
    B, h_kv, T, D = keys.shape
    h_q = queries.shape[1]
    scale = D**-0.5 if scale is None else float(scale)
    q = queries[:, :, -1:].astype(mx.float32)
    return hooks.last_query_weights(q, keys.astype(mx.float32), scale).reshape(B, h_q, T)


def _pool(scores: mx.array, kernel: int, pooling: str) -> mx.array:
    if kernel == 1:
        return scores
    pad = kernel // 2
    T = scores.shape[-1]
    fill = 0.0 if pooling == "avg" else -float("inf")
    widths = [(0, 0)] * (scores.ndim - 1) + [(pad, pad)]
    padded = mx.pad(scores, widths, constant_values=fill)
    windows = mx.stack([padded[..., i : i + T] for i in range(kernel)], axis=0)
    return windows.sum(0) / kernel if pooling == "avg" else windows.max(0)


def _group_mean(scores: mx.array, h_kv: int) -> mx.array:
    B, h_q, T = scores.shape
    return scores.reshape(B, h_kv, h_q // h_kv, T).mean(2)


def _pad_max(s: mx.array, n: int) -> mx.array:
    top = mx.full((*s.shape[:-1], n), s.max(), dtype=mx.float32)
    return mx.concatenate([s, top], axis=-1)


class Scorer:
    """How one importance method scores keys on MLX: one subclass per method, named by the method's
    entry of the strategy table (``Strategy.importance.mlx``). Stateless: the layer cache holds the
    scores. The formulas are the PyTorch scorers' (:mod:`cachelib.torch.importance`)."""

    deferred = False  # scored by the next update (inside a decode step's compiled call), not at observe
    # whether a decode step's scores follow from its attention's softmax weights alone (``from_weights``):
    # the capture hook then hands over the weights the model's attention computed
    from_attention = False
    # whether ``observed_at`` scores keys held in any slot order (a decode step then writes the new
    # token into the evicted slot); a scorer that reads slot order (a causal mask, "the last key") leaves it False
    any_order = False

    @staticmethod
    def score(keys: mx.array, queries: mx.array | None, *, window: int, kernel: int, pooling: str, scale) -> mx.array:
        """Scores of ``keys`` (B, H_kv, T, D) by the step's ``queries`` (B, H_q, Tq, D): (B, H_kv, T) float32."""
        raise NotImplementedError

    @classmethod
    def observed(cls, policy: Policy, scores: mx.array, keys: mx.array, queries: mx.array, scale) -> mx.array | None:
        """The held keys' scores after a step's queries (None: unchanged)."""
        return cls.score(keys, queries, window=policy.window, kernel=policy.kernel, pooling=policy.pooling, scale=scale)

    @classmethod
    def observed_at(cls, policy: Policy, scores, keys, queries, scale, newest: mx.array) -> mx.array | None:
        """``observed`` of keys in any slot order (``any_order`` scorers): ``newest`` (B, H_kv, T) bool
        marks the slot of the newest held key, the step's queries (Tq = 1 unless slots are in position order)."""
        return cls.observed(policy, scores, keys, queries, scale)

    @classmethod
    def from_weights(cls, policy: Policy, scores, weights: mx.array, newest: mx.array) -> mx.array:
        """``observed_at`` of a decode step from its one query's softmax weights on the held keys
        (B, H_kv, H_q / H_kv, 1, T), as :func:`cachelib.mlx.hooks.last_query_weights` gives them."""
        raise NotImplementedError


class KNorm(Scorer):
    """Keeps the keys of lowest L2 norm; scores new keys as they come (no queries)."""

    any_order = True

    @staticmethod
    def score(keys, queries, *, window=0, kernel=5, pooling="avg", scale=None):
        k = keys.astype(mx.float32)
        return -mx.sqrt((k * k).sum(-1))


class SnapKV(Scorer):
    """The observation window's pooled attention (SnapKV; PyramidKV scores alike)."""

    @staticmethod
    def score(keys, queries, *, window=64, kernel=5, pooling="avg", scale=None):
        T = keys.shape[2]
        w = min(window, queries.shape[2])
        if w < 1 or T <= w:
            raise ValueError(f"score_keys: snapkv needs more keys ({T}) than the observation window ({w})")
        weights = attention_weights(keys, queries[..., -w:, :], scale)[..., : T - w]
        s = _group_mean(_pool(weights.mean(2), kernel, pooling), keys.shape[1])
        return _pad_max(s, w)

    @classmethod
    def observed(cls, policy, scores, keys, queries, scale):
        if keys.shape[2] <= min(policy.window, queries.shape[2]):  # nothing before the window to score
            return None
        return super().observed(policy, scores, keys, queries, scale)


class TOVA(Scorer):
    """The last query's attention, averaged over all query heads (TOVA)."""

    deferred = True
    any_order = True
    from_attention = True

    @staticmethod
    def score(keys, queries, *, window=0, kernel=5, pooling="avg", scale=None):
        B, h_kv, T, _ = keys.shape
        if T < 2:
            return mx.zeros((B, h_kv, T), dtype=mx.float32)
        w = attention_weights(keys, queries[..., -1:, :], scale)[..., 0, :-1]  # (B, H_q, T - 1)
        s = mx.broadcast_to(w.mean(1, keepdims=True), (B, h_kv, T - 1))
        return _pad_max(s, 1)

    @classmethod
    def observed_at(cls, policy, scores, keys, queries, scale, newest):
        # score's formula with the newest key in any slot: the last query sees every key, so no mask
        B, h_kv, T, _ = keys.shape
        if T < 2:
            return mx.zeros((B, h_kv, T), dtype=mx.float32)
        return cls._mean_heads(_last_query_weights(keys, queries, scale), h_kv, newest)

    @classmethod
    def from_weights(cls, policy, scores, weights, newest):
        B, h_kv, T = newest.shape
        if T < 2:
            return mx.zeros((B, h_kv, T), dtype=mx.float32)
        return cls._mean_heads(weights.reshape(B, -1, T), h_kv, newest)

    @staticmethod
    def _mean_heads(w: mx.array, h_kv: int, newest: mx.array) -> mx.array:
        """The mean of ``w`` (B, H_q, T) over the query heads for every KV head, the newest key's
        slot given the others' best."""
        B, _, T = w.shape
        s = mx.broadcast_to(w.mean(1, keepdims=True), (B, h_kv, T))
        top = mx.where(newest, mx.array(-mx.inf, mx.float32), s).max()
        return mx.where(newest, top, s)


class H2O(Scorer):
    """Every query's attention, accumulated over the steps (H2O's heavy hitters)."""

    deferred = True
    any_order = True  # with one query (a decode step) the causal mask hides nothing
    from_attention = True

    @staticmethod
    def score(keys, queries, *, window=0, kernel=5, pooling="avg", scale=None):
        return _group_mean(attention_weights(keys, queries, scale).sum(2), keys.shape[1])

    @classmethod
    def observed(cls, policy, scores, keys, queries, scale):
        return mx.nan_to_num(scores, nan=0.0) + cls.score(keys, queries, scale=scale)

    @classmethod
    def observed_at(cls, policy, scores, keys, queries, scale, newest):
        if queries.shape[2] > 1:  # slots are in position order then
            return cls.observed(policy, scores, keys, queries, scale)
        return mx.nan_to_num(scores, nan=0.0) + _group_mean(_last_query_weights(keys, queries, scale), keys.shape[1])

    @classmethod
    def from_weights(cls, policy, scores, weights, newest):
        B, h_kv, T = newest.shape
        return mx.nan_to_num(scores, nan=0.0) + _group_mean(weights.reshape(B, -1, T), h_kv)


def score_keys(
    method: str,
    keys: mx.array,
    queries: mx.array | None,
    *,
    window: int = 64,
    kernel: int = 5,
    pooling: str = "avg",
    scale: float | None = None,
) -> mx.array:
    """Per-(batch, KV head, position) scores of ``keys`` (B, H_kv, T, D), higher = keep, by the
    scorer of importance strategy ``method``: the same formulas as
    :func:`cachelib.torch.importance.score_keys`. float32 (B, H_kv, T)."""
    methods = [name for name, s in STRATEGIES.items() if s.importance is not None and s.importance.mlx]
    if method not in methods:
        raise ValueError(f"score_keys: unknown method {method!r}; choose one of: {', '.join(methods)}")
    if keys.ndim != 4:
        raise ValueError(f"score_keys: keys must be (B, H_kv, T, D), got shape {tuple(keys.shape)}")
    entry = STRATEGIES[method]
    if entry.importance.needs_queries:
        if queries is None or queries.ndim != 4:
            raise ValueError(f"score_keys: {method} needs queries (B, H_q, Tq, D)")
        if pooling not in ("avg", "max"):
            raise ValueError(f"score_keys: pooling must be 'avg' or 'max', got {pooling!r}")
        if kernel < 1 or kernel % 2 == 0:
            raise ValueError(f"score_keys: kernel must be an odd integer >= 1, got {kernel}")
    return entry.scorer("mlx").score(keys, queries, window=window, kernel=kernel, pooling=pooling, scale=scale)


def _gather(x: mx.array, slots: mx.array) -> mx.array:
    """``x`` (B, H, T, D) at ``slots`` (B, H, M) int32: (B, H, M, D)."""
    B, H, M = slots.shape
    return mx.take_along_axis(x, mx.broadcast_to(slots[..., None], (B, H, M, x.shape[-1])), axis=2)


def _i64(value: int) -> mx.array:
    return mx.array(value, dtype=mx.int64)


def comparable_key(scores: mx.array) -> mx.array:
    """int64 keys that order float32 ``scores`` (no NaN) exactly as
    :func:`cachelib.core.importance.comparable` orders them: each score in float64 (where no
    float32 is subnormal) rounded to its 12 significant bits, half to even (41 of float64's 53
    dropped), as a signed integer; equal roundings give equal keys, and +0 and -0 one key."""
    bits = scores.astype(mx.float64).view(mx.int64)
    mag = bits & _i64(0x7FFF_FFFF_FFFF_FFFF)
    rounded = (mag + _i64((1 << 40) - 1) + ((mag >> 41) & 1)) >> 41  # a carry moves into the exponent, as frexp's does
    return mx.where(bits < 0, -rounded, rounded)


def _best_first(scores: mx.array) -> mx.array:
    """One distinct int64 per slot of ``scores`` (B, H, T), ascending in the order
    :func:`cachelib.core.importance.select` ranks slots: best score first, then the older slot."""
    T = scores.shape[-1]
    return -comparable_key(scores) * T + mx.arange(T, dtype=mx.int64)


def select_slots(scores: mx.array, keep: int, protect: int) -> mx.array:
    """The slots :func:`cachelib.core.importance.select` keeps, chosen on the device: per (batch,
    head), the newest ``protect`` slots and the ``keep - protect`` best-scored others (ties: the
    older slot), ascending. ``scores`` (B, H, T) float32 without NaN; returns (B, H, keep) int32."""
    B, H, T = scores.shape
    if not 0 <= keep <= T:
        raise ValueError(f"select_slots: cannot keep {keep} of {T} slots")
    protect = min(protect, keep)
    free, best = T - protect, keep - protect
    newest = mx.broadcast_to(mx.arange(free, T, dtype=mx.int32), (B, H, protect))
    if best == 0:
        return newest
    chosen = mx.argpartition(_best_first(scores[..., :free]), kth=best - 1, axis=-1)[..., :best].astype(mx.int32)
    return mx.sort(mx.concatenate([chosen, newest], axis=-1), axis=-1)


def _drop_slot(x: mx.array, slot: mx.array) -> mx.array:
    """``x`` (B, H, T, ...) without slot ``slot`` (B, H) of each (batch, head): (B, H, T - 1, ...)."""
    j = mx.arange(x.shape[2] - 1).reshape(-1, *([1] * (x.ndim - 3)))
    return mx.where(j < slot.reshape(*slot.shape, *([1] * (x.ndim - 2))), x[:, :, :-1], x[:, :, 1:])


@functools.cache
def _observe(scorer: type[Scorer], policy: Policy, scale: float | None):
    """The scorer's ``observed``, compiled (one call per layer)."""
    return mx.compile(functools.partial(scorer.observed, policy, scale=scale))


@functools.cache
def _weigh(scorer: type[Scorer], policy: Policy):
    """The scorer's ``from_weights``, compiled (one call per layer)."""
    return mx.compile(functools.partial(scorer.from_weights, policy))


def _new_scores(scorer: type[Scorer], policy: Policy, keys: mx.array) -> mx.array:
    """Scores of appended keys: the scorer's own for a method without queries, else NaN (unscored)."""
    if not policy.needs_queries:
        return scorer.score(keys, None, window=policy.window, kernel=policy.kernel, pooling=policy.pooling, scale=None)
    B, H, n, _ = keys.shape
    return mx.full((B, H, n), mx.nan, dtype=mx.float32)


@functools.cache
def _decode_update(scorer: type[Scorer], policy: Policy, score_first: bool, protect: int, scale: float | None = None):
    """A decode step's update of a layer that evicts one slot per (batch, head) and appends the
    step's tokens, compiled into one call: with ``score_first`` the held keys are first scored
    with the last step's queries (deferred from ``observe``), then the free slot
    :func:`select_slots` would drop (the last in best-first order) leaves each array in one fused
    pass, and the new tokens are appended (scored when the method needs no queries)."""

    def update(keys, values, positions, scores, new_keys, new_values, offset):
        worst = mx.argmax(_best_first(scores[..., : scores.shape[-1] - protect]), axis=-1)  # (B, H)
        keys, values, positions, scores = (_drop_slot(x, worst) for x in (keys, values, positions, scores))
        B, H, n, _ = new_keys.shape
        new_pos = mx.broadcast_to(offset + mx.arange(n, dtype=mx.int64), (B, H, n))
        new_scores = _new_scores(scorer, policy, new_keys)
        return (
            mx.concatenate([keys, new_keys], axis=2),
            mx.concatenate([values, new_values], axis=2),
            mx.concatenate([positions, new_pos], axis=-1),
            mx.concatenate([scores, new_scores], axis=-1),
        )

    def score_and_update(keys, values, positions, scores, new_keys, new_values, offset, queries):
        scores = scorer.observed(policy, scores, keys, queries, scale)
        return update(keys, values, positions, scores, new_keys, new_values, offset)

    return mx.compile(score_and_update if score_first else update)


_TIE = 1 << 32  # a score's int64 key times this plus a position (< 2**32) orders by score, then position


@functools.cache
def _ring_update(
    scorer: type[Scorer], policy: Policy, score_first: str | None, protect: int, scale: float | None = None
):
    """A decode step's one-token update of a full layer (an ``any_order`` scorer), one compiled
    call: with ``score_first`` the held keys are first scored by the last step's ``"queries"`` or
    by the softmax ``"weights"`` its attention computed (``Scorer.from_weights``); the
    free slot :func:`select_slots` would drop (the worst score, ties: the newest position; the
    newest ``protect`` positions are never free) then takes the new token in every array, so no
    held key moves (slots leave position order; ``positions`` says which token each holds)."""

    def update(keys, values, positions, scores, new_keys, new_values, offset):
        rank = -comparable_key(scores) * _i64(_TIE) + positions  # ascending: best first, then older
        rank = mx.where(positions >= offset - protect, _i64(-(1 << 62)), rank)  # protected: never the worst
        worst = mx.argmax(rank, axis=-1, keepdims=True)  # (B, H, 1): the evicted slot
        B, H, _, D = keys.shape
        at = mx.broadcast_to(worst[..., None], (B, H, 1, D))
        # a scatter of one slot: in place when the caller no longer holds the arrays (MLX donates them)
        return (
            mx.put_along_axis(keys, at, new_keys, axis=2),
            mx.put_along_axis(values, at, new_values, axis=2),
            mx.put_along_axis(positions, worst, mx.broadcast_to(offset, (B, H, 1)), axis=-1),
            mx.put_along_axis(scores, worst, _new_scores(scorer, policy, new_keys), axis=-1),
        )

    def score_and_update(keys, values, positions, scores, new_keys, new_values, offset, queries):
        scored = scorer.observed_at(policy, scores, keys, queries, scale, positions == offset - 1)
        return update(keys, values, positions, scores if scored is None else scored, new_keys, new_values, offset)

    def weigh_and_update(keys, values, positions, scores, new_keys, new_values, offset, weights):
        scored = scorer.from_weights(policy, scores, weights, positions == offset - 1)
        return update(keys, values, positions, scored, new_keys, new_values, offset)

    steps = {None: update, "queries": score_and_update, "weights": weigh_and_update}
    return mx.compile(steps[score_first])


class ImportanceKVCache(LayerCache):
    """A full-attention layer cache holding at most a budget of tokens chosen by score (see
    :mod:`cachelib.core.importance` for when it evicts). Slots stay in position order; each KV
    head keeps its own positions. Arrays are (B, H, T, D), grown by concatenation.

    Scores, positions and the kept slots stay MLX arrays (:func:`select_slots` chooses on the
    device), computed lazily inside the step's own evaluation: the keys a step returns depend on
    them (``mx.depends``), so a step evaluates once and nothing comes to the host per layer.

    With Ada-KV's per-head budgets (``snapkv:adaptive=1``) the heads keep different counts: each
    head's kept slots come first, then zeroed padding up to the largest count (position -1),
    then the appended tokens; :attr:`head_mask` hides the padding, and the capture hook merges
    it into the attention mask (so such a layer runs only inside ``hooks.capture``). That
    selection, made once per run, is numpy's (:func:`cachelib.core.importance.select_heads`)."""

    _STATE = ("keys", "values")

    def __init__(self, policy: Policy):
        self.policy = policy
        self.scorer: type[Scorer] = STRATEGIES[policy.name].scorer("mlx")
        self.keys = None
        self.values = None
        self.offset = 0
        self.positions: mx.array | None = None  # (B, H_kv, held) int64 absolute positions, -1: padding
        self.scores: mx.array | None = None  # (B, H_kv, held) float32, NaN where unscored
        self.compressed = False
        self.awaiting = False
        self.unscored = False  # whether some held slot has no score yet (NaN), known without reading scores
        self.score_seconds = 0.0  # host time spent queuing the scoring this step (it runs in the step's evaluation)
        self.head_mask: mx.array | None = None  # (B, H_kv, held) bool, False on padding; None: none
        self._padded = False
        self._shuffled = False  # whether slots may be out of position order (after a ring write)
        # what the last step's attention left to score the held keys with: ("queries", queries, scale),
        # or ("weights", its softmax weights, None) when the capture hook handed those over
        self._pending: tuple[str, mx.array, float | None] | None = None

    @property
    def held(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.score_seconds = 0.0
        B, H, n, _ = keys.shape
        keep = evict_to(self.policy, self.held, n, self.compressed)
        if keep is not None and self.held - keep == 1 and not self.policy.compress_once:  # a decode step: one call
            self._check_scored()
            start = time.perf_counter()
            ring = n == 1 and self.scorer.any_order
            if not ring and self._pending and self._pending[0] == "weights":  # weights are by the slots as held
                self._settle()
            pending, self._pending = self._pending, None
            if not ring or (
                pending and pending[0] == "queries" and pending[1].shape[2] > 1
            ):  # a causal mask by slot order
                self._in_order()
            protect = self.policy.protected(keep)
            make = _ring_update if ring else _decode_update
            update = make(self.scorer, self.policy, pending and pending[0], protect, pending and pending[2])
            args = [self.keys, self.values, self.positions, self.scores, keys, values, mx.array(self.offset, mx.int64)]
            if ring:  # the held arrays are the call's alone now, so its one-slot writes can be in place
                self.keys = self.values = self.positions = self.scores = None
            try:
                arrays = update(*args, *(pending[1:2] if pending else ()))
            except Exception:  # bad input: the cache keeps what it held
                self.keys, self.values, self.positions, self.scores = args[:4]
                raise
            self._shuffled = self._shuffled or ring
            self.score_seconds += time.perf_counter() - start
            return self._appended(n, *arrays)
        self._settle()
        self._in_order()
        if keep is not None:
            self._evict(keep)
        if self.padded and not hooks.capturing():
            raise ValueError(
                f"{self.policy.name}: its KV heads hold different counts (adaptive=1), and only the "
                "attention-capture hook masks the padding: run the model inside cachelib.mlx.hooks.capture(model)"
            )
        if compresses_now(self.policy, n, self.compressed):
            self.compressed = True
        new_pos = mx.broadcast_to(mx.arange(self.offset, self.offset + n, dtype=mx.int64), (B, H, n))
        start = time.perf_counter()
        new_scores = _new_scores(self.scorer, self.policy, keys)
        if not self.policy.needs_queries:
            self.score_seconds += time.perf_counter() - start
        if self.held == 0:
            return self._appended(n, keys, values, new_pos, new_scores)
        pairs = ((self.keys, keys), (self.values, values), (self.positions, new_pos), (self.scores, new_scores))
        return self._appended(n, *(mx.concatenate([a, b], axis=2 if a.ndim == 4 else -1) for a, b in pairs))

    def _appended(self, n: int, keys: mx.array, values: mx.array, positions: mx.array, scores: mx.array):
        """Holds the arrays of this update, which appended ``n`` tokens; returns its keys and values."""
        self.positions, self.scores = positions, scores
        self.unscored = self.unscored or self.policy.needs_queries
        self.offset += n
        self.awaiting = self.policy.needs_queries and not (self.policy.compress_once and self.compressed)
        self.head_mask = self.positions >= 0 if self.padded else None
        # the bookkeeping is computed by the evaluation that computes the attention (no graph left growing)
        self.keys, self.values = mx.depends([keys, values], [positions, scores])
        return self.keys, self.values

    @property
    def padded(self) -> bool:
        """Whether some slots are padding (Ada-KV's heads keep different counts)."""
        return self._padded

    def observe(self, queries: mx.array, scale: float | None) -> None:
        """Score the held keys with this step's queries (called by the attention-capture hook
        right after this layer's attention); the scores stay lazy until the next eviction."""
        if not self.awaiting:
            return
        self.awaiting = False
        start = time.perf_counter()
        if self.scorer.deferred:  # scored by the next update, in its compiled call (or by _settle)
            self._pending, self.unscored = ("queries", queries, scale), False
        else:
            s = self.scorer.observed(self.policy, self.scores, self.keys, queries, scale)
            if s is not None:
                self.scores, self.unscored = s, False
        self.score_seconds += time.perf_counter() - start

    @property
    def takes_weights(self) -> bool:
        """Whether the capture hook may hand this step's attention weights to :meth:`observe_weights`
        instead of its queries to :meth:`observe` (a method that scores from them, waiting for a step)."""
        return self.awaiting and self.scorer.from_attention and not self._padded

    def observe_weights(self, weights: mx.array) -> None:
        """Score the held keys, at the next update, with the softmax weights (B, H_kv, H_q / H_kv, 1, T)
        of this step's one query on them, in slot order, as :func:`cachelib.mlx.hooks.last_query_weights`
        computes them: the attention-capture hook hands over those the model's attention computed."""
        if not self.awaiting:
            return
        self.awaiting = False
        self._pending, self.unscored = ("weights", weights, None), False

    def _settle(self) -> None:
        """Scores the held keys with what the last step left pending, outside a decode step's call."""
        if self._pending is None:
            return
        source, x, scale = self._pending
        self._pending = None
        if source == "weights":  # any slot order: the weights are by the slots as held now
            newest = self.positions == self.offset - 1
            self.scores = _weigh(self.scorer, self.policy)(self.scores, x, newest)
        else:
            self._in_order()
            self.scores = _observe(self.scorer, self.policy, scale)(self.scores, self.keys, x)

    def by_position(self) -> tuple[mx.array, mx.array, mx.array, mx.array] | None:
        """The held keys, values (B, H, T, D), positions and scores (B, H, T), each (batch, head)'s
        slots sorted by position (the order a cache that never writes in place would hold); None when empty."""
        if self.keys is None:
            return None
        if not self._shuffled:
            return self.keys, self.values, self.positions, self.scores
        order = mx.argsort(self.positions, axis=-1).astype(mx.int32)
        pick = functools.partial(mx.take_along_axis, indices=order, axis=-1)
        return _gather(self.keys, order), _gather(self.values, order), pick(self.positions), pick(self.scores)

    def _in_order(self) -> None:
        """Sorts the slots back into position order (before an update whose rules read slot order)."""
        if self._shuffled:
            self.keys, self.values, self.positions, self.scores = self.by_position()
            self._shuffled = False

    def _check_scored(self) -> None:
        if self.policy.needs_queries and self.unscored:
            raise ValueError(
                f"{self.policy.name}: the held keys were never scored; this method needs the step's "
                "queries: run the model inside cachelib.mlx.hooks.capture(model)"
            )

    def _evict(self, keep: int) -> None:
        start = time.perf_counter()
        self._check_scored()
        if self.policy.adaptive:
            self._evict_heads(keep)
        else:
            slots = select_slots(self.scores, keep, self.policy.protected(keep))  # (B, H, keep) int32
            self.keys, self.values = _gather(self.keys, slots), _gather(self.values, slots)
            self.positions = mx.take_along_axis(self.positions, slots, axis=-1)
            self.scores = mx.take_along_axis(self.scores, slots, axis=-1)
        self.score_seconds += time.perf_counter() - start

    def _evict_heads(self, keep: int) -> None:
        """Ada-KV's uneven heads, chosen on the host (once per run: it compresses once)."""
        scores, positions = np.array(self.scores), np.array(self.positions)
        slots = keep_slots(self.policy, scores, keep)  # (B, H, M), -1: padding
        pad = slots < 0
        taken = np.maximum(slots, 0)
        idx = mx.array(taken.astype(np.int32))
        self.keys, self.values = _gather(self.keys, idx), _gather(self.values, idx)
        if pad.any():  # padding holds zeros, never a stale token
            real = mx.array(~pad)[..., None]
            self.keys = mx.where(real, self.keys, mx.zeros((), self.keys.dtype))
            self.values = mx.where(real, self.values, mx.zeros((), self.values.dtype))
        self.positions = mx.array(np.where(pad, -1, np.take_along_axis(positions, taken, axis=-1)))
        self.scores = mx.array(np.where(pad, -np.inf, np.take_along_axis(scores, taken, axis=-1)).astype(np.float32))
        self._padded = self._padded or bool(pad.any())

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        # keys come back as the tokens kept after this step's eviction, then the N new ones
        keep = evict_to(self.policy, self.held, N, self.compressed)
        return attention_mask(N, self.held if keep is None else keep, window_size, return_array)

    def size(self) -> int:
        return self.held

    def empty(self) -> bool:
        return self.keys is None

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        check_trim(n, type(self).__name__)
        return 0

    @property
    def state(self):
        return self.keys, self.values

    @state.setter
    def state(self, v):
        raise ValueError(
            f"{type(self).__name__}: restoring from a state is not supported (positions and scores are not part of it)"
        )

    @property
    def meta_state(self):
        return tuple(map(str, (self.offset, self.policy.budget)))

    @property
    def nbytes(self) -> int:
        return array_bytes(self.keys, self.values)

    def introspect(self) -> CacheView:
        held = self.held
        total = self.nbytes
        positions = None if self.positions is None else np.array(self.positions)  # the one host copy, when read
        if positions is not None and self._shuffled:
            positions = np.sort(positions, axis=-1)
        used = tokens_used(positions)  # == held unless Ada-KV pads some heads
        return CacheView(
            kind=self.policy.name,
            layout="selected",
            offset=self.offset,
            tokens_held=used,
            capacity=held,
            max_capacity=None if self.policy.compress_once else self.policy.budget,
            bytes_used=total * used // held if held else 0,
            bytes_allocated=total,
            write_index=held,
            batch_size=1 if self.keys is None else self.keys.shape[0],
            dtype=dtype_name(self.keys),
            head_positions=None if positions is None else positions[0].copy(),
            score_seconds=self.score_seconds,
        )


def build_importance(spec, layer: int = 0, layers: int = 1) -> ImportanceKVCache:
    """The MLX cache of full-attention layer ``layer`` of ``layers`` (its index among the
    model's full-attention layers; only ``pyramidkv``'s budget depends on it) for an importance
    spec."""
    return ImportanceKVCache(policy_of(spec, layer, layers))
