"""A strategy batch on PyTorch: several whole-model caches, one per batch row, behind the one
``Cache`` a transformers model takes, so that k strategies advance by one forward pass.

Every row is fed the same number of tokens at the same positions, so all rows share the
sequence length transformers reads for positions. :meth:`RowsCache.update` splits the batch's
new keys/values by row, hands each row to that row's own cache (the unchanged strategy
layers), and returns the rows' keys/values padded to a common length. The mask is not left to
transformers (it would take one row's sizes for all): :meth:`RowsCache.attention_mask` builds a
boolean ``(B, 1, N, L)`` mask before the forward, row ``i`` being exactly what transformers'
causal mask is for row ``i``'s own cache (from its ``get_mask_sizes``) with the padding hidden,
and the model uses a 4-D mask as given. Quantized rows hand back dequantized tensors already
(as transformers' quantized caches do), so they need nothing here.

Supported: models whose decoder layers are all full attention, and rows whose layers are
attention layers of ours on the device (offloaded caches, recurrent and hybrid layers run
one by one).
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import cache_utils as _tf

from ..core.masks import visible
from .cache import Cache
from .formats import FormatKVCacheLayer
from .layers import DynamicLayer
from .mlx_style import ChunkedKVCacheLayer, KVCacheLayer, QuantizedKVCacheLayer
from .quantized import QuantizedLayer
from .rotating import RotatingKVCacheLayer
from .sliding import DynamicSlidingWindowLayer
from .static import StaticLayer, StaticSlidingWindowLayer

# Layers a row may hold: attention layers whose update needs nothing but keys and values (the
# importance layers also read the step's queries through a hook, and run one by one).
ROW_LAYERS = (
    DynamicLayer,
    DynamicSlidingWindowLayer,
    StaticLayer,
    StaticSlidingWindowLayer,
    QuantizedLayer,
    RotatingKVCacheLayer,
    KVCacheLayer,
    QuantizedKVCacheLayer,
    ChunkedKVCacheLayer,
    FormatKVCacheLayer,
)


def batch_problem(cache, config=None) -> str | None:
    """Why the whole-model ``cache`` cannot be a row of a strategy batch (for a model of decoder
    config ``config``), or None when it can."""
    if not isinstance(cache, Cache):
        return f"a {type(cache).__name__} is not a cachelib.torch Cache"
    if cache.offloading:
        return "an offloaded cache moves each layer between devices around its update and runs on its own"
    if config is not None:
        types = set(getattr(config, "layer_types", None) or ("full_attention",))
        if types != {"full_attention"}:
            return f"the model's layers are {sorted(types)}; a strategy batch takes full-attention models only"
    for i, layer in enumerate(cache.layers):
        if type(layer) not in ROW_LAYERS:
            names = ", ".join(c.__name__ for c in ROW_LAYERS)
            return f"layer {i} is {_a(type(layer).__name__)}, which cannot share a batch (rows may hold: {names})"
    return None


class RowsCache(_tf.Cache):
    """Row ``i`` of every key/value tensor is row ``i``'s own cache (``rows[i]``)."""

    is_compileable = False

    def __init__(self, rows: Sequence[Cache], config=None):
        if not rows:
            raise ValueError("RowsCache: give at least one row cache")
        for i, row in enumerate(rows):
            problem = batch_problem(row, config)
            if problem:
                raise ValueError(f"RowsCache: row {i}: {problem}")
        self.rows = list(rows)
        # layer -> (key count per row the mask was made for, slots per row it shows)
        self._lengths: dict[int, tuple[list[int], list[int]]] = {}
        self._buffers: list[torch.Tensor | None] = [None, None]  # the batch's keys and values (see _batched)

    def __len__(self):
        return len(self.rows[0])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        seen = {row.get_seq_length(layer_idx) for row in self.rows}
        if len(seen) != 1:
            raise ValueError(
                f"strategy batch: the rows have seen different token counts {sorted(seen)}; they must advance together"
            )
        return seen.pop()

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    def attention_mask(self, n: int, device) -> torch.Tensor | None:
        """The ``(B, 1, n, L)`` boolean mask of the next forward of ``n`` tokens (None when every
        row sees every key of its own and no padding exists). Every layer of a row must give the
        same sizes, as a full-attention model applies one mask to all."""
        seen = self.get_seq_length()
        query = seen + torch.arange(n, device=device)[:, None]  # (n, 1)
        masks, lengths, extents = [], [], []
        for r, row in enumerate(self.rows):
            sizes = {row.get_mask_sizes(n, layer) for layer in range(len(row.layers))}
            if len(sizes) != 1:
                raise ValueError(
                    f"strategy batch: row {r}'s layers give different mask sizes {sorted(sizes)}; run it on its own"
                )
            kv_length, kv_offset = sizes.pop()
            # keys past the last query's position are hidden from every query (a static row's
            # unwritten slots): the batch leaves them out rather than pad every row to them
            extent = min(kv_length, max(seen + n - kv_offset, 0))
            masks.append(visible(query, kv_offset + torch.arange(extent, device=device)[None, :]))
            lengths.append(kv_length)
            extents.append(extent)
        for layer in range(len(self)):
            self._lengths[layer] = (lengths, extents)
        width = max(extents)
        if n == 1 and all(bool(m.all()) for m in masks) and len(set(extents)) == 1:
            return None
        padded = [m if m.shape[1] == width else torch.nn.functional.pad(m, (0, width - m.shape[1])) for m in masks]
        return torch.stack(padded)[:, None]  # (B, 1, n, L)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if key_states.shape[0] != len(self.rows):
            raise ValueError(
                f"strategy batch: the forward has {key_states.shape[0]} rows but the batch holds {len(self.rows)} caches"
            )
        out_k, out_v = [], []
        for i, row in enumerate(self.rows):
            k, v = row.update(key_states[i : i + 1], value_states[i : i + 1], layer_idx, *args, **kwargs)
            out_k.append(k)
            out_v.append(v)
        lengths = [k.shape[-2] for k in out_k]
        promised = self._lengths.pop(layer_idx, None)
        if promised is None:
            raise ValueError(
                "strategy batch: call attention_mask(n, device) before each forward and pass its mask to the model"
            )
        if lengths != promised[0]:
            raise ValueError(
                f"strategy batch: layer {layer_idx}'s rows returned {lengths} keys but their masks covered {promised[0]}; "
                "run these strategies one by one"
            )
        extents = promised[1]
        return self._batched(out_k, extents, 0), self._batched(out_v, extents, 1)

    def _batched(self, parts: list[torch.Tensor], extents: list[int], which: int) -> torch.Tensor:
        """The rows' keys (``which`` 0) or values (1), row ``i`` cut to its first ``extents[i]``
        slots, as one ``(B, H, max(extents), D)`` tensor. It is a view of a buffer this batch
        keeps and every layer overwrites (the layers run one after another, and each layer's
        attention reads its keys before the next layer's update), so no layer allocates, pads
        and concatenates afresh; slots past a row's extent hold finite leftovers that its mask
        hides."""
        if len(parts) == 1:
            return parts[0][:, :, : extents[0]]
        width = max(extents)
        first = parts[0]
        b, h, d = len(parts), first.shape[1], first.shape[-1]
        buf = self._buffers[which]
        fits = buf is not None and buf.shape[1] == h and buf.shape[2] >= width and buf.shape[3] == d
        if not fits or buf.dtype != first.dtype or buf.device != first.device:
            cap = -(-width // 256) * 256
            buf = self._buffers[which] = torch.zeros(b, h, cap, d, dtype=first.dtype, device=first.device)
        for i, (part, n) in enumerate(zip(parts, extents)):
            buf[i, :, :n].copy_(part[0, :, :n])
        return buf[:, :, :width]

    # what generation code or the mask helpers may read
    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return max(row.get_mask_sizes(query_length, layer_idx)[0] for row in self.rows), 0

    @property
    def is_sliding(self) -> list[bool]:
        return self.rows[0].is_sliding

    @property
    def is_linear(self) -> list[bool]:
        return self.rows[0].is_linear

    @property
    def is_dummy(self) -> list[bool]:
        return self.rows[0].is_dummy

    @property
    def nbytes(self) -> int:
        return sum(row.nbytes for row in self.rows)


def _a(name: str) -> str:
    """``name`` with its indefinite article (a KVCache, an ImportanceKVCache)."""
    return f"{'an' if name[:1].upper() in 'AEIOU' else 'a'} {name}"
