"""What every cachelib.torch attention layer shares: the transformers layer protocol, held-array
bookkeeping (bytes, device moves for offloading, batch reindexing) and crop argument checks.

A layer holds its K/V as plain tensors or, when quantized, as (codes, scales, biases) triples;
every array keeps the token axis at -2 and the batch axis at 0, so one set of helpers moves,
slices and reindexes both. This module knows nothing of strategies, models or masks.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Callable, Iterator, NamedTuple, Union

import torch
from transformers.cache_utils import CacheLayerMixin

from ..introspect import CacheView, QuantError, Written

Arrays = Union[torch.Tensor, tuple[torch.Tensor, ...]]


def each(x: Arrays, fn: Callable[[torch.Tensor], torch.Tensor]) -> Arrays:
    """Apply ``fn`` to a tensor or to every tensor of a quantized triple."""
    if isinstance(x, tuple):
        return tuple(fn(t) for t in x)
    return fn(x)


def cat(parts: list[Arrays]) -> Arrays:
    """Concatenate along the token axis (-2), tensors or triples alike."""
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(group, dim=-2) for group in zip(*parts))
    return torch.cat(parts, dim=-2)


def tokens(x: Arrays | None) -> int:
    """Length of the token axis (0 when nothing is held)."""
    if x is None:
        return 0
    return (x[0] if isinstance(x, tuple) else x).shape[-2]


def nbytes(x: Arrays | None) -> int:
    if x is None:
        return 0
    if isinstance(x, tuple):
        return sum(t.nbytes for t in x)
    return x.nbytes


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class CropError(ValueError, RuntimeError):
    """A crop the layer cannot do. A ``ValueError`` like every refusal of ours, and the
    ``RuntimeError`` transformers raises for the same refusals (a full window or a recurrent
    state without past recording, a positive count), so code written for either catches it."""


class CacheFullError(ValueError, IndexError):
    """New tokens that do not fit a static layer. A ``ValueError`` like every refusal of ours,
    and the ``IndexError`` transformers' ``StaticLayer`` raises when it writes past its end."""


# The keywords transformers' caches pass when they build a layer from a model config
# (``get_layer_types_and_kwargs``, ``StaticCache``). Its layers take ``**kwargs`` and ignore
# what they do not use; ours ignore these and refuse any other (a typo is not swallowed).
LAYER_KEYWORDS = ("sliding_window", "max_cache_len", "number_of_states", "config")


def check_ignored_keywords(where: str, ignored: dict) -> None:
    """Refuse keywords beyond :data:`LAYER_KEYWORDS` (those a layer accepts and ignores)."""
    unknown = sorted(set(ignored) - set(LAYER_KEYWORDS))
    if unknown:
        raise TypeError(
            f"{where}() got unexpected keyword argument(s) {', '.join(unknown)}; a layer accepts "
            f"and ignores {', '.join(LAYER_KEYWORDS)} (what transformers' caches pass to every layer)"
        )


def check_crop(tokens_to_remove: int, held: int, where: str) -> int:
    """Validate transformers' ``crop(tokens_to_remove)`` argument; returns how many to remove:
    at most the ``held`` tokens (cropping more empties the layer, as in transformers)."""
    if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
        raise CropError(f"{where}.crop: tokens_to_remove must be an int <= 0, got {tokens_to_remove!r}")
    if tokens_to_remove > 0:
        raise CropError(
            f"{where}.crop: tokens_to_remove={tokens_to_remove} must be <= 0 "
            "(a negative number of tokens to drop from the end)"
        )
    return min(-tokens_to_remove, held)


