"""Group-wise quantized KV storage: :class:`QuantizedKVCache` and the quantization helpers the
quantizing caches share (argument checks, packed sizes, the error probe).

A quantized array is stored as mx.quantize's three parts, each with the token axis at 2:
``packed`` uint32 ``(B, H, T, D * bits / 32)``, ``scales`` and ``biases`` ``(B, H, T, D / group)``
in the dtype of the incoming keys. When keys and values share one width, the cache exposes
``bits`` and hands the parts to mlx-lm's quantized attention; when they differ (beyond mlx-lm),
it has no ``bits`` attribute and hands back dequantized arrays, so the standard attention runs.

Beyond mlx-lm, ``start=N`` keeps full precision until ``N`` tokens are held and then converts
the cache in place, exactly when mlx-lm's ``--quantized-kv-start`` would swap in a
``QuantizedKVCache``.
"""

from __future__ import annotations

import math
from functools import partial

import mlx.core as mx

from ..core.units import STEP
from ..introspect import CacheView, QuantError
from ..spec import GROUP_SIZES, QUANT_BITS
from .base import (
    HeldInOrder,
    LayerCache,
    Written,
    array_bytes,
    check_int,
    check_kv_pair,
    dtype_name,
    grow,
    per_token_bytes,
    token_length,
    write_linear,
)

# --- checks and helpers shared by every quantizing cache -------------------------------------


def check_bits(name: str, bits, where: str) -> int:
    if isinstance(bits, bool) or bits not in QUANT_BITS:
        raise ValueError(f"{where}: {name}={bits!r} is not supported; allowed: {', '.join(map(str, QUANT_BITS))}")
    return int(bits)


def check_group_size(group_size, where: str) -> int:
    if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        raise ValueError(
            f"{where}: group_size={group_size!r} is not supported; allowed: {', '.join(map(str, GROUP_SIZES))}"
        )
    return int(group_size)


def check_head_dim(head_dim: int, group_size: int, where: str) -> None:
    if head_dim % group_size:
        divisors = [g for g in GROUP_SIZES if head_dim % g == 0]
        raise ValueError(
            f"{where}: group_size={group_size} does not divide the head dimension head_dim={head_dim}; "
            f"allowed group sizes for it: {', '.join(map(str, divisors)) or 'none'}"
        )


def quantize(x: mx.array, group_size: int, bits: int) -> list[mx.array]:
    return mx.quantize(x, group_size=group_size, bits=bits)


def dequantize(parts, group_size: int, bits: int) -> mx.array:
    """``mx.dequantize`` of ``parts``; on the CPU, for 2, 4 and 8 bits, by :func:`_unpacked`
    (the same values bit for bit, in a fraction of the time)."""
    packed, scales, biases = parts
    if _unpacks(bits, group_size, scales.dtype):
        return _unpacked(packed, scales, biases, group_size, bits)
    return mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits)


