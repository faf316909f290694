"""A strategy batch on MLX: several whole-model caches, one per batch row, behind the one cache
list an mlx-lm model takes, so that k strategies advance by one forward pass.

Every row is fed the same number of tokens at the same positions (teacher-forced decoding, or
free-running with one token per row), so all rows share ``offset`` and RoPE. Per attention layer
a :class:`RowsCache` splits the batch's new keys/values by row, hands each row to that row's own
cache (the unchanged strategy classes), and returns the rows' keys/values padded to a common
length; its ``make_mask`` returns a boolean ``(B, 1, N, L)`` mask that is each row's own mask
(rings, windows, static slots) with the padding hidden.

Quantized rows: mlx-lm's attention takes its quantized path only for a cache with ``bits``, and
one batch has one attention call, so the wrapper has no ``bits`` and a row that hands back
``(packed, scales, biases)`` is dequantized here (mlx-lm's quantized path multiplies by the same
dequantized values inside ``quantized_matmul``; the two agree to float rounding, not bit for bit).
On the CPU the 2-, 4- and 8-bit widths are unpacked by :func:`.quantized.dequantize`'s
compiled elementwise graph rather than by ``mx.dequantize``: its CPU kernel took ~28 ms of CPU
per step of two quantized rows (SmolLM2, 30 layers, ~80 tokens held), the elementwise ops ~11 ms,
to the same values bit for bit (checked once per width and dtype against ``mx.dequantize``).

The batch's keys and values: each layer keeps one ``(B, H, slots, D)`` float buffer for keys and
one for values, row ``i`` holding row ``i``'s returned keys (dequantized) in its first slots, the
rest zeros that the mask hides. A step writes into it only what changed, as each row's cache says
in :attr:`~.base.LayerCache.written`: an appending row's new tokens (a quantized row's dequantized
alone: a token's codes never change once written, so the buffer holds exactly ``dequantize`` of
the whole cache), the one slot a ring overwrote, the tokens KIVI's store took since its last
return; a row that rewrote everything (a ring putting its tokens in time order, a quantized cache
converting at ``start``) is copied whole. Where a row's new slots are its input as given, the
input is written, not the row's returned arrays: a KIVI row then never dequantizes its whole
store (what it does alone, every step), since nothing reads that part of what it returned. A
decode step in which every row changed one slot writes each buffer once (a slice where the
rows' slots line up, else one scatter). Since such a row's own cache is then read by nothing the
logits need, each forward evaluates every row's state with the logits (:func:`row_states`), or
its updates would pile up unevaluated. Without the buffers every layer copied every row's whole
cache into a fresh padded batch and dequantized each quantized row's whole cache, every step.
The buffers cost a float copy of every row padded to the longest,
``2 x B x H x slots x D`` elements a layer: what mlx-lm's own batch of these rows would hold as its
cache. Past the batch's limit (by default :func:`~cachelib.core.memory.batch_buffer_limit`, a
quarter of the memory available when the buffers first need more than 1 GiB, measured then, and
at least 1 GiB), the batch drops them and goes back to copying the rows into a padded batch per
layer, which holds one layer's copy at a time.

The mask is made before any layer runs, so the key count of each row is known ahead: from the
row's own mask where it is an array, else (one query, no mask: every returned key visible) from
its view. Every update checks the count it got against that prediction and refuses a mismatch.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from ..core import memory
from ..core.units import STEP
from .base import LayerCache
from .formats import FormatKVCache
from .kivi import KIVICache
from .kv import ConcatenateKVCache, KVCache, StaticKVCache
from .quantized import QuantizedKVCache, dequantize
from .rotating import QuantizedRotatingKVCache, RotatingKVCache

# Layer caches a row may hold: every attention cache that makes its own mask. Chunked (the model
# builds its mask), recurrent state and batch caches run one by one.
ROW_CLASSES = (
    KVCache,
    ConcatenateKVCache,
    RotatingKVCache,
    QuantizedRotatingKVCache,
    QuantizedKVCache,
    KIVICache,
    StaticKVCache,
    FormatKVCache,
)


def batch_problem(cache: Sequence) -> str | None:
    """Why the whole-model ``cache`` cannot be a row of a strategy batch, or None when it can."""
    for i, layer in enumerate(cache):
        if type(layer) not in ROW_CLASSES:
            names = ", ".join(c.__name__ for c in ROW_CLASSES)
            return f"layer {i} holds {_a(type(layer).__name__)}, which cannot share a batch (rows may hold: {names})"
    return None


class _Expected:
    """What the layers of one batch share: key counts per row promised by the last ``make_mask``
    of each kind of layer and the offset they were made at (a model that builds its own masks
    leaves none), and the bytes the layers' buffers hold."""

    def __init__(self, buffer_bytes: int | None = None):
        self.by_kind: dict[tuple, tuple[int, list[int]]] = {}
        self.buffer_limit = buffer_bytes  # None until measured (memory.settle_buffer_limit)
        self.buffered = 0  # bytes held by every layer's buffers
        self.unbuffered = False  # set for good once the buffers would pass the limit
        self._slots: tuple[tuple[int, ...], mx.array] | None = None

    def slots(self, starts: tuple[int, ...]) -> mx.array:
        """``starts`` as a (B, 1, 1, 1) index array, shared by the layers of one step."""
        if self._slots is None or self._slots[0] != starts:
            self._slots = (starts, mx.array(starts, dtype=mx.int32).reshape(-1, 1, 1, 1))
        return self._slots[1]


