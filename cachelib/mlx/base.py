"""The layer-cache protocol every ``cachelib.mlx`` class speaks, and the pieces they share.

mlx-lm's models duck-type their caches: an attention layer reads ``cache.offset`` for RoPE,
calls ``update_and_fetch(keys, values)`` and attends over what comes back; the model asks a
cache for its mask with ``make_mask(N, window_size=..., return_array=...)``; generation code
reads ``state`` / ``nbytes``, trims, and rebuilds caches with ``from_state``. This module holds
the protocol's defaults (:class:`LayerCache`), the causal masks, step-wise growth of a token
buffer, argument checks, and the small helpers the views are built from.

It knows nothing about any one strategy: each strategy is its own class in a sibling module.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from ..core.masks import visible
from ..introspect import CacheView, Written


class LayerCache:
    """Base of every cache class: protocol defaults shared by all strategies.

    Attributes that are not part of ``state`` have class-level defaults, so an object built by
    :meth:`from_state` (which skips ``__init__``) is complete.
    """

    _STATE: tuple[str, ...] = ()  # names of the entries of ``state``, for error messages
    # What the last update changed in what it handed back (a strategy batch copies only that);
    # None: not known, every slot may have changed.
    written: Written | None = None

    @property
    def state(self) -> Any:
        return []

    @state.setter
    def state(self, v) -> None:
        if v:
            raise ValueError(f"{type(self).__name__} holds no state, but a state was given")

    @classmethod
    def from_state(cls, state):
        """A cache holding ``state`` (as returned by ``cache.state`` or read from a file)."""
        obj = cls.__new__(cls)
        obj.state = state
        return obj

    def is_trimmable(self) -> bool:
        return False

    def size(self) -> int:
        """Tokens held, for classes that count them; 0 otherwise (as in mlx-lm)."""
        return 0

    @property
    def nbytes(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} must define nbytes")

    def empty(self) -> bool:
        raise NotImplementedError(f"{type(self).__name__} must define empty()")

    def introspect(self) -> CacheView:
        raise NotImplementedError(f"{type(self).__name__} must define introspect()")

    def _unpack_state(self, v, n: int | tuple[int, ...]) -> list:
        """``v`` as a list of ``n`` entries, or a ValueError naming the class and its fields."""
        counts = (n,) if isinstance(n, int) else n
        if not isinstance(v, (list, tuple)) or len(v) not in counts:
            got = len(v) if isinstance(v, (list, tuple)) else type(v).__name__
            raise ValueError(
                f"{type(self).__name__} state must have {' or '.join(map(str, counts))} entries "
                f"({', '.join(self._STATE)}), got {got}"
            )
        return list(v)


class HeldInOrder:
    """Protocol methods of a cache that keeps its tokens in ``keys`` / ``values`` in arrival
    order and counts them in ``offset`` (put first among a class's bases, before
    :class:`LayerCache`): trimming drops the newest tokens by moving ``offset`` back, never
    below ``_trim_floor()``; the mask is the causal one over ``offset`` tokens; the cache is
    empty before its first update."""

    def _trim_floor(self) -> int:
        return 0

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset - self._trim_floor(), check_trim(n, type(self).__name__))
        self.offset -= n
        return n

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        return attention_mask(N, self.offset, window_size, return_array)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return array_bytes(self.keys, self.values)


# --- argument checks -------------------------------------------------------------------------


def check_int(name: str, value, minimum: int, where: str) -> int:
    """``value`` as an int >= ``minimum``, else a ValueError naming ``where``'s argument."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: {name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {value}")
    return value


