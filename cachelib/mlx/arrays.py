"""Caches that are containers rather than token buffers: :class:`ArraysCache` (the state arrays
of recurrent layers: conv windows, SSM states), :class:`MambaCache` (its two-array form) and
:class:`CacheList` (several caches serving one layer, e.g. attention plus an indexer).

A recurrent layer writes its arrays itself (``cache[0] = conv_state``); the cache only holds
them, batches them (left padding, right-padded ``lengths`` during a prefill) and masks the
padded steps. It has no token axis, so its view says ``layout="recurrent"`` and counts every
held byte as used.

mlx-lm's mamba checks ``isinstance(cache, mlx_lm ArraysCache)`` before it stores its state, so
our :class:`ArraysCache` names mlx-lm's class as a base: a marker only, every method is ours
(a test checks that no attribute resolves to mlx-lm's code).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache as _MlxLmArraysCache

from ..introspect import CacheView
from .base import LayerCache, array_bytes, check_array, check_int, dtype_name


class ArraysCache(LayerCache, _MlxLmArraysCache):
    """mlx-lm's ``ArraysCache(size, left_padding=None)``: ``size`` arrays (or None), indexable."""

    left_padding = None
    lengths = None
    _STATE = ("cache", "left_padding", "lengths")

    def __init__(self, size: int, left_padding: list[int] | None = None):
        check_int("size", size, 1, type(self).__name__)
        self.cache = [None] * size
        self.left_padding = mx.array(left_padding) if left_padding else None
        self.lengths = None

    @classmethod
    def _with_slots(cls, n: int):
        obj = cls.__new__(cls)
        obj.cache, obj.left_padding, obj.lengths = [None] * n, None, None
        return obj

    @property
    def batch_size(self) -> int:
        for c in self.cache:
            if c is not None:
                return c.shape[0]
        if self.left_padding is not None:
            return self.left_padding.size
        if self.lengths is not None:
            return self.lengths.size
        return 1

    def __setitem__(self, idx: int, value) -> None:
        self.cache[idx] = value

    def __getitem__(self, idx: int):
        return self.cache[idx]

    @property
    def state(self):
        return self.cache, self.left_padding, self.lengths

    @state.setter
    def state(self, v):
        cache, left_padding, lengths = self._unpack_state(v, 3)
        where = type(self).__name__
        if not isinstance(cache, (list, tuple)) or not cache:
            raise ValueError(f"{where} state: cache must be a non-empty list of arrays (or None entries)")
        for i, c in enumerate(cache):
            check_array(f"cache[{i}]", c, where)
        check_array("left_padding", left_padding, where)
        check_array("lengths", lengths, where)
        self.cache, self.left_padding, self.lengths = list(cache), left_padding, lengths

    def filter(self, batch_indices) -> None:
        """Keep only the batch rows ``batch_indices``, in place."""
        self.cache = [None if c is None else c[batch_indices] for c in self.cache]
        if self.left_padding is not None:
            self.left_padding = self.left_padding[batch_indices]
        if self.lengths is not None:
            self.lengths = self.lengths[batch_indices]

    def extend(self, other: ArraysCache) -> None:
        """Append ``other``'s batch rows, in place (a side missing an array gets zeros)."""
        rows, other_rows = self.batch_size, other.batch_size

        def stack(a, b):
            like = b if b is not None else a
            if like is None:
                return None
            if a is None:
                a = mx.zeros((rows, *like.shape[1:]), like.dtype)
            if b is None:
                b = mx.zeros((other_rows, *like.shape[1:]), like.dtype)
            return mx.concatenate([a, b])

        self.cache = [stack(a, b) for a, b in zip(self.cache, other.cache)]
        self.left_padding = stack(self.left_padding, other.left_padding)
        self.lengths = stack(self.lengths, other.lengths)

    def extract(self, idx: int):
        """Batch row ``idx`` as a cache of its own."""
        out = type(self)._with_slots(len(self.cache))
        out.cache = [None if c is None else c[idx : idx + 1] for c in self.cache]
        return out

    def prepare(self, lengths=None, **kwargs) -> None:
        """Before a right-padded prefill: the true length of each row."""
        self.lengths = None if lengths is None else mx.array(lengths)

    def finalize(self) -> None:
        self.lengths = None
        self.left_padding = None

    def advance(self, N: int) -> None:
        """``N`` steps were consumed: padding and remaining lengths shrink by ``N``."""
        if self.lengths is not None:
            self.lengths -= N
        if self.left_padding is not None:
            self.left_padding -= N

    def make_mask(self, N: int):
        """(B, N) mask of the steps that are real tokens (None when nothing is padded)."""
        steps = mx.arange(N)
        mask = None
        if self.left_padding is not None:
            mask = steps >= self.left_padding[:, None]
        if self.lengths is not None:
            inside = steps < self.lengths[:, None]
            mask = inside if mask is None else mask & inside
        return mask

    @classmethod
    def merge(cls, caches):
        """One cache holding each of ``caches`` as a batch row."""
        n = len(caches[0].cache)
        rows = len(caches)
        out = cls._with_slots(n)
        if all(c.empty() for c in caches):
            out.left_padding = mx.array([0] * rows)
            return out
        for e in range(n):
            like = next((c[e] for c in caches if c[e] is not None), None)
            if like is None:
                continue
            merged = mx.zeros((rows, *like.shape[1:]), like.dtype)
            for i, c in enumerate(caches):
                if c[e] is not None:
                    merged[i : i + 1] = c[e]
            out[e] = merged
        return out

    def empty(self) -> bool:
        return self.cache[0] is None

    @property
    def nbytes(self) -> int:
        return array_bytes(*self.cache)

    def introspect(self) -> CacheView:
        total = array_bytes(*self.cache)
        first = next((c for c in self.cache if c is not None), None)
        return CacheView(
            kind=type(self).__name__,
            layout="recurrent",
            offset=0,
            tokens_held=0,
            capacity=0,
            max_capacity=None,
            bytes_used=total,
            bytes_allocated=total,
            write_index=None,
            batch_size=self.batch_size,
            dtype=dtype_name(first),
        )