class AttentionLayer(CacheLayerMixin):
    """Base of our attention layers: transformers' layer protocol plus introspection.

    Subclasses list the attributes that hold arrays in ``_arrays``; offloading, batch reindexing
    and byte counting work from that list.
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False
    kind: str | None = None  # the strategy name introspect() reports; None: the class name
    _arrays: tuple[str, ...] = ("keys", "values")
    # What the last update changed in what it handed back, against what the update before handed
    # back (a strategy batch writes only that); None: not known, every slot may have changed.
    written: Written | None = None

    def __init__(self):
        self.keys = None
        self.values = None
        self.is_initialized = False
        self.device = None

    def __repr__(self):
        return f"{type(self).__name__}()"

    # --- held arrays ---------------------------------------------------------------------------

    def held_arrays(self) -> Iterator[torch.Tensor]:
        """Every tensor this layer holds (what ``nbytes`` counts)."""
        for name in self._arrays:
            x = getattr(self, name)
            if x is None:
                continue
            yield from (x if isinstance(x, tuple) else (x,))

    @property
    def nbytes(self) -> int:
        return sum(nbytes(getattr(self, name)) for name in self._arrays)

    def _map_arrays(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name in self._arrays:
            x = getattr(self, name)
            if x is not None:
                setattr(self, name, each(x, fn))

    @property
    def batch_size(self) -> int | None:
        for t in self.held_arrays():
            return t.shape[0]
        return None

    # --- transformers protocol: devices and batch ----------------------------------------------

    def offload(self) -> None:
        """Move this layer's arrays to the CPU (a no-op for arrays already there)."""
        if self.is_initialized:
            self._map_arrays(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        """Move this layer's arrays back to the device they were created on."""
        if self.is_initialized and self.device is not None:
            device = torch.device(self.device)
            self._map_arrays(lambda t: t if t.device == device else t.to(device, non_blocking=True))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length() > 0:
            self._map_arrays(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            self._map_arrays(lambda t: t[indices, ...])

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            self._map_arrays(lambda t: t.repeat_interleave(repeats, dim=0))

    def get_max_length(self) -> int:
        return -1

    # --- a strategy batch: what changed ------------------------------------------------------

    def update_changed(self, key_states, value_states, held: int, need: int):
        """``update``, handing back only what a holder of its last return lacks: ``(start, keys,
        values, length)``, where ``keys``/``values`` are slots ``[start, start + n)`` of the
        ``length`` slots ``update`` returns; with the first ``held`` slots of the last return
        kept, they make the first ``need`` slots of this one. Layers whose return is costly to
        build (dequantized) override it to build only those slots."""
        keys, values = self.update(key_states, value_states)
        length = keys.shape[-2]
        start, end = changed_slots(self.written, held, need, length)
        return start, keys[..., start:end, :], values[..., start:end, :], length

    # --- introspection -------------------------------------------------------------------------

    @abstractmethod
    def introspect(self) -> CacheView:
        """What this layer holds now (cheap: built from integers and array shapes)."""

    def _view(self, **fields) -> CacheView:
        """A CacheView with the fields every layer fills the same way."""
        fields.setdefault("kind", self.kind or type(self).__name__)
        fields.setdefault("bytes_allocated", self.nbytes)
        fields.setdefault("batch_size", self.batch_size or 1)
        return CacheView(**fields)


def changed_slots(written: Written | None, held: int, need: int, length: int) -> tuple[int, int]:
    """Slots ``[start, end)`` of an update's ``length`` returned slots that a holder of the first
    ``held`` slots of the previous return must take to have the first ``need`` (``written``: what
    the update changed; anything unknown or not covered makes it all of them)."""
    need = min(need, length)
    w = written
    if w is None or not 0 <= w.start <= w.end <= length or w.start > held or need > max(held, w.end):
        return 0, need
    return min(w.start, need), min(w.end, need)


class QuantErrorProbe:
    """The ``track_error`` switch of quantizing layers (off by default, zero work when off).

    A small update's error (a decode step's few tokens) is computed only when read, and
    :func:`resolve_errors` computes those of many layers together: some twenty small ops and
    six host reads a layer were the probe's cost, not their arithmetic. A large update's (a
    prefill chunk) is computed at once, so its inputs are not held into the next forward."""

    track_error = False
    _last_error: QuantError | None = None
    _pending_error: list | None = None  # [(x, x_hat), (x, x_hat)] of keys and values, flattened

    def _record_error(self, pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """Set the error of this update from (keys, keys_hat, values, values_hat) chunks; called
        only when ``track_error`` is on (``[]``: the update quantized nothing)."""
        self._last_error = self._pending_error = None
        if not pairs:
            return
        if len(pairs) > 1:  # several chunks: their reconstructions are made now, and joined
            pairs = [tuple(_dense(t) for t in p) for p in pairs]
            flat = [torch.cat([p[i].flatten() for p in pairs]) for i in range(4)]
        else:
            flat = [t if isinstance(t, Dequantized) else t.flatten() for t in pairs[0]]
        self._pending_error = [(flat[0], flat[1]), (flat[2], flat[3])]
        if flat[0].numel() > DEFERRED_ERROR_ELEMENTS:
            resolve_errors([self])

    @property
    def quant_error(self) -> QuantError | None:
        if not self.track_error:
            return None
        if self._pending_error is not None:
            resolve_errors([self])
        return self._last_error


DEFERRED_ERROR_ELEMENTS = 1 << 16  # an update of more key elements has its error computed at once


class Dequantized(NamedTuple):
    """The reconstruction ``quantizer.dequantize(packed)`` of an update's new tokens, made only
    when its error is computed: :func:`resolve_errors` dequantizes those of one quantizer and
    shape together, one call for every layer instead of one each (the values are the same, bit
    for bit: dequantization works element by element)."""

    quantizer: Any
    packed: tuple[torch.Tensor, ...]


def dequantized(codec, stored) -> "torch.Tensor | Dequantized":
    """What ``codec.dense(stored)`` gives, deferred where the codec quantizes with a
    :class:`~.quantizer.Quantizer` (for :meth:`QuantErrorProbe._record_error`)."""
    quantizer = getattr(codec, "quantizer", None)
    if quantizer is not None and isinstance(stored, tuple):
        return Dequantized(quantizer, stored)
    return codec.dense(stored)


def _dense(t) -> torch.Tensor:
    return t.quantizer.dequantize(t.packed) if isinstance(t, Dequantized) else t


def _dense_all(items: list) -> None:
    """Replace the :class:`Dequantized` reconstructions among ``items`` (``[slot, j, x, x_hat]``)
    by their values, one dequantization per quantizer and packed shapes (flattened as before)."""
    groups: dict[tuple, list] = {}
    for it in items:
        t = it[3]
        if isinstance(t, Dequantized):
            codes, scales, _ = t.packed  # the biases match the scales
            key = (t.quantizer, codes.shape, codes.device, scales.shape, scales.dtype)
            groups.setdefault(key, []).append(it)
    for group in groups.values():
        quantizer = group[0][3].quantizer
        if len(group) == 1:
            group[0][3] = quantizer.dequantize(group[0][3].packed).flatten()
            continue
        parts = tuple(torch.stack([it[3].packed[i] for it in group]) for i in range(3))
        for it, row in zip(group, quantizer.dequantize(parts).reshape(len(group), -1).unbind(0)):
            it[3] = row


def resolve_errors(layers) -> None:
    """Compute the pending quantization error of every one of ``layers`` (those without one are
    skipped): the reconstructions still to make are dequantized together (:class:`Dequantized`),
    the keys and values of equal size are stacked, one set of reductions in float64 and one host
    read per size, the same formula as :func:`.quantizer.quant_error_of`."""
    groups: dict[tuple, list] = {}
    pending = []
    items = []
    for layer in layers:
        pairs = getattr(layer, "_pending_error", None)
        if pairs is None:
            continue
        layer._pending_error = None
        slot = [0.0, 0.0, 0.0, 0.0]
        pending.append((layer, slot))
        for j, (x, x_hat) in enumerate(pairs):
            it = [slot, j, x, x_hat]
            items.append(it)
            groups.setdefault((x.numel(), x.device), []).append(it)
    _dense_all(items)
    for (numel, _), group in groups.items():
        if numel == 0:  # nothing quantized: the slots' zeros stand
            continue
        x = torch.stack([it[2] for it in group]).double()
        diff = torch.stack([it[3] for it in group]).double() - x
        terms = torch.stack(
            [torch.linalg.vector_norm(x, dim=1), torch.linalg.vector_norm(diff, dim=1), diff.abs().amax(dim=1)], 1
        )
        for (slot, j, _, _), (norm, err, worst) in zip(group, terms.tolist()):
            slot[2 * j], slot[2 * j + 1] = (err / norm if norm > 0 else 0.0), worst
    for layer, slot in pending:
        layer._last_error = QuantError(*slot)
