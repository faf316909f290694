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
    :func:`resolve_errors` computes those of many layers together: a few ops per quantizer
    configuration and shape for every layer of every cache, not a few per layer (the probe's
    cost is the ops' dispatch, not their arithmetic). A large update's (a prefill chunk) is
    computed at once, so its inputs are not held into the next forward."""

    track_error = False
    _last_error: QuantError | None = None
    # [(x, x_hat, terms)]: the update's keys then values, one term of the error each (terms 1)
    # or both stacked on x's first axis (terms 2); x_hat: x's reconstruction, or Dequantized
    _pending_error: list | None = None

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
            flat = pairs[0]
        self._pending_error = [(flat[0], flat[1], 1), (flat[2], flat[3], 1)]
        if flat[0].numel() > DEFERRED_ERROR_ELEMENTS:
            resolve_errors([self])

    def _record_stacked(self, x: torch.Tensor, x_hat: "torch.Tensor | Dequantized") -> None:
        """Set the error of this update from its keys and values stacked on a new first axis
        (``torch.stack((keys, values))``, as quantized together) and their reconstruction of
        the same shape: no op at all here, the stack is the one the quantizer took."""
        self._last_error = None
        self._pending_error = [(x, x_hat, 2)]
        if x.numel() > 2 * DEFERRED_ERROR_ELEMENTS:
            resolve_errors([self])

    def _decoded(self, start: int, keys_hat, values_hat, key_states, value_states) -> None:
        """``update_changed`` decoded slots ``[start, start + n)`` for its caller (``keys_hat``,
        ``values_hat``): where those are exactly this update's ``key_states``/``value_states``
        as stored (the slots it wrote, nothing else), the pending error takes them as the
        reconstruction instead of dequantizing the same codes again (the same values, bit for
        bit: dequantization works element by element). Such updates, of every layer and every
        quantizer configuration, then share one stack and one set of reductions in
        :func:`resolve_errors`."""
        pending, w = self._pending_error, self.written
        n = key_states.shape[-2]
        if not pending or w is None or (w.start, w.end) != (start, start + n):
            return
        if keys_hat.shape != key_states.shape or values_hat.shape != value_states.shape:
            return
        if len(pending) == 1:  # keys and values quantized in one pass
            x, x_hat, terms = pending[0]
            if terms != 2 or not isinstance(x_hat, Dequantized) or x.shape[-2] != n:
                return
        elif not all(isinstance(x_hat, Dequantized) and x.shape[-2] == n for x, x_hat, _ in pending):
            return
        self._pending_error = Decoded(key_states, keys_hat, value_states, values_hat)

    @property
    def quant_error(self) -> QuantError | None:
        if not self.track_error:
            return None
        if self._pending_error is not None:
            resolve_errors([self])
        return self._last_error


DEFERRED_ERROR_ELEMENTS = 1 << 16  # an update of more key elements has its error computed at once


class Decoded(NamedTuple):
    """A pending error whose reconstruction is at hand (:meth:`QuantErrorProbe._decoded`): the
    update's keys and values, and their reconstructions, of the same shapes."""

    keys: torch.Tensor
    keys_hat: torch.Tensor
    values: torch.Tensor
    values_hat: torch.Tensor


class Dequantized(NamedTuple):
    """The reconstruction ``quantizer.dequantize(packed)`` of an update's new tokens, made only
    when its error is computed: :func:`resolve_errors` dequantizes those of one quantizer
    configuration and shape together, one call for every layer instead of one each (the values
    are the same, bit for bit: dequantization works element by element)."""

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


def _dequantize_key(t: Dequantized) -> tuple:
    codes, scales, _ = t.packed  # the biases match the scales
    q = t.quantizer
    return (q.bits, q.group_size, codes.shape, scales.shape, scales.dtype)


def _terms(pending: list, n: int) -> None:
    """Fill the slots of ``pending`` (``[(x, x_hat, slot, first)]`` of equal ``x.shape``, dtype
    and device, each ``x`` ``n`` terms of the error) with (relative RMS, max abs) in float64, one
    host read: the x stacked once, the reconstructions dequantized once per quantizer
    configuration and packed shape, then joined in the same order."""
    order, blocks = [], []
    deferred: dict[tuple, list] = {}
    plain = []
    for it in pending:
        t = it[1]
        if isinstance(t, Dequantized):
            deferred.setdefault(_dequantize_key(t), []).append(it)
        else:
            plain.append(it)
    shape = pending[0][0].shape
    for group in deferred.values():
        quantizer = group[0][1].quantizer
        if len(group) == 1:
            block = quantizer.dequantize(group[0][1].packed)
        else:
            block = quantizer.dequantize(tuple(torch.stack([it[1].packed[i] for it in group]) for i in range(3)))
        blocks.append(block.reshape(len(group) * n, -1))
        order += group
    if plain:
        stacked = torch.stack([it[1] if it[1].shape == shape else it[1].reshape(shape) for it in plain])
        blocks.append(stacked.view(len(plain) * n, -1))
        order += plain
    rows = len(order) * n
    x = torch.stack([it[0] for it in order]).view(rows, -1).double()
    # every block is a fresh tensor (a stack, a dequantization, a join): subtracted in place
    diff = (blocks[0] if len(blocks) == 1 else torch.cat(blocks)).double().sub_(x)
    norm = torch.linalg.vector_norm  # (its inf-norm is ~10x slower than abs and amax on CPU)
    terms = torch.stack([norm(x, dim=1), norm(diff, dim=1), diff.abs().amax(dim=1)], 1).tolist()
    i = 0
    for _, _, slot, first in order:
        for j in range(first, first + n):
            norm, err, worst = terms[i]
            slot[2 * j], slot[2 * j + 1] = (err / norm if norm > 0 else 0.0), worst
            i += 1


def resolve_errors(layers) -> None:
    """Compute the pending quantization error of every one of ``layers`` (those without one are
    skipped): the updates of equal shape are stacked (keys and values together where they were
    quantized together), their reconstructions still to make dequantized together
    (:class:`Dequantized`), one set of reductions in float64 and one host read per shape, the
    same formula as :func:`.quantizer.quant_error_of`; those whose reconstruction a strategy
    batch decoded already (:class:`Decoded`) in one stack per shape, whatever their width."""
    groups: dict[tuple, list] = {}
    decoded: dict[tuple, list] = {}
    done = []
    for layer in layers:
        pairs = getattr(layer, "_pending_error", None)
        if pairs is None:
            continue
        layer._pending_error = None
        if type(pairs) is Decoded:  # keys and values each one term, their reconstructions made
            k = pairs.keys
            decoded.setdefault((k.shape, pairs.values.shape, k.dtype, k.device), []).append((layer, pairs))
            continue
        slot = [0.0, 0.0, 0.0, 0.0]
        done.append((layer, slot))
        first = 0
        for x, x_hat, n in pairs:
            if x.numel():  # nothing quantized: the slots' zeros stand
                groups.setdefault((x.shape, n, x.dtype, x.device), []).append((x, x_hat, slot, first))
            first += n
    for (_, n, _, _), pending in groups.items():
        _terms(pending, n)
    for layer, slot in done:
        layer._last_error = QuantError(*slot)
    for (key_shape, value_shape, _, _), group in decoded.items():
        _decoded_terms(group, key_shape == value_shape)


def _decoded_terms(group: list, same: bool) -> None:
    """Set the error of every layer of ``group`` (``[(layer, Decoded)]`` of equal shapes, dtype
    and device; ``same``: keys and values of one shape too, then stacked together): one stack of
    the inputs and their reconstructions, one set of float64 reductions, one host read."""
    if same:  # [k0, v0, k1, v1, ...] then their reconstructions in the same order
        x = [t for _, d in group for t in (d.keys, d.values)]
        y = torch.stack(x + [t for _, d in group for t in (d.keys_hat, d.values_hat)])
        y = y.view(2, len(x), -1).double()
        terms = _reduced(y[0], y[1].sub_(y[0]))
        key_terms, value_terms = terms[0::2], terms[1::2]
    else:

        def terms_of(i: int) -> list:  # keys (0) or values (2) against their reconstructions (i + 1)
            x = torch.stack([d[i] for _, d in group]).view(len(group), -1).double()
            return _reduced(x, torch.stack([d[i + 1] for _, d in group]).view(len(group), -1).double().sub_(x))

        key_terms, value_terms = terms_of(0), terms_of(2)
    for (layer, _), (kn, ke, kw), (vn, ve, vw) in zip(group, key_terms, value_terms):
        layer._last_error = QuantError(ke / kn if kn > 0 else 0.0, kw, ve / vn if vn > 0 else 0.0, vw)


def _reduced(x: torch.Tensor, diff: torch.Tensor) -> list:
    """Per row of ``x`` (rows, n) and its reconstruction's ``diff``: (||x||, ||diff||, max |diff|)."""
    norm = torch.linalg.vector_norm  # (its inf-norm is ~10x slower than abs and amax on CPU)
    return torch.stack([norm(x, dim=1), norm(diff, dim=1), diff.abs().amax(dim=1)], 1).tolist()