class RowsCache(LayerCache):
    """One model layer of a strategy batch: row ``i`` of every array is row ``i``'s own cache."""

    def __init__(self, rows: Sequence[LayerCache], expected: _Expected | None = None):
        if not rows:
            raise ValueError("RowsCache: give at least one row cache")
        self.rows = list(rows)
        self._expected = expected or _Expected()
        self._kind = tuple((type(c), getattr(c, "max_size", None)) for c in self.rows)
        self._buffers: list[mx.array | None] = [None, None]  # keys, values: (B, H, slots, D)
        self._held = [0] * len(self.rows)  # per row, the leading slots of the buffers that are its keys now
        self._written_at: int | None = None  # the rows' offset after the batch's last write of them

    @property
    def offset(self) -> int:
        offsets = {c.offset for c in self.rows}
        if len(offsets) != 1:
            raise ValueError(
                f"strategy batch: the rows have seen different token counts {sorted(offsets)}; they must "
                "advance together"
            )
        return self.rows[0].offset

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        masks, lengths = [], []
        for c in self.rows:
            m = c.make_mask(N, window_size=window_size, return_array=True)
            if isinstance(m, str):  # a cache answering "causal" anyway: keys end with the queries
                m = None if N == 1 else _causal_end(N, _next_length(c, N))
            if m is None:
                lengths.append(_next_length(c, N))
            else:
                if m.dtype != mx.bool_:
                    m = m > -1e30  # an additive mask: finite entries are visible
                lengths.append(m.shape[-1])
            masks.append(m)
        self._expected.by_kind[self._kind] = (self.offset, lengths)
        if all(m is None for m in masks) and len(set(lengths)) == 1:
            return None
        width = max(lengths)
        out = []
        for m, n in zip(masks, lengths):
            m = mx.ones((N, n), dtype=mx.bool_) if m is None else mx.broadcast_to(m.reshape(-1, n), (N, n))
            if n < width:
                m = mx.concatenate([m, mx.zeros((N, width - n), dtype=mx.bool_)], axis=1)
            out.append(m)
        return mx.stack(out)[:, None]  # (B, 1, N, L)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.shape[0] != len(self.rows):
            raise ValueError(
                f"strategy batch: the forward has {keys.shape[0]} rows but the batch holds {len(self.rows)} caches"
            )
        before = self.offset
        in_k = [keys[i : i + 1] for i in range(len(self.rows))]
        in_v = [values[i : i + 1] for i in range(len(self.rows))]
        out_k, out_v, lengths, writes = [], [], [], []
        for i, c in enumerate(self.rows):
            k, v = c.update_and_fetch(in_k[i], in_v[i])
            out_k.append(k)
            out_v.append(v)
            lengths.append(n := _length(k))
            writes.append(self._changed(i, c, k, n, before, keys))
        promised = self._expected.by_kind.get(self._kind)
        if promised is not None and promised[0] == before:
            if lengths != promised[1]:
                raise ValueError(
                    f"strategy batch: the rows returned {lengths} keys but their masks covered {promised[1]}; "
                    "run these strategies one by one"
                )
        elif len(set(lengths)) > 1:
            raise ValueError(
                f"strategy batch: the rows returned {lengths} keys and the model asked for no mask to hide the "
                "padding; "
                "run these strategies one by one"
            )
        width = max(lengths)
        if self._buffered(keys, values, width):
            return self._write(keys, values, in_k, in_v, out_k, out_v, lengths, writes, width)
        self._held = [0] * len(self.rows)
        fk = [_float(k, c, getattr(c, "key_bits", None), keys.dtype) for k, c in zip(out_k, self.rows)]
        fv = [_float(v, c, getattr(c, "value_bits", None), values.dtype) for v, c in zip(out_v, self.rows)]
        return _padded(fk, lengths, width), _padded(fv, lengths, width)

    def _buffered(self, keys: mx.array, values: mx.array, width: int) -> bool:
        """Whether this step writes into the layer's buffers (grown to ``width`` slots if need
        be), or, past the batch's byte limit, copies the rows into a padded batch (for good)."""
        shared = self._expected
        if shared.unbuffered:
            if self._buffers[0] is not None:  # another layer passed the limit: let this one's go too
                shared.buffered -= sum(x.nbytes for x in self._buffers)
                self._buffers = [None, None]
            return False
        buf = self._buffers[0]
        if buf is not None and buf.shape[2] >= width:
            return True
        slots = -(-width // STEP) * STEP
        b, h = keys.shape[0], keys.shape[1]
        size = b * h * slots * (keys.shape[3] * keys.dtype.size + values.shape[3] * values.dtype.size)
        held = 0 if buf is None else sum(x.nbytes for x in self._buffers)
        need = shared.buffered - held + size
        # MLX allocates from the machine's memory (unified with the GPU's on Apple silicon)
        shared.buffer_limit, allowed = memory.settle_buffer_limit(shared.buffer_limit, need, "cpu")
        if not allowed:
            shared.unbuffered = True
            shared.buffered -= held
            self._buffers = [None, None]
            return False
        grown = []
        for old, x in zip(self._buffers, (keys, values)):
            zeros = mx.zeros((b, h, slots - (0 if old is None else old.shape[2]), x.shape[3]), dtype=x.dtype)
            grown.append(zeros if old is None else mx.concatenate([old, zeros], axis=2))
        self._buffers = grown
        shared.buffered += size - held
        return True

    def _changed(self, i: int, c: LayerCache, k, n: int, before: int, keys: mx.array) -> tuple[int, int, bool]:
        """(start, end, verbatim): the slots of row ``i``'s returned keys/values that the buffers
        must take this step, and whether they are the row's input as given. The row's
        :attr:`~.base.LayerCache.written` says what its update changed against its last return,
        which the buffers hold in their first ``_held[i]`` slots when this batch made that return
        (the rows' offset is where the batch left it); anything else is a copy of the whole row."""
        w, held = c.written, self._held[i]
        if (
            w is None
            or self._written_at != before
            or not 0 <= w.start <= w.end <= n
            or w.start > held
            or (w.end < n and n > held)
        ):
            return 0, n, False
        verbatim = (
            w.verbatim
            and w.end - w.start == keys.shape[2]
            and not isinstance(k, (list, tuple))
            and k.dtype == keys.dtype
        )
        return w.start, w.end, verbatim

    def _write(self, keys, values, in_k, in_v, out_k, out_v, lengths, writes, width):
        """Write each row's changed slots into the buffers; their first ``width`` slots.

        A decode step where every row changed one slot writes each buffer once (one slice when
        the rows' slots line up, else one scatter); otherwise every row's slots are written in
        turn."""
        bk, bv = self._buffers
        parts = []  # per row, (keys, values) of its changed slots: its input, or what it handed back
        for k, v, c, (start, end, verbatim), x, y in zip(out_k, out_v, self.rows, writes, in_k, in_v):
            if verbatim or start == end:
                parts.append((x, y))
            else:
                fk = _float(_tokens(k, start, end), c, getattr(c, "key_bits", None), keys.dtype)
                fv = _float(_tokens(v, start, end), c, getattr(c, "value_bits", None), values.dtype)
                if getattr(c, "track_error", False):  # its error terms take these as the reconstruction
                    c._decoded(start, end, fk, fv)
                parts.append((fk, fv))
        if all(end - start == 1 for start, end, _ in writes):
            starts = tuple(start for start, _, _ in writes)
            if not all(verbatim for _, _, verbatim in writes):
                new_k = mx.concatenate([p[0] for p in parts], axis=0)
                new_v = mx.concatenate([p[1] for p in parts], axis=0)
            else:  # every row's token as it came in
                new_k, new_v = keys, values
            if len(set(starts)) == 1:
                bk[:, :, starts[0] : starts[0] + 1, :] = new_k
                bv[:, :, starts[0] : starts[0] + 1, :] = new_v
            else:
                slots = self._expected.slots(starts)
                bk = mx.put_along_axis(bk, slots, new_k, axis=2)
                bv = mx.put_along_axis(bv, slots, new_v, axis=2)
                self._buffers = [bk, bv]
        else:
            for i, (part, (start, end, _)) in enumerate(zip(parts, writes)):
                if start < end:
                    bk[i : i + 1, :, start:end, :] = part[0]
                    bv[i : i + 1, :, start:end, :] = part[1]
        self._held = list(lengths)
        self._written_at = self.offset
        if width == bk.shape[2]:
            return bk, bv
        return bk[..., :width, :], bv[..., :width, :]

    def size(self) -> int:
        return max(c.size() for c in self.rows)

    def empty(self) -> bool:
        return all(c.empty() for c in self.rows)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.rows)

    def is_trimmable(self) -> bool:
        return False