class MambaCache(ArraysCache):
    """An :class:`ArraysCache` of two arrays (conv window, SSM state), as older mlx-lm named it."""

    def __init__(self, left_padding: list[int] | None = None):
        super().__init__(size=2, left_padding=left_padding)


class CacheList(LayerCache):
    """mlx-lm's ``CacheList(*caches)``: several caches serving one layer, indexable."""

    _STATE = ("(member state, member class name) per member",)
    # Class name -> class, for the members a state names; set by .registry, whose table lists
    # CacheList too (so this module cannot import it).
    member_class: Callable[[str], type[LayerCache]]

    def __init__(self, *caches):
        self.caches = caches

    def __getitem__(self, idx: int):
        return self.caches[idx]

    def is_trimmable(self) -> bool:
        return all(c.is_trimmable() for c in self.caches)

    def trim(self, n: int) -> int:
        """Trim every member; returns what the last member trimmed."""
        trimmed = 0
        for c in self.caches:
            trimmed = c.trim(n)
        return trimmed

    @property
    def state(self):
        return [(c.state, type(c).__name__) for c in self.caches]

    @state.setter
    def state(self, v):
        if not isinstance(v, (list, tuple)):
            raise ValueError("CacheList state must be a list of (member state, member class name) pairs")
        members = []
        for i, entry in enumerate(v):
            if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[1], str):
                raise ValueError(f"CacheList state entry {i} must be a (member state, member class name) pair")
            members.append(self.member_class(entry[1]).from_state(entry[0]))
        self.caches = members

    def filter(self, batch_indices) -> None:
        for c in self.caches:
            c.filter(batch_indices)

    def extend(self, other: CacheList) -> None:
        for c, o in zip(self.caches, other.caches):
            c.extend(o)

    @classmethod
    def merge(cls, caches):
        out = cls()
        out.caches = tuple(
            caches[0].caches[i].merge([c.caches[i] for c in caches]) for i in range(len(caches[0].caches))
        )
        return out

    def extract(self, idx: int) -> CacheList:
        return CacheList(*(c.extract(idx) for c in self.caches))

    def prepare(self, **kwargs) -> None:
        for c in self.caches:
            c.prepare(**kwargs)

    def finalize(self) -> None:
        for c in self.caches:
            c.finalize()

    def size(self) -> int:
        return max(c.size() for c in self.caches)

    def empty(self) -> bool:
        return self.caches[0].empty()

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def introspect(self) -> CacheView:
        """One view of all members: bytes summed; token and slot fields from the first member
        with a token axis (else the first member)."""
        views = [c.introspect() for c in self.caches]
        if not views:
            return CacheView("CacheList()", "none", 0, 0, 0, None, 0, 0, None)
        lead = next((v for v in views if v.layout in ("linear", "ring")), views[0])
        return replace(
            lead,
            kind="CacheList(" + ",".join(v.kind for v in views) + ")",
            bytes_used=sum(v.bytes_used for v in views),
            bytes_allocated=sum(v.bytes_allocated for v in views),
        )
