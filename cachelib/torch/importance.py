"""Importance-based eviction on PyTorch: the key scores (:func:`score_keys`, a pure function) and
the transformers attention layer that keeps a fixed budget of the best-scored tokens
(:class:`ImportanceLayer`), for ``knorm``, ``snapkv``, ``pyramidkv`` (SnapKV's scores, a
budget per layer), ``tova`` and ``h2o``.

When a layer evicts and which slots it keeps is decided in :mod:`cachelib.core.importance`
(shared with MLX); this module computes the scores. Methods that score with attention get the
step's queries from the attention-capture hook (:mod:`cachelib.torch.hooks`); without it they
refuse to evict rather than guess.

Every score is ``(B, H_kv, T)``, higher = keep, computed in float32:

- ``knorm``: ``-||k||_2`` over the head dimension (keep the keys of lowest norm).
- attention weights: ``softmax(q @ k^T * scale)`` over the **key** axis, in float32, with the
  causal rule that query ``i`` of ``Tq`` sits at position ``T - Tq + i`` of the ``T`` keys; a
  query head ``h`` reads key head ``h // (H_q / H_kv)`` (GQA), ``scale`` is ``D ** -0.5``.
- ``snapkv``: the last ``window`` queries' weights on the ``T - window`` keys before the window,
  averaged over those queries, pooled along the key axis with a 1-D kernel of ``kernel`` (odd;
  ``avg``: zero-padded mean counting the padding, ``max``: max over the valid neighbours), then
  averaged over the query heads of each KV group; the window's own keys get the largest score of
  the whole tensor (always kept). This is kvpress 0.5.5's ``SnapKVPress`` score.
- ``tova``: the last query's weights on the ``T - 1`` keys before it, averaged over **all** query
  heads (one choice per layer, repeated for every KV head); the last key gets the largest score
  of the whole tensor.
  This is kvpress 0.5.5's ``TOVAPress`` score.
- ``h2o``: the weights of every query, summed over the queries and averaged over the query heads
  of each KV group (the layer accumulates them over steps).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..core.importance import Policy, compresses_now, evict_to, keep_slots, policy_of, tokens_used
from ..introspect import CacheView
from ..spec import STRATEGIES
from . import hooks
from .base import AttentionLayer, check_crop, check_ignored_keywords, dtype_name
from .cache import Cache, build_layers


def attention_weights(keys: torch.Tensor, queries: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal softmax weights of ``queries`` (B, H_q, Tq, D) on ``keys`` (B, H_kv, T, D), the
    queries being the last ``Tq`` positions: (B, H_q, Tq, T) float32, rows summing to 1."""
    B, h_kv, T, D = keys.shape
    h_q, tq = queries.shape[1], queries.shape[2]
    if h_q % h_kv:
        raise ValueError(f"attention_weights: {h_q} query heads are not a multiple of {h_kv} key heads")
    if tq > T:
        raise ValueError(f"attention_weights: {tq} queries but only {T} keys (queries are the last keys' positions)")
    scale = D**-0.5 if scale is None else float(scale)
    k = keys.float().repeat_interleave(h_q // h_kv, dim=1)  # (B, H_q, T, D)
    logits = torch.matmul(queries.float(), k.transpose(-1, -2)) * scale  # (B, H_q, Tq, T)
    q_pos = torch.arange(T - tq, T, device=keys.device)[:, None]
    hidden = torch.arange(T, device=keys.device)[None, :] > q_pos  # (Tq, T)
    logits = logits.masked_fill(hidden, float("-inf"))
    return torch.softmax(logits, dim=-1)


def _pool(scores: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """1-D pooling along the last axis, stride 1, ``kernel // 2`` padding on each side."""
    if kernel == 1:
        return scores
    pad = kernel // 2
    T = scores.shape[-1]
    fill = 0.0 if pooling == "avg" else float("-inf")
    padded = torch.nn.functional.pad(scores, (pad, pad), value=fill)
    windows = torch.stack([padded[..., i : i + T] for i in range(kernel)], dim=0)
    return windows.sum(0) / kernel if pooling == "avg" else windows.amax(0)


def _group_mean(scores: torch.Tensor, h_kv: int) -> torch.Tensor:
    B, h_q, T = scores.shape
    return scores.view(B, h_kv, h_q // h_kv, T).mean(2)


class Scorer:
    """How one importance method scores keys on PyTorch: one subclass per method, named by the
    method's entry of the strategy table (``Strategy.importance.torch``). Stateless: the layer holds
    the scores (as numpy float32, where :mod:`cachelib.core.importance` chooses the kept slots)."""

    @staticmethod
    def score(keys: torch.Tensor, queries, *, window: int, kernel: int, pooling: str, scale) -> torch.Tensor:
        """Scores of ``keys`` (B, H_kv, T, D) by the step's ``queries`` (B, H_q, Tq, D): (B, H_kv, T) float32."""
        raise NotImplementedError

    @classmethod
    def observed(cls, policy: Policy, scores: np.ndarray, keys, queries, scale) -> np.ndarray | None:
        """The held keys' scores after a step's queries (None: unchanged)."""
        s = cls.score(keys, queries, window=policy.window, kernel=policy.kernel, pooling=policy.pooling, scale=scale)
        return s.cpu().numpy()


class KNorm(Scorer):
    """``-||k||_2``: keeps the keys of lowest norm; scores new keys as they come (no queries)."""

    @staticmethod
    def score(keys, queries, *, window=0, kernel=5, pooling="avg", scale=None):
        return -keys.float().norm(dim=-1)


class SnapKV(Scorer):
    """The observation window's pooled attention (kvpress 0.5.5's ``SnapKVPress``; PyramidKV alike)."""

    @staticmethod
    def score(keys, queries, *, window=64, kernel=5, pooling="avg", scale=None):
        T = keys.shape[2]
        w = min(window, queries.shape[2])
        if w < 1 or T <= w:
            raise ValueError(f"score_keys: snapkv needs more keys ({T}) than the observation window ({w})")
        weights = attention_weights(keys, queries[..., -w:, :], scale)[..., : T - w]  # (B, H_q, w, T - w)
        s = _group_mean(_pool(weights.mean(2), kernel, pooling), keys.shape[1])
        return torch.nn.functional.pad(s, (0, w), value=float(s.max()))

    @classmethod
    def observed(cls, policy, scores, keys, queries, scale):
        if keys.shape[-2] <= min(policy.window, queries.shape[2]):  # nothing before the window to score
            return None
        return super().observed(policy, scores, keys, queries, scale)


class TOVA(Scorer):
    """The last query's attention averaged over all query heads (kvpress 0.5.5's ``TOVAPress``)."""

    @staticmethod
    def score(keys, queries, *, window=0, kernel=5, pooling="avg", scale=None):
        B, h_kv, T, _ = keys.shape
        if T < 2:
            return torch.zeros((B, h_kv, T), dtype=torch.float32, device=keys.device)
        w = attention_weights(keys, queries[..., -1:, :], scale)[..., 0, :-1]  # (B, H_q, T - 1)
        s = w.mean(1, keepdim=True).expand(B, h_kv, T - 1)
        return torch.nn.functional.pad(s, (0, 1), value=float(s.max()))


class H2O(Scorer):
    """Every query's attention, accumulated over the steps (H2O's heavy hitters)."""

    @staticmethod
    def score(keys, queries, *, window=0, kernel=5, pooling="avg", scale=None):
        return _group_mean(attention_weights(keys, queries, scale).sum(2), keys.shape[1])

    @classmethod
    def observed(cls, policy, scores, keys, queries, scale):
        return np.nan_to_num(scores, nan=0.0) + cls.score(keys, queries, scale=scale).cpu().numpy()


def score_keys(
    method: str,
    keys: torch.Tensor,
    queries: torch.Tensor | None,
    *,
    window: int = 64,
    kernel: int = 5,
    pooling: str = "avg",
    scale: float | None = None,
) -> torch.Tensor:
    """Per-(batch, KV head, position) scores of ``keys`` (B, H_kv, T, D), higher = keep, by the
    scorer of importance strategy ``method`` (``knorm``, ``snapkv``, ``tova``, ``h2o``, ...; see the
    module docstring for exactly what each computes). ``queries`` (B, H_q, Tq, D) are the post-RoPE
    queries of the last Tq positions (None for ``knorm``). Returns a float32 (B, H_kv, T) tensor."""
    methods = [name for name, s in STRATEGIES.items() if s.importance is not None and s.importance.torch]
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
    return entry.scorer("torch").score(keys, queries, window=window, kernel=kernel, pooling=pooling, scale=scale)


class ImportanceLayer(AttentionLayer):
    """A full-attention layer holding at most a budget of tokens chosen by score (see
    :mod:`cachelib.core.importance` for when it evicts). Slots stay in position order; each KV
    head keeps its own positions (``tova`` keeps the same ones on every head).

    With Ada-KV's per-head budgets (``snapkv:adaptive=1``) the heads keep different counts: each
    head's kept slots come first, then zeroed padding up to the largest count (position -1),
    then the appended tokens; :attr:`head_mask` hides the padding, and the capture hook merges
    it into ``attention_mask`` (so such a layer runs only inside ``hooks.capture``)."""

    is_croppable = False

    def __init__(self, policy: Policy, **ignored):
        check_ignored_keywords(type(self).__name__, ignored)
        super().__init__()
        self.policy = policy
        self.scorer: type[Scorer] = STRATEGIES[policy.name].scorer("torch")
        self.kind = policy.name
        self.offset = 0
        self.positions: np.ndarray | None = None  # (B, H_kv, held) absolute positions
        self.scores: np.ndarray | None = None  # (B, H_kv, held) float32, NaN where unscored
        self.compressed = False
        self.score_seconds = 0.0  # spent scoring in the current step (hook and eviction)
        self.awaiting = False  # updated, and not yet given this step's queries
        self.head_mask: torch.Tensor | None = None  # (B, H_kv, held) bool, False on padding; None: none

    def __repr__(self):
        return f"{type(self).__name__}({self.policy})"

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device = key_states.device
        self.is_initialized = True

    @property
    def held(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.score_seconds = 0.0
        B, H, n, _ = key_states.shape
        keep = evict_to(self.policy, self.held, n, self.compressed)
        if keep is not None:
            self._evict(keep)
        if self.padded and not hooks.capturing():
            raise ValueError(
                f"{self.policy.name}: its KV heads hold different counts (adaptive=1), and only the "
                "attention-capture hook masks the padding: run the model inside cachelib.torch.hooks.capture(model)"
            )
        if compresses_now(self.policy, n, self.compressed):
            self.compressed = True
        new_pos = np.broadcast_to(np.arange(self.offset, self.offset + n, dtype=np.int64), (B, H, n))
        new_scores = np.full((B, H, n), np.nan, np.float32) if self.policy.needs_queries else self._scored(key_states)
        if self.keys is None or self.held == 0:
            self.keys, self.values = key_states, value_states
            self.positions, self.scores = new_pos.copy(), new_scores
        else:
            self.keys = torch.cat((self.keys, key_states), dim=-2)
            self.values = torch.cat((self.values, value_states), dim=-2)
            self.positions = np.concatenate([self.positions, new_pos], axis=-1)
            self.scores = np.concatenate([self.scores, new_scores], axis=-1)
        self.offset += n
        self.awaiting = self.policy.needs_queries and not (self.policy.compress_once and self.compressed)
        self.head_mask = torch.from_numpy(self.positions >= 0).to(self.device) if self.padded else None
        hooks.expect(self)  # the capture hook: queries, per-head masks, masks of its own size
        return self.keys, self.values

    @property
    def padded(self) -> bool:
        """Whether some slots are padding (Ada-KV's heads keep different counts)."""
        return self.positions is not None and bool((self.positions < 0).any())

    def _scored(self, key_states) -> np.ndarray:
        """New keys scored as they come (a method without queries)."""
        start = time.perf_counter()
        p = self.policy
        out = self.scorer.score(key_states, None, window=p.window, kernel=p.kernel, pooling=p.pooling, scale=None)
        out = out.cpu().numpy()
        self.score_seconds += time.perf_counter() - start
        return out

    def observe(self, queries: torch.Tensor, scale: float | None) -> None:
        """Score the held keys with this step's queries (called by the attention-capture hook
        right after this layer's attention)."""
        if not self.awaiting:
            return
        self.awaiting = False
        start = time.perf_counter()
        s = self.scorer.observed(self.policy, self.scores, self.keys, queries, scale)
        if s is not None:
            self.scores = s
        self.score_seconds += time.perf_counter() - start

    def _evict(self, keep: int) -> None:
        start = time.perf_counter()
        if self.policy.needs_queries and np.isnan(self.scores).any():
            raise ValueError(
                f"{self.policy.name}: the held keys were never scored; this method needs the step's "
                "queries: run the model inside cachelib.torch.hooks.capture(model)"
            )
        slots = keep_slots(self.policy, self.scores, keep)  # (B, H, M), -1: padding
        pad = slots < 0
        taken = np.maximum(slots, 0)
        idx = torch.from_numpy(taken).to(self.keys.device)
        gather = idx[..., None].expand(*idx.shape, self.keys.shape[-1])
        self.keys = torch.gather(self.keys, 2, gather)
        self.values = torch.gather(self.values, 2, idx[..., None].expand(*idx.shape, self.values.shape[-1]))
        if pad.any():  # padding holds zeros, never a stale token
            real = torch.from_numpy(~pad).to(self.keys.device)[..., None]
            self.keys = torch.where(real, self.keys, 0.0)
            self.values = torch.where(real, self.values, 0.0)
        self.positions = np.where(pad, -1, np.take_along_axis(self.positions, taken, axis=-1))
        self.scores = np.where(pad, -np.inf, np.take_along_axis(self.scores, taken, axis=-1)).astype(np.float32)
        self.score_seconds += time.perf_counter() - start

    def get_seq_length(self) -> int:
        return self.offset

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # What update() will return: the tokens kept after this step's eviction, then the new
        # ones; every kept token is older than every new one, so they are masked as contiguous.
        keep = evict_to(self.policy, self.held, query_length, self.compressed)
        held = self.held if keep is None else keep
        return held + query_length, self.offset - held

    def crop(self, tokens_to_remove: int) -> None:
        n = check_crop(tokens_to_remove, self.held, type(self).__name__)
        if n:
            raise ValueError(f"{self.policy.name}: an importance cache cannot drop its newest tokens (crop)")

    def reset(self) -> None:
        self.keys = self.values = None
        self.positions = self.scores = self.head_mask = None
        self.offset, self.compressed, self.awaiting = 0, False, False
        self.is_initialized = False

    def introspect(self) -> CacheView:
        held = self.held
        used = tokens_used(self.positions)  # == held unless Ada-KV pads some heads
        return self._view(
            layout="selected",
            offset=self.offset,
            tokens_held=used,
            capacity=held,
            max_capacity=None if self.policy.compress_once else self.policy.budget,
            bytes_used=self.nbytes * used // held if held else 0,
            write_index=held,
            dtype=dtype_name(self.keys.dtype) if self.keys is not None else "",
            head_positions=None if self.positions is None else self.positions[0].copy(),
            score_seconds=self.score_seconds,
        )


def build_importance(spec, config) -> Cache:
    """The transformers cache of an importance spec: an :class:`ImportanceLayer` on every
    full-attention layer; sliding-window and recurrent layers keep their own. With
    ``pyramidkv`` each full-attention layer's budget follows its index among them."""
    made: list[ImportanceLayer] = []

    def attention() -> ImportanceLayer:
        made.append(ImportanceLayer(policy_of(spec)))
        return made[-1]

    layers = build_layers(config, attention)
    for i, layer in enumerate(made):  # the count is known once every layer is built
        layer.policy = policy_of(spec, i, len(made))
    return Cache(layers)