def make_rows_cache(caches: Sequence[Sequence[LayerCache]], buffer_bytes: int | None = None) -> list[RowsCache]:
    """The cache list for one forward whose row ``i`` advances the whole-model cache
    ``caches[i]``; each must pass :func:`batch_problem` and all must have the same layer count.
    ``buffer_bytes``: the most the layers' key/value buffers may hold together (0: none, every
    layer copies its rows into a padded batch each step; None: the limit
    :func:`~cachelib.core.memory.batch_buffer_limit` gives for the memory available when the
    buffers first need more than its floor)."""
    memory.check_buffer_bytes(buffer_bytes, "make_rows_cache")
    if not caches:
        raise ValueError("make_rows_cache: give at least one whole-model cache (one per row)")
    layers = {len(c) for c in caches}
    if len(layers) != 1:
        raise ValueError(f"make_rows_cache: the caches have different layer counts {sorted(layers)}")
    for row, cache in enumerate(caches):
        problem = batch_problem(cache)
        if problem:
            raise ValueError(f"make_rows_cache: row {row}: {problem}")
    expected = _Expected(buffer_bytes)
    return [RowsCache([c[layer] for c in caches], expected) for layer in range(layers.pop())]


def row_states(rows: Sequence[RowsCache]) -> list:
    """Every row cache's state, to evaluate with each forward of the batch ``rows``: a row whose
    new slots the batch writes from its input is read by nothing else that forward evaluates,
    and its updates would pile up unevaluated step after step."""
    return [c.state for layer in rows for c in layer.rows]