def _unpacked(packed: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    """``mx.dequantize`` of a 2-, 4- or 8-bit triple by elementwise ops: the same values bit for
    bit (``w * scale + bias`` in the scales' dtype) in a third to a half of the CPU time of
    MLX's CPU kernel. A code of ``bits`` bits never straddles a byte; codes sit LSB first. The
    ops after the byte view are one compiled, shape-free graph per width (one fused op a call
    instead of eight, whatever the token count)."""
    # a shape-free graph keeps the shapes it was traced with only where it is told them: the
    # group count (head size / group size) and the rank are part of its key
    key = (group_size, bits, scales.shape[-1], scales.ndim)
    fn = _UNPACK_FNS.get(key)
    if fn is None:
        fn = _UNPACK_FNS[key] = mx.compile(
            partial(_unpack_bytes, groups=key[2], group_size=group_size, bits=bits), shapeless=True
        )
    return fn(packed.view(mx.uint8), scales, biases)  # (..., T, D * bits / 8) bytes


def _unpack_bytes(
    codes: mx.array, scales: mx.array, biases: mx.array, groups: int, group_size: int, bits: int
) -> mx.array:
    per_byte = 8 // bits
    if per_byte > 1:  # (..., T, bytes) -> (..., T, bytes * per_byte) codes
        shifts = mx.array([bits * i for i in range(per_byte)], dtype=mx.uint8)
        codes = mx.flatten((codes[..., None] >> shifts) & ((1 << bits) - 1), -2, -1)
    w = mx.unflatten(codes, -1, (groups, group_size)).astype(scales.dtype)
    return mx.flatten(w * scales[..., None] + biases[..., None], -2, -1)


_UNPACK_FNS: dict[tuple[int, int, int, int], object] = {}
_UNPACKS: dict[tuple, bool] = {}


def _unpacks(bits: int, group_size: int, dtype) -> bool:
    """Whether :func:`_unpacked` serves this width: on the CPU only (a GPU has a fast kernel),
    for widths whose codes never straddle a byte, and once checked bit-equal to
    ``mx.dequantize`` on random codes of this dtype (so a change of MLX's packing falls back)."""
    if bits not in (2, 4, 8) or mx.default_device() != mx.cpu:
        return False
    key = (bits, group_size, str(dtype))
    if key not in _UNPACKS:
        x = mx.random.normal((1, 2, 16, 2 * group_size), key=mx.random.key(0)).astype(dtype)
        parts = mx.quantize(x, group_size=group_size, bits=bits)
        same = mx.array_equal(
            _unpacked(*parts, group_size, bits), mx.dequantize(*parts, group_size=group_size, bits=bits)
        )
        _UNPACKS[key] = bool(same.item())
    return _UNPACKS[key]


def _error_terms(x: mx.array, parts, group_size: int, bits: int) -> mx.array:
    return _hat_error_terms(x, dequantize(parts, group_size, bits))


def _hat_error_terms(x: mx.array, x_hat: mx.array) -> mx.array:
    """``[sum sq error, sum sq x, max abs error]`` of the reconstruction ``x_hat`` of ``x``."""
    x = x.astype(mx.float32)
    diff = x_hat.astype(mx.float32) - x
    return mx.stack([mx.sum(diff * diff), mx.sum(x * x), mx.max(mx.abs(diff))])


def _stacked_hat_error_terms(x: mx.array, x_hat: mx.array) -> mx.array:
    """``(N, 3)`` error terms of N reconstructions stacked on a new leading axis."""
    axes = tuple(range(1, x.ndim))
    x = x.astype(mx.float32)
    diff = x_hat.astype(mx.float32) - x
    return mx.stack([mx.sum(diff * diff, axis=axes), mx.sum(x * x, axis=axes), mx.max(mx.abs(diff), axis=axes)], axis=1)


def _stacked_error_terms(x: mx.array, packed, scales, biases, group_size: int, bits: int) -> mx.array:
    """``(N, 3)`` error terms of N quantizations stacked on a new leading axis."""
    return _stacked_hat_error_terms(x, dequantize((packed, scales, biases), group_size, bits))


_STACKED_FNS: dict[tuple, object] = {}


class _Stack:
    """The ``(N, 3)`` error terms of N :class:`Terms` computed as one array, read once."""

    __slots__ = ("array", "rows")

    def __init__(self, array: mx.array):
        self.array: mx.array | None = array
        self.rows: list[list[float]] | None = None

    def read(self) -> list[list[float]]:
        if self.rows is None:
            self.rows, self.array = self.array.tolist(), None
        return self.rows


class Terms:
    """The error terms ``[sum sq error, sum sq x, max abs error]`` of ``parts`` reconstructing
    ``x``, computed only when read: a profiled decode step records two per quantizing layer, and
    :func:`stage_terms` builds all of a step's together (one stacked graph per width and shape
    instead of some ten small ops each, whose dispatch, not their arithmetic, was the probe's
    cost on a CPU), for the forward's own evaluation to compute. Holds the update's own new keys
    or values until then."""

    __slots__ = ("x", "parts", "x_hat", "group_size", "bits", "array", "stack", "index", "floats")

    def __init__(self, x=None, parts=None, group_size: int = 0, bits: int = 0, array: mx.array | None = None):
        self.x, self.parts, self.group_size, self.bits = x, parts, group_size, bits
        self.x_hat: mx.array | None = None  # the parts' reconstruction, where a batch made it already
        self.array = array  # the lazy (3,) terms once built alone
        self.stack: _Stack | None = None  # or row ``index`` of a stack of them
        self.index = 0
        self.floats: list[float] | None = None  # their values once read

    def built(self) -> mx.array:
        if self.array is None:
            if self.stack is not None:
                rows = self.stack.rows
                self.array = mx.array(rows[self.index]) if rows is not None else self.stack.array[self.index]
            elif self.x_hat is not None:
                self.array = _hat_error_terms(self.x, self.x_hat)
                self.x = self.x_hat = None
            else:
                self.array = _error_terms(self.x, self.parts, self.group_size, self.bits)
                self.x = self.parts = None
        return self.array

    def values(self) -> list[float]:
        if self.floats is None:
            self.floats = self.stack.read()[self.index] if self.stack is not None else self.built().tolist()
        return self.floats


def error_terms(x: mx.array, parts, group_size: int, bits: int) -> Terms:
    """The error terms of ``parts`` reconstructing ``x`` (nothing is computed yet)."""
    return Terms(x, list(parts), group_size, bits)


def stage_terms(terms: list[Terms]) -> list[mx.array]:
    """Build, without computing, the graphs that give every unread one of ``terms``: terms of
    one width and one shape are stacked and computed together (a decode step's one-token terms
    by one compiled graph per width; a prefill chunk's uncompiled, its length varying). Returns
    the arrays to evaluate, which a forward evaluates with its logits (one evaluation, not two)."""
    groups: dict[tuple, list[Terms]] = {}
    out: list[mx.array] = []
    for t in terms:
        if t.floats is not None:
            continue
        if t.stack is not None:
            if t.stack.array is not None:
                out.append(t.stack.array)
            continue
        if t.array is not None:
            out.append(t.array)
            continue
        if t.x_hat is not None:  # reconstructions made by a strategy batch: one group whatever the width
            key = (0, 0, t.x.shape, t.x.dtype, t.x_hat.dtype)
        else:
            # the parts' shapes follow from x's, the group size and the width (mx.quantize's), and
            # the biases' dtype is the scales': x and the scales' dtype name a group
            key = (t.group_size, t.bits, t.x.shape, t.x.dtype, t.parts[1].dtype)
        groups.setdefault(key, []).append(t)
    for key, group in groups.items():
        if len(group) == 1:
            out.append(group[0].built())
            continue
        gs, bits = key[0], key[1]
        # one-row arrays join along their batch axis: one copy each, where a stack adds a reshape per array
        join = mx.concatenate if group[0].x.shape[0] == 1 else mx.stack
        x = join([t.x for t in group])
        if gs == 0:  # the reconstructions made already
            args = (x, join([t.x_hat for t in group]))
            terms_of = _stacked_hat_error_terms
        else:
            args = (x, *(join([t.parts[i] for t in group]) for i in range(3)))
            _unpacks(bits, gs, args[2].dtype)  # its one-off check runs outside the compiled graph
            terms_of = partial(_stacked_error_terms, group_size=gs, bits=bits)
        if x.shape[-2] == 1:  # a decode step: the same shapes every step, one compiled graph
            fn = _STACKED_FNS.get((gs, bits))
            if fn is None:
                fn = _STACKED_FNS[(gs, bits)] = mx.compile(terms_of)
        else:  # a prefill chunk's length varies: a compiled graph per length would pile up
            fn = terms_of
        stack = _Stack(fn(*args))
        for i, t in enumerate(group):
            t.stack, t.index, t.x, t.parts, t.x_hat = stack, i, None, None, None
        out.append(stack.array)
    return list({id(a): a for a in out}.values())


def resolve_terms(terms: list[Terms]) -> None:
    """Read the values of every one of ``terms`` with at most one evaluation (none when a
    forward already computed what :func:`stage_terms` built)."""
    arrays = stage_terms(terms)
    if arrays:
        mx.eval(arrays)
    for t in terms:
        t.values()


def merge_terms(a: Terms | None, b: Terms) -> Terms:
    if a is None:
        return b
    x, y = a.built(), b.built()
    return Terms(array=mx.concatenate([x[:2] + y[:2], mx.maximum(x[2:], y[2:])]))


def to_quant_error(terms) -> QuantError | None:
    """The record of an update's error terms (reads two tiny arrays: only with track_error)."""
    if terms is None:
        return None
    k, v = (t.values() for t in terms)

    def rel(t):
        return math.sqrt(t[0]) / math.sqrt(t[1]) if t[1] > 0 else 0.0

    return QuantError(rel(k), float(k[2]), rel(v), float(v[2]))


class QuantizingCache(LayerCache):
    """Shared by caches that quantize: the opt-in error probe and the width attributes.

    ``key_bits`` / ``value_bits`` are the widths; ``bits`` exists only while keys and values
    share a width and are stored quantized, because mlx-lm's attention takes the quantized path
    for any cache that has ``bits``.
    """

    track_error = False  # the profiler sets it; when False no update does any extra work
    _error = None  # (key terms, value terms) of the last update, Terms read when asked
    group_size = 64
    key_bits = 8
    value_bits = 8

    def _record(self, key_terms, value_terms) -> None:
        self._error = (key_terms, value_terms)

    # whether the slots an update writes hand back its new tokens' codes (dequantized where the
    # cache hands back floats): a strategy batch's dequantization of them is then the reconstruction
    _hands_back_codes = False

    def _decoded(self, start: int, end: int, keys_hat: mx.array, values_hat: mx.array) -> None:
        """A strategy batch dequantized slots ``[start, end)`` of this cache's last return
        (``keys_hat``, ``values_hat``): where those are exactly the slots the last update wrote,
        quantized from the keys and values its error terms hold, the terms take them as the
        reconstruction instead of dequantizing the same codes again; the terms of every such
        cache then join one stacked graph whatever their width (:func:`stage_terms`)."""
        error, w = self._error, self.written
        if not self._hands_back_codes or type(error) is not tuple or w is None or (w.start, w.end) != (start, end):
            return
        k, v = error
        if not (isinstance(k, Terms) and isinstance(v, Terms)) or k.x is None or v.x is None or k.stack or v.stack:
            return
        if k.x.shape != keys_hat.shape or v.x.shape != values_hat.shape:
            return
        k.x_hat, v.x_hat, k.parts, v.parts = keys_hat, values_hat, None, None

    def _last_error(self) -> QuantError | None:
        if not self.track_error or self._error is None:
            return None
        if not isinstance(self._error, QuantError):
            self._error = to_quant_error(self._error)
        return self._error

    def _set_widths(self, group_size, key_bits, value_bits, where: str) -> None:
        self.group_size = check_group_size(group_size, where)
        self.key_bits = check_bits("key_bits", key_bits, where)
        self.value_bits = check_bits("value_bits", value_bits, where)

    def _check_dims(self, keys: mx.array, values: mx.array) -> None:
        where = type(self).__name__
        check_head_dim(keys.shape[-1], self.group_size, where)
        check_head_dim(values.shape[-1], self.group_size, where)


class QuantizedKVCache(HeldInOrder, QuantizingCache):
    """mlx-lm's ``QuantizedKVCache(group_size, bits)``: every token stored quantized, in a buffer
    grown in steps of 256 tokens.

    Keyword-only, beyond mlx-lm: ``key_bits`` / ``value_bits`` (default ``bits``) quantize keys
    and values at different widths; ``start=N`` holds the first tokens at full precision and
    converts the whole cache at the first update that begins with ``N`` or more tokens held.
    """

    step = STEP
    _hands_back_codes = True
    _pending = False  # True while the cache still holds full precision (before ``start``)
    _error_pending = None  # error terms of a conversion, merged into the update that made it
    start = 0
    _STATE = ("keys", "values", "offset", "group_size", "bits | key_bits, value_bits, start")

    def __init__(
        self,
        group_size: int = 64,
        bits: int = 8,
        *,
        key_bits: int | None = None,
        value_bits: int | None = None,
        start: int = 0,
    ):
        where = "QuantizedKVCache"
        check_bits("bits", bits, where)
        self._set_widths(
            group_size, bits if key_bits is None else key_bits, bits if value_bits is None else value_bits, where
        )
        self.start = check_int("start", start, 0, where)
        self._pending = start > 0
        self.keys = None
        self.values = None
        self.offset = 0

    # mlx-lm's attention takes its quantized path for any cache with ``bits``: hide it while
    # the arrays handed back are full precision (before ``start``, or with mixed widths).
    @property
    def bits(self) -> int:
        if self._pending or self.key_bits != self.value_bits:
            raise AttributeError("bits: this cache hands back full-precision arrays")
        return self.key_bits

    @bits.setter
    def bits(self, value: int) -> None:
        self.key_bits = self.value_bits = check_bits("bits", value, "QuantizedKVCache")

    @property
    def quantized(self) -> bool:
        """Whether the stored tokens are quantized now (False until ``start`` is reached)."""
        return not self._pending

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        prev = self.offset
        if self.keys is None:
            self._check_dims(keys, values)
        converts = self._pending and self.keys is not None
        if self._pending:
            if prev < self.start:
                self.keys = write_linear(self.keys, prev, keys, self.step)
                self.values = write_linear(self.values, prev, values, self.step)
                self.offset = prev + keys.shape[2]
                self.written = Written(prev, self.offset, True)
                if self.track_error:
                    self._error = None
                return self.keys_and_values()
            self._convert()
        gs, kb, vb = self.group_size, self.key_bits, self.value_bits
        qk = quantize(keys, gs, kb)
        qv = quantize(values, gs, vb)
        end = prev + keys.shape[2]
        if self.keys is None or end > self.keys[0].shape[2]:
            self.keys = self._grown(self.keys, prev, qk)
            self.values = self._grown(self.values, prev, qv)
        for buf, new in zip(self.keys, qk):
            buf[..., prev:end, :] = new
        for buf, new in zip(self.values, qv):
            buf[..., prev:end, :] = new
        self.offset = end
        # a conversion rewrote every held token; otherwise the new tokens alone are new
        self.written = None if converts else Written(prev, end, False)
        if self.track_error:
            kt, vt = error_terms(keys, qk, gs, kb), error_terms(values, qv, gs, vb)
            if self._error_pending is not None:  # this update also converted the held tokens
                kt, vt = merge_terms(self._error_pending[0], kt), merge_terms(self._error_pending[1], vt)
                self._error_pending = None
            self._record(kt, vt)
        return self.keys_and_values()

    def _grown(self, parts, used: int, incoming: list[mx.array]) -> list[mx.array]:
        if parts is None:
            return [grow(None, 0, p, self.step) for p in incoming]
        return [grow(buf, used, p, self.step) for buf, p in zip(parts, incoming)]

    def _convert(self) -> None:
        """Full precision -> quantized, over the whole buffer (as mlx-lm's ``to_quantized``)."""
        self._pending = False
        if self.keys is None:
            return
        gs, kb, vb = self.group_size, self.key_bits, self.value_bits
        full_k, full_v = self.keys, self.values
        self.keys = quantize(full_k, gs, kb)
        self.values = quantize(full_v, gs, vb)
        n = self.offset
        if self.track_error and n > 0:
            self._error_pending = (
                error_terms(full_k[..., :n, :], [p[..., :n, :] for p in self.keys], gs, kb),
                error_terms(full_v[..., :n, :], [p[..., :n, :] for p in self.values], gs, vb),
            )

    def keys_and_values(self):
        n = self.offset
        if self._pending:
            if n < self.keys.shape[2]:
                return self.keys[..., :n, :], self.values[..., :n, :]
            return self.keys, self.values
        keys, values = self.keys, self.values
        if n != keys[0].shape[2]:
            keys = [p[..., :n, :] for p in keys]
            values = [p[..., :n, :] for p in values]
        if self.key_bits != self.value_bits:
            gs = self.group_size
            return dequantize(keys, gs, self.key_bits), dequantize(values, gs, self.value_bits)
        return keys, values

    @property
    def state(self):
        if self._pending or self.key_bits != self.value_bits:
            return (self.keys, self.values, self.offset, self.group_size, self.key_bits, self.value_bits, self.start)
        return self.keys, self.values, self.offset, self.group_size, self.key_bits

    @state.setter
    def state(self, v):
        v = self._unpack_state(v, (5, 7))
        where = "QuantizedKVCache"
        if len(v) == 5:
            keys, values, offset, group_size, bits = v
            key_bits = value_bits = bits
            start = 0
        else:
            keys, values, offset, group_size, key_bits, value_bits, start = v
        self._set_widths(group_size, key_bits, value_bits, where)
        self.start = check_int("start", start, 0, where)
        self.offset = check_int("offset", offset, 0, where)
        check_kv_pair(keys, values, where)
        self._pending = keys is not None and not isinstance(keys, (list, tuple))
        if keys is None:
            self._pending = len(v) == 7 and offset < start
        for name, x in (("keys", keys), ("values", values)):
            if isinstance(x, (list, tuple)) and len(x) != 3:
                raise ValueError(
                    f"{where} state: quantized {name} must have 3 parts (packed, scales, biases), got {len(x)}"
                )
        if keys is not None and offset > token_length(keys):
            raise ValueError(f"{where} state: offset={offset} exceeds the {token_length(keys)} slots stored")
        self.keys, self.values = keys, values

    def introspect(self) -> CacheView:
        cap = 0 if self.keys is None else token_length(self.keys)
        held = min(self.offset, cap)
        total = array_bytes(self.keys, self.values)
        quantized = not self._pending
        return CacheView(
            kind=type(self).__name__,
            layout="linear",
            offset=self.offset,
            tokens_held=held,
            capacity=cap,
            max_capacity=None,
            bytes_used=per_token_bytes(total, cap) * held,
            bytes_allocated=total,
            write_index=self.offset,
            batch_size=1 if self.keys is None else (self.keys[0] if quantized else self.keys).shape[0],
            key_bits=self.key_bits if quantized else None,
            value_bits=self.value_bits if quantized else None,
            group_size=self.group_size if quantized else None,
            quantized_tokens=held if quantized else 0,
            dtype=dtype_name(self.keys),
            quant_error=self._last_error(),
        )


# --- the builder named by the strategy table (cachelib.spec.STRATEGIES): (spec) -> layer cache


def build_quantized(spec) -> QuantizedKVCache:
    return QuantizedKVCache(
        group_size=spec.get("group_size"),
        bits=spec.get("bits"),
        key_bits=spec.key_bits,
        value_bits=spec.value_bits,
        start=spec.get("start"),
    )
