"""A strategy batch on PyTorch: several whole-model caches, one per batch row, behind the one
``Cache`` a transformers model takes, so that k strategies advance by one forward pass.

Every row is fed the same number of tokens at the same positions, so all rows share the
sequence length transformers reads for positions. :meth:`RowsCache.update` splits the batch's
new keys/values by row, hands each row to that row's own cache (the unchanged strategy
layers), and returns the rows' keys/values padded to a common length. The mask is not left to
transformers (it would take one row's sizes for all): :meth:`RowsCache.attention_mask` builds a
boolean ``(B, 1, N, L)`` mask before the forward, row ``i`` being exactly what transformers'
causal mask is for row ``i``'s own cache (from its ``get_mask_sizes``) with the padding hidden,
and the model uses a 4-D mask as given; a first chunk every row sees plainly causally (a prefill)
gets none, so SDPA runs ``is_causal`` as transformers' own prefill does (same logits, ~3x faster).

The batch's keys and values: each layer keeps one ``(B, H, slots, D)`` buffer for keys and one
for values, row ``i``'s first slots holding what row ``i``'s layer handed back last (the rest
finite leftovers its mask hides). A step writes only what changed: each layer says in
:attr:`~.base.AttentionLayer.written` what its update changed, and
:meth:`~.base.AttentionLayer.update_changed` hands back just those slots, so an appending row
gives its new tokens, a ring the one slot it overwrote, a quantized row (and KIVI) its new tokens
dequantized (a token's codes never change once written, so the buffer holds exactly what the
row's own dequantized return would), KIVI also the tokens its store took at a residual flush; a
row that moved everything (an eviction, a ring put back in time order, a quantized cache
converting at ``start``, a chunk trimmed) or that the batch did not update last is copied whole.
A decode step where every row changed one slot writes each buffer once. The buffers cost a copy
of every row padded to the longest, ``2 x B x H x slots x D`` elements a layer: what the runtime's
own batch of these rows would hold as its cache. Past ``buffer_bytes`` for the whole batch (0:
never; by default :func:`~cachelib.core.memory.batch_buffer_limit`, a quarter of the memory
available when the buffers first need more than 1 GiB, measured then, and at least 1 GiB), the
batch copies every row whole into one buffer shared by the layers at every layer and step (what
it always did before; the logits are the same bit for bit).

Supported: models whose decoder layers are all full attention, and rows whose layers are
attention layers of ours on the device (offloaded caches, recurrent and hybrid layers, and
importance layers that score with the step's queries run one by one; ``knorm`` scores from the
keys alone and may share a batch).
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
from transformers import cache_utils as _tf

from ..core import memory
from ..core.masks import visible
from ..core.units import STEP
from .cache import Cache
from .formats import FormatKVCacheLayer
from .importance import ImportanceLayer
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
        if type(layer) is ImportanceLayer and not layer.policy.needs_queries:
            continue  # knorm: scored from the keys as they come, no hook needed
        if type(layer) not in ROW_LAYERS:
            names = ", ".join(c.__name__ for c in ROW_LAYERS)
            return f"layer {i} is {_a(type(layer).__name__)}, which cannot share a batch (rows may hold: {names})"
    return None


class RowsCache(_tf.Cache):
    """Row ``i`` of every key/value tensor is row ``i``'s own cache (``rows[i]``)."""

    is_compileable = False

    def __init__(self, rows: Sequence[Cache], config=None, buffer_bytes: int | None = None):
        """``buffer_bytes``: the most the layers' key/value buffers may hold together (0: none,
        every layer copies every row whole into one shared buffer, each step; None: the limit
        :func:`~cachelib.core.memory.batch_buffer_limit` gives for the memory available when the
        buffers first need more than its floor)."""
        memory.check_buffer_bytes(buffer_bytes, "RowsCache")
        if not rows:
            raise ValueError("RowsCache: give at least one row cache")
        for i, row in enumerate(rows):
            problem = batch_problem(row, config)
            if problem:
                raise ValueError(f"RowsCache: row {i}: {problem}")
        self.rows = list(rows)
        # layer -> (key count per row the mask was made for, slots per row it shows)
        self._lengths: dict[int, tuple[list[int], list[int]]] = {}
        self._buffers: list[torch.Tensor | None] = [None, None]  # keys and values shared by the layers (_batched)
        self.buffer_limit = (
            buffer_bytes  # None until measured (memory.settle_buffer_limit); 0 once the buffers are dropped
        )
        self._layers: dict[int, _LayerBuffers] = {}  # per layer, its own buffers (_write)
        self._buffered = 0  # bytes of every layer's buffers
        # a first chunk forwarded once, through row 0 (advance_once): per layer, row 0's input and return
        self._once: list[tuple] | None = None
        # called once, as the last layer of the next forward has updated its rows (Runner.step_rows)
        self.after_last_update: Callable[[], object] | None = None

    def __len__(self):
        return len(self.rows[0])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self._once is not None:  # advance_once's forward: the other rows take the chunk after it
            return self.rows[0].get_seq_length(layer_idx)
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
        if seen == 0 and set(lengths) == set(extents) == {n}:
            causal = visible(query, torch.arange(n, device=device)[None, :])
            if all(bool(m.equal(causal)) for m in masks):
                # a first chunk every row sees causally: no mask, so transformers' SDPA runs is_causal as
                # its own prefill does (the masked half skipped; an explicit mask made it ~3x slower)
                return None
        padded = [m if m.shape[1] == width else torch.nn.functional.pad(m, (0, width - m.shape[1])) for m in masks]
        return torch.stack(padded)[:, None]  # (B, 1, n, L)

    def advance_once(self, model, ids: Sequence[Sequence[int]]) -> bool:
        """Forward a first chunk that every row takes alike once, through row 0 alone, and hand
        the other rows what row 0's layers took; False (nothing done) where that cannot be the
        batch's own forward bit for bit, and the caller runs the batch as usual.

        It is done when every row gets the same tokens, holds nothing yet (no token seen, no
        byte held) and sees them plainly causally (:meth:`attention_mask` gives None), and the
        device is the CPU, where a row's products do not depend on the batch's other rows (on
        a GPU a kernel may be picked by the batch size). Then every row's layer is given the
        same keys and values, and a row whose layers all hand back exactly what row 0's did
        attends exactly as row 0 does, layer after layer: its cache ends as the batch's forward
        would leave it. That is checked, layer by layer, after the forward (every row is
        updated, then each return compared with row 0's); a row that handed back anything else
        (a cache that hands its chunk back dequantized or cut) puts every row back as it was
        before the forward and the call returns False."""
        n, device = len(ids[0]), model.device
        if len(self.rows) < 2 or device.type != "cpu" or any(list(r) != list(ids[0]) for r in ids):
            return False
        if any(row.get_seq_length() or row.nbytes for row in self.rows):
            return False
        if self.attention_mask(n, device) is not None:
            self._lengths.clear()
            return False
        if not self._first_layer_alike(model, n):
            return False
        before = [copy.deepcopy(row) for row in self.rows]  # empty caches: cheap
        self._once = []
        try:
            with torch.inference_mode():
                x = torch.tensor([list(ids[0])], dtype=torch.long, device=device)
                model(input_ids=x, cache=self, use_cache=True, logits_to_keep=1)
            taken, self._once = self._once, None
            with torch.inference_mode():
                alike = all(self._same_as_first(row, taken) for row in self.rows[1:])
        finally:
            self._once = None
            self._lengths.clear()
        if not alike:
            for row, old in zip(self.rows, before):  # in place: the caller holds these caches
                vars(row).clear()
                vars(row).update(vars(old))
        return alike

    def _first_layer_alike(self, model, n: int) -> bool:
        """Whether copies of the (empty) rows hand back alike what their first layer is given,
        tried on ``n`` random tokens of the model's key shape: a row that does not (a cache that
        hands its chunk back dequantized) would make :meth:`advance_once` undo a whole forward,
        so it is found before one. A row whose update needs the forward's own arguments cannot be
        tried here and is left to the check after the forward."""
        config = model.config.get_text_config(decoder=True)
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        gen = torch.Generator().manual_seed(0)
        k, v = (torch.randn(1, heads, n, head_dim, generator=gen).to(model.dtype) for _ in range(2))
        first = None
        with torch.inference_mode():
            for row in self.rows:
                try:
                    got = copy.deepcopy(row).update(k.clone(), v.clone(), 0)
                except (TypeError, KeyError, ValueError, IndexError):  # the forward's check decides
                    continue
                if first is None:
                    first = got
                elif not (torch.equal(got[0], first[0]) and torch.equal(got[1], first[1])):
                    return False
        return True

    @staticmethod
    def _same_as_first(row, taken) -> bool:
        """Update ``row``'s layers with what row 0's took; whether each handed back what row 0's did."""
        for layer_idx, k_in, v_in, args, kwargs, k0, v0 in taken:
            k, v = row.update(k_in.clone(), v_in.clone(), layer_idx, *args, **kwargs)
            if not (torch.equal(k, k0) and torch.equal(v, v0)):
                return False
        return True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self._once is not None:  # advance_once: row 0 alone; the others replay its inputs after the forward
            if self._lengths.pop(layer_idx, None) is None:
                raise ValueError("strategy batch: advance_once's forward reached a layer its mask did not cover")
            k, v = self.rows[0].update(key_states, value_states, layer_idx, *args, **kwargs)
            self._once.append((layer_idx, key_states, value_states, args, kwargs, k, v))
            return k, v
        if key_states.shape[0] != len(self.rows):
            raise ValueError(
                f"strategy batch: the forward has {key_states.shape[0]} rows but the batch holds "
                f"{len(self.rows)} caches"
            )
        promised = self._lengths.pop(layer_idx, None)
        if promised is None:
            raise ValueError(
                "strategy batch: call attention_mask(n, device) before each forward and pass its mask to the model"
            )
        extents = promised[1]
        buffers = self._layer_buffers(layer_idx, key_states, value_states, max(extents))
        if buffers is not None:
            out = self._write(buffers, key_states, value_states, layer_idx, promised)
        else:
            out_k, out_v = [], []
            for i, row in enumerate(self.rows):
                k, v = row.update(key_states[i : i + 1], value_states[i : i + 1], layer_idx, *args, **kwargs)
                out_k.append(k)
                out_v.append(v)
            self._check_lengths(layer_idx, [k.shape[-2] for k in out_k], promised[0])
            out = self._batched(out_k, extents, 0), self._batched(out_v, extents, 1)
        if not self._lengths and self.after_last_update is not None:  # every layer of this forward has updated
            hook, self.after_last_update = self.after_last_update, None
            hook()
        return out

    @staticmethod
    def _check_lengths(layer_idx: int, lengths: list[int], promised: list[int]) -> None:
        if lengths != promised:
            raise ValueError(
                f"strategy batch: layer {layer_idx}'s rows returned {lengths} keys but their masks covered {promised}; "
                "run these strategies one by one"
            )

    def _layer_buffers(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, width: int):
        """Layer ``layer_idx``'s own buffers, grown to hold ``width`` slots if need be; None
        with a single row, or when they would pass the batch's byte limit (then no layer keeps
        any, for good)."""
        if len(self.rows) == 1 or self.buffer_limit == 0:
            return None
        buf = self._layers.get(layer_idx)
        b, h = keys.shape[0], keys.shape[1]
        if buf is not None and not buf.fits(keys, values):
            self._buffered -= buf.nbytes  # another shape or dtype: start afresh
            del self._layers[layer_idx]
            buf = None
        if buf is not None and buf.keys.shape[2] >= width:
            return buf
        slots = -(-width // STEP) * STEP
        size = b * h * slots * (keys.shape[3] * keys.element_size() + values.shape[3] * values.element_size())
        held = 0 if buf is None else buf.nbytes
        need = self._buffered - held + size
        self.buffer_limit, allowed = memory.settle_buffer_limit(self.buffer_limit, need, str(keys.device))
        if not allowed:
            self.buffer_limit = 0
            self._layers.clear()
            self._buffered = 0
            return None
        if buf is None:
            buf = self._layers[layer_idx] = _LayerBuffers(len(self.rows))
        buf.grow(keys, values, slots)
        self._buffered += size - held
        return buf

    def _write(self, buf: "_LayerBuffers", key_states, value_states, layer_idx: int, promised):
        """Update every row, writing into the layer's buffers only the slots each changed."""
        lengths, extents = promised
        starts, parts_k, parts_v, got, verbatim = [], [], [], [], True
        for i, row in enumerate(self.rows):
            k_in, v_in = key_states[i : i + 1], value_states[i : i + 1]
            if layer_idx >= len(row.layers):  # a layer the row's cache makes at its first update
                k, v = row.update(k_in, v_in, layer_idx)
                start, length = 0, k.shape[-2]
                k, v, w = k[..., : extents[i], :], v[..., : extents[i], :], None
            else:
                layer = row.layers[layer_idx]
                held = buf.held[i] if buf.seen[i] == layer.get_seq_length() else 0
                start, k, v, length = layer.update_changed(k_in, v_in, held, extents[i])
                w = layer.written
                buf.seen[i] = layer.get_seq_length()
            # the changed slots are the input as given: the input is written (one copy for all rows)
            verbatim = verbatim and w is not None and w.verbatim and (w.start, w.end) == (start, start + k.shape[-2])
            starts.append(start)
            parts_k.append(k)
            parts_v.append(v)
            got.append(length)
        self._check_lengths(layer_idx, got, lengths)
        bk, bv = buf.keys, buf.values
        n = key_states.shape[2]
        if all(p.shape[-2] == 1 for p in parts_k):  # a decode step: one write per buffer
            if verbatim and n == 1:
                new_k, new_v = key_states, value_states
            else:
                new_k, new_v = torch.cat(parts_k), torch.cat(parts_v)
            if len(set(starts)) == 1:
                bk[:, :, starts[0] : starts[0] + 1].copy_(new_k)
                bv[:, :, starts[0] : starts[0] + 1].copy_(new_v)
            else:
                rows, slots = buf.index(starts, bk.device)
                bk[rows, :, slots] = new_k[:, :, 0]
                bv[rows, :, slots] = new_v[:, :, 0]
        else:
            for i, (start, k, v) in enumerate(zip(starts, parts_k, parts_v)):
                if k.shape[-2]:
                    bk[i, :, start : start + k.shape[-2]].copy_(k[0])
                    bv[i, :, start : start + v.shape[-2]].copy_(v[0])
        buf.held = list(extents)
        width = max(extents)
        return bk[:, :, :width], bv[:, :, :width]

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


class _LayerBuffers:
    """One layer's key and value buffers, ``(B, H, slots, D)``, and per row what they hold:
    ``held[i]`` leading slots of what row ``i``'s layer handed back when it had seen
    ``seen[i]`` tokens."""

    def __init__(self, rows: int):
        self.keys = self.values = None
        self.held = [0] * rows
        self.seen: list[int | None] = [None] * rows
        self._index: tuple[tuple[int, ...], torch.Tensor, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def fits(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether these buffers take the rows of keys and values shaped and typed as these."""
        return all(
            b.shape[:2] == x.shape[:2] and b.shape[3] == x.shape[3] and b.dtype == x.dtype and b.device == x.device
            for b, x in ((self.keys, keys), (self.values, values))
        )

    def grow(self, keys: torch.Tensor, values: torch.Tensor, slots: int) -> None:
        """Grow (or make) the buffers to ``slots`` slots, keeping what they hold."""
        grown = []
        for old, x in ((self.keys, keys), (self.values, values)):
            new = x.new_zeros((x.shape[0], x.shape[1], slots, x.shape[3]))
            if old is not None:
                new[:, :, : old.shape[2]].copy_(old)
            grown.append(new)
        self.keys, self.values = grown

    def index(self, starts: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, slots) index tensors writing one slot per row at ``starts``, kept while they repeat."""
        key = tuple(starts)
        if self._index is None or self._index[0] != key:
            rows = torch.arange(len(starts), device=device)
            self._index = (key, rows, torch.tensor(starts, device=device))
        return self._index[1], self._index[2]


def _a(name: str) -> str:
    """``name`` with its indefinite article (a KVCache, an ImportanceKVCache)."""
    return f"{'an' if name[:1].upper() in 'AEIOU' else 'a'} {name}"
