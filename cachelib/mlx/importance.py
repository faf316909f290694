"""Importance-based eviction on MLX: the key scores (:func:`score_keys`) and the layer cache that
keeps a fixed budget of the best-scored tokens (:class:`ImportanceKVCache`), for ``knorm``,
``snapkv``, ``pyramidkv`` (SnapKV's scores, a budget per layer), ``tova`` and ``h2o``.

The scores are the PyTorch module's formulas (:mod:`cachelib.torch.importance` documents
exactly what each computes), written on MLX arrays; when a layer evicts and which slots it keeps
is decided in :mod:`cachelib.core.importance`, shared with PyTorch, so both backends keep the
same positions on the same inputs. Methods that score with attention get each step's queries
from the attention-capture hook (:mod:`cachelib.mlx.hooks`); without it they refuse to evict.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from ..core.importance import Policy, compresses_now, evict_to, keep_slots, policy_of, tokens_used
from ..introspect import CacheView
from . import hooks
from .base import LayerCache, array_bytes, attention_mask, check_trim, dtype_name

SCORED = ("knorm", "snapkv", "tova", "h2o")


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
    """Per-(batch, KV head, position) scores of ``keys`` (B, H_kv, T, D), higher = keep: the
    same formulas as :func:`cachelib.torch.importance.score_keys`. float32 (B, H_kv, T)."""
    if method not in SCORED:
        raise ValueError(f"score_keys: unknown method {method!r}; choose one of: {', '.join(SCORED)}")
    if keys.ndim != 4:
        raise ValueError(f"score_keys: keys must be (B, H_kv, T, D), got shape {tuple(keys.shape)}")
    if method == "knorm":
        k = keys.astype(mx.float32)
        return -mx.sqrt((k * k).sum(-1))
    if queries is None or queries.ndim != 4:
        raise ValueError(f"score_keys: {method} needs queries (B, H_q, Tq, D)")
    if pooling not in ("avg", "max"):
        raise ValueError(f"score_keys: pooling must be 'avg' or 'max', got {pooling!r}")
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"score_keys: kernel must be an odd integer >= 1, got {kernel}")
    B, h_kv, T, _ = keys.shape
    if method == "h2o":
        return _group_mean(attention_weights(keys, queries, scale).sum(2), h_kv)
    if method == "tova":
        if T < 2:
            return mx.zeros((B, h_kv, T), dtype=mx.float32)
        w = attention_weights(keys, queries[..., -1:, :], scale)[..., 0, :-1]  # (B, H_q, T - 1)
        s = mx.broadcast_to(w.mean(1, keepdims=True), (B, h_kv, T - 1))
        return _pad_max(s, 1)
    w = min(window, queries.shape[2])
    if w < 1 or T <= w:
        raise ValueError(f"score_keys: snapkv needs more keys ({T}) than the observation window ({w})")
    weights = attention_weights(keys, queries[..., -w:, :], scale)[..., : T - w]
    s = _group_mean(_pool(weights.mean(2), kernel, pooling), h_kv)
    return _pad_max(s, w)


class ImportanceKVCache(LayerCache):
    """A full-attention layer cache holding at most a budget of tokens chosen by score (see
    :mod:`cachelib.core.importance` for when it evicts). Slots stay in position order; each KV
    head keeps its own positions. Arrays are (B, H, T, D), grown by concatenation.

    With Ada-KV's per-head budgets (``snapkv:adaptive=1``) the heads keep different counts: each
    head's kept slots come first, then zeroed padding up to the largest count (position -1),
    then the appended tokens; :attr:`head_mask` hides the padding, and the capture hook merges
    it into the attention mask (so such a layer runs only inside ``hooks.capture``)."""

    _STATE = ("keys", "values")

    def __init__(self, policy: Policy):
        self.policy = policy
        self.keys = None
        self.values = None
        self.offset = 0
        self.positions: np.ndarray | None = None  # (B, H_kv, held) absolute positions
        self.scores: np.ndarray | None = None  # (B, H_kv, held) float32, NaN where unscored
        self.compressed = False
        self.awaiting = False
        self.score_seconds = 0.0
        self.head_mask: mx.array | None = None  # (B, H_kv, held) bool, False on padding; None: none

    @property
    def held(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.score_seconds = 0.0
        B, H, n, _ = keys.shape
        keep = evict_to(self.policy, self.held, n, self.compressed)
        if keep is not None:
            self._evict(keep)
        if self.padded and not hooks.capturing():
            raise ValueError(
                f"{self.policy.method}: its KV heads hold different counts (adaptive=1), and only the "
                "attention-capture hook masks the padding: run the model inside cachelib.mlx.hooks.capture(model)"
            )
        if compresses_now(self.policy, n, self.compressed):
            self.compressed = True
        new_pos = np.broadcast_to(np.arange(self.offset, self.offset + n, dtype=np.int64), (B, H, n))
        if self.policy.method == "knorm":
            mx.eval(keys)  # the layer's own compute, kept out of the scoring time
            start = time.perf_counter()
            new_scores = np.array(score_keys("knorm", keys, None))
            self.score_seconds += time.perf_counter() - start
        else:
            new_scores = np.full((B, H, n), np.nan, np.float32)
        if self.held == 0:
            self.keys, self.values = keys, values
            self.positions, self.scores = new_pos.copy(), new_scores
        else:
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
            self.positions = np.concatenate([self.positions, new_pos], axis=-1)
            self.scores = np.concatenate([self.scores, new_scores], axis=-1)
        self.offset += n
        self.awaiting = self.policy.needs_queries and not (self.policy.compress_once and self.compressed)
        self.head_mask = mx.array(self.positions >= 0) if self.padded else None
        return self.keys, self.values

    @property
    def padded(self) -> bool:
        """Whether some slots are padding (Ada-KV's heads keep different counts)."""
        return self.positions is not None and bool((self.positions < 0).any())

    def observe(self, queries: mx.array, scale: float | None) -> None:
        """Score the held keys with this step's queries (called by the attention-capture hook
        right after this layer's attention)."""
        if not self.awaiting:
            return
        self.awaiting = False
        mx.eval(queries, self.keys)  # the layer's own compute, kept out of the scoring time
        start = time.perf_counter()
        p = self.policy
        if p.scoring == "snapkv":
            if self.held > min(p.window, queries.shape[2]):
                s = score_keys("snapkv", self.keys, queries, window=p.window, kernel=p.kernel, pooling=p.pooling, scale=scale)
                self.scores = np.array(s)
        elif p.method == "tova":
            self.scores = np.array(score_keys("tova", self.keys, queries, scale=scale))
        else:  # h2o: accumulate
            s = np.array(score_keys("h2o", self.keys, queries, scale=scale))
            self.scores = np.nan_to_num(self.scores, nan=0.0) + s
        self.score_seconds += time.perf_counter() - start

    def _evict(self, keep: int) -> None:
        start = time.perf_counter()
        if self.policy.needs_queries and np.isnan(self.scores).any():
            raise ValueError(
                f"{self.policy.method}: the held keys were never scored; this method needs the step's "
                "queries: run the model inside cachelib.mlx.hooks.capture(model)"
            )
        slots = keep_slots(self.policy, self.scores, keep)  # (B, H, M), -1: padding
        pad = slots < 0
        taken = np.maximum(slots, 0)
        idx = mx.array(taken.astype(np.int32))[..., None]
        B, H, M = slots.shape
        dk, dv = self.keys.shape[-1], self.values.shape[-1]
        self.keys = mx.take_along_axis(self.keys, mx.broadcast_to(idx, (B, H, M, dk)), axis=2)
        self.values = mx.take_along_axis(self.values, mx.broadcast_to(idx, (B, H, M, dv)), axis=2)
        if pad.any():  # padding holds zeros, never a stale token
            real = mx.array(~pad)[..., None]
            self.keys = mx.where(real, self.keys, mx.zeros((), self.keys.dtype))
            self.values = mx.where(real, self.values, mx.zeros((), self.values.dtype))
        self.positions = np.where(pad, -1, np.take_along_axis(self.positions, taken, axis=-1))
        self.scores = np.where(pad, -np.inf, np.take_along_axis(self.scores, taken, axis=-1)).astype(np.float32)
        self.score_seconds += time.perf_counter() - start

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
        raise ValueError(f"{type(self).__name__}: restoring from a state is not supported (positions and scores are not part of it)")

    @property
    def meta_state(self):
        return tuple(map(str, (self.offset, self.policy.budget)))

    @property
    def nbytes(self) -> int:
        return array_bytes(self.keys, self.values)

    def introspect(self) -> CacheView:
        held = self.held
        total = self.nbytes
        used = tokens_used(self.positions)  # == held unless Ada-KV pads some heads
        return CacheView(
            kind=self.policy.method,
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
            head_positions=None if self.positions is None else self.positions[0].copy(),
            score_seconds=self.score_seconds,
        )


def build_importance(spec, layer: int = 0, layers: int = 1) -> ImportanceKVCache:
    """The MLX cache of full-attention layer ``layer`` of ``layers`` (its index among the
    model's full-attention layers; only ``pyramidkv``'s budget depends on it) for an importance
    spec."""
    return ImportanceKVCache(policy_of(spec, layer, layers))