def _next_length(c: LayerCache, n: int) -> int:
    """Keys ``c`` returns after an update of ``n`` tokens whose mask is all-visible."""
    view = c.introspect()
    held = view.tokens_held + n
    return held if view.max_capacity is None else min(held, view.max_capacity)


def _causal_end(n: int, length: int) -> mx.array:
    key = mx.arange(length)[None]
    query = mx.arange(length - n, length)[:, None]
    return key <= query


def _length(x) -> int:
    """Tokens in a returned key or value array, or in a quantized (packed, scales, biases) triple."""
    return (x[0] if isinstance(x, (list, tuple)) else x).shape[2]


def _tokens(x, start: int, end: int):
    """Tokens ``[start, end)`` of a returned array or quantized triple (the whole when it is that)."""
    if start == 0 and end == _length(x):
        return x
    if isinstance(x, (list, tuple)):
        return [p[..., start:end, :] for p in x]
    return x[..., start:end, :]


def _float(x, cache: LayerCache, bits: int | None, dtype) -> mx.array:
    """``x`` as float: a quantized (packed, scales, biases) triple is dequantized."""
    if isinstance(x, (list, tuple)):
        out = dequantize(x, cache.group_size, bits)
        return out if out.dtype == dtype else out.astype(dtype)
    return x


def _padded(parts: list[mx.array], lengths: list[int], width: int) -> mx.array:
    if all(n == width for n in lengths):
        return mx.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
    padded = [p if n == width else mx.pad(p, [(0, 0), (0, 0), (0, width - n), (0, 0)]) for p, n in zip(parts, lengths)]
    return mx.concatenate(padded, axis=0)


def _a(name: str) -> str:
    """``name`` with its indefinite article (a KVCache, an ImportanceKVCache)."""
    return f"{'an' if name[:1].upper() in 'AEIOU' else 'a'} {name}"