def check_trim(n, where: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{where}.trim: n must be an integer >= 0 (tokens to drop), got {n!r}")
    return n


def check_array(name: str, value, where: str, optional: bool = True) -> None:
    if value is None and optional:
        return
    if not isinstance(value, mx.array):
        allowed = "an mx.array or None" if optional else "an mx.array"
        raise ValueError(f"{where} state: {name} must be {allowed}, got {type(value).__name__}")


def check_kv_pair(keys, values, where: str) -> None:
    """Keys and values both absent, or both present with the same token count (axis 2)."""
    if (keys is None) != (values is None):
        raise ValueError(f"{where} state: keys and values must both be present or both be None")
    if keys is None:
        return
    for name, x in (("keys", keys), ("values", values)):  # a file may hold anything: ranks before any indexing
        for part in x if isinstance(x, (list, tuple)) else [x]:
            if not isinstance(part, mx.array) or part.ndim != 4:
                array = isinstance(part, mx.array)
                got = f"a {part.ndim}-D array {tuple(part.shape)}" if array else type(part).__name__
                raise ValueError(f"{where} state: {name} must be 4-D arrays (batch, heads, tokens, dim), got {got}")
            if part.dtype in (mx.bool_, mx.complex64):
                raise ValueError(f"{where} state: {name} hold {part.dtype}, not numbers a cache stores")
    rows = [(x[0] if isinstance(x, (list, tuple)) else x).shape[0] for x in (keys, values)]
    if rows[0] != rows[1]:
        raise ValueError(f"{where} state: keys hold {rows[0]} batch rows but values {rows[1]}")
    k_len, v_len = token_length(keys), token_length(values)
    if k_len != v_len:
        raise ValueError(f"{where} state: keys hold {k_len} tokens but values hold {v_len}")


# --- masks -----------------------------------------------------------------------------------


def causal_mask(n: int, offset: int = 0, window: int | None = None, left_padding: mx.array | None = None):
    """Boolean mask of ``n`` queries at positions ``offset..offset+n-1`` over ``offset + n`` keys.

    Shape ``(n, offset + n)``, or ``(B, 1, n, offset + n)`` with a per-row ``left_padding``
    (keys before a row's padding are hidden). A window hides keys ``window`` or more behind.
    """
    key_pos = mx.arange(offset + n)[None]  # (1, K)
    query_pos = mx.arange(offset, offset + n)[:, None]  # (n, 1)
    mask = visible(query_pos, key_pos, window)
    if left_padding is not None:
        mask = mask & (left_padding[:, None, None, None] <= key_pos)
    return mask


def attention_mask(n: int, offset: int, window_size: int | None = None, return_array: bool = False):
    """The mask of a cache whose keys come back in temporal order, ``offset`` of them held
    before this step: ``None`` when a single query sees everything, the string ``"causal"``
    when the fused kernel can apply it, an array otherwise."""
    if window_size is not None:
        return causal_mask(n, offset, window_size)
    if n == 1:
        return None
    if return_array:
        return causal_mask(n, offset)
    return "causal"


# --- token buffers ---------------------------------------------------------------------------


def token_length(x) -> int:
    """Tokens on axis 2 of a stored array, or of the first part of a quantized one."""
    return (x[0] if isinstance(x, (list, tuple)) else x).shape[2]


def each(fn, x):
    """``fn`` applied to an array, or to every part of a quantized (packed, scales, biases) one."""
    if isinstance(x, (list, tuple)):
        return [fn(p) for p in x]
    return fn(x)


def zeros_like_tokens(x: mx.array, n: int) -> mx.array:
    """Zeros shaped like ``x`` (B, H, *, D) with ``n`` tokens."""
    return mx.zeros((x.shape[0], x.shape[1], n, x.shape[3]), x.dtype)


def grow(buf: mx.array | None, used: int, incoming: mx.array, step: int) -> mx.array:
    """``buf`` with room for ``incoming``'s tokens after slot ``used``: whole steps of zeros
    appended (a buffer not filled to a whole step is first cut at ``used``)."""
    room = -(-incoming.shape[2] // step) * step
    fresh = zeros_like_tokens(incoming, room)
    if buf is None:
        return fresh
    if used % step:
        buf = buf[..., :used, :]
    return mx.concatenate([buf, fresh], axis=2)


def write_linear(buf: mx.array | None, start: int, new: mx.array, step: int) -> mx.array:
    """``new`` written to slots ``[start, start + S)`` of ``buf``, grown in steps if it does not fit."""
    end = start + new.shape[2]
    if buf is None or end > buf.shape[2]:
        buf = grow(buf, start, new, step)
    buf[..., start:end, :] = new
    return buf


def array_bytes(*xs) -> int:
    """Bytes of arrays, parts of quantized arrays, or None (0)."""
    total = 0
    for x in xs:
        if x is None:
            continue
        if isinstance(x, (list, tuple)):
            total += sum(p.nbytes for p in x)
        else:
            total += x.nbytes
    return total


_DTYPE_NAMES: dict = {}


def dtype_name(x) -> str:
    """Short name of the element type of ``x`` (of the scales for a quantized array)."""
    if x is None:
        return ""
    if isinstance(x, (list, tuple)):
        x = x[1]
    dt = x.dtype
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = _DTYPE_NAMES[dt] = str(dt).rpartition(".")[2]
    return name


def per_token_bytes(total: int, capacity: int) -> int:
    return total // capacity if capacity else 0


def known_names(names: Sequence[str]) -> str:
    return ", ".join(sorted(names))
