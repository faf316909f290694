"""The allocation rules of each layer-cache class, replayed on integers.

A rule object keeps only the integers its cache class keeps (offset, slots allocated, ring
pointer, tokens quantized, ...) and the byte size of one token slot, and replays an update of
``n`` tokens exactly as the class allocates: mlx-lm 0.32 ``KVCache``, ``ConcatenateKVCache``,
``RotatingKVCache``, ``QuantizedKVCache`` (+ ``to_quantized``), ``ChunkedKVCache``,
``ArraysCache``; transformers 5.24 ``DynamicLayer``, ``DynamicSlidingWindowLayer``,
``StaticLayer``, ``StaticSlidingWindowLayer``, ``QuantizedLayer`` (KIVI residual) and
``LinearAttentionLayer``. ``bytes_allocated`` after an update equals the ``nbytes`` the real
cache reports (the sum of its arrays' logical sizes), byte for byte.

``update`` also returns the transient peak: the bytes the cache's arrays hold at the worst
moment inside the update, under one documented model: an array is freed when it is replaced, so
growth by concatenation holds old + new, ``to_quantized`` holds both copies, a KIVI update holds
its dequantized copy and the concatenated full-precision states it returns. Views (slices) are
counted as free. The transient is a model of the reference code, not a measurement.

Decode runs fast: ``regular_steps()`` says how many coming 1-token updates change bytes only
affinely and never downward (steady writes, or growth by exactly one token), so the caller may
``skip`` all but the last of them and still see the run's maximum. Long runs of equal updates
(prompt chunks, decode across growth steps) run fast too: ``cycle_key(n)`` is everything that
decides how the coming ``n``-token updates change a rule apart from the position fields they
shift, so once it repeats the updates go round a cycle, and the caller may shift the fields by
whole cycles (``fields`` / ``shift``) within ``cycle_horizon(n)``.

This module knows allocation arithmetic only: nothing of models, strategies or backends.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from . import ring
from .formats import FORMATS
from .units import STEP

UNBOUNDED = 1 << 62  # "every coming 1-token update is regular"


def _ceil_steps(n: int, step: int) -> int:
    return -(-n // step) * step


@dataclass
class LayerBytes:
    """One layer cache's state after an update."""

    kind: str
    tokens_held: int
    capacity: int
    bytes_allocated: int
    bytes_used: int


class Rule:
    """Base of the per-class rules: the integers of one layer cache."""

    kind = ""
    bounded = False  # True: the allocation can never pass a fixed size, whatever the updates

    def __init__(self, token_bytes: int, kind: str | None = None):
        self.token_bytes = token_bytes  # one token slot, whole batch, keys + values
        self.offset = 0
        if kind:  # the class it stands for, where a rule models several (DynamicLayer, ...)
            self.kind = kind

    # -- what the cache holds now
    @property
    def capacity(self) -> int:
        raise NotImplementedError

    @property
    def tokens_held(self) -> int:
        raise NotImplementedError

    @property
    def bytes_allocated(self) -> int:
        return self.capacity * self.token_bytes

    @property
    def bytes_used(self) -> int:
        return self.tokens_held * self.token_bytes

    def state(self) -> LayerBytes:
        return LayerBytes(self.kind, self.tokens_held, self.capacity, self.bytes_allocated, self.bytes_used)

    # -- updates
    def update(self, n: int) -> int:
        """Replay an update of ``n`` tokens; return the transient peak bytes during it."""
        raise NotImplementedError

    def regular_steps(self) -> int:
        """How many coming 1-token updates change bytes affinely and never downward."""
        return 0

    def skip(self, k: int) -> None:
        """Apply ``k`` regular 1-token updates at once (``k <= regular_steps()``)."""
        raise NotImplementedError

    def settled(self) -> bool:
        """Whether every coming 1-token update leaves the bytes (and the peak) as they are."""
        return False

    # -- cycles of equal updates
    def cycle_key(self, n: int):
        """What decides how the coming ``n``-token updates (and, for ``n == 1``, the regular
        stretches between them) change this rule, the integer fields they shift excepted; equal
        keys mean equal changes. None: not known yet (a threshold ahead), never cycle."""
        return None

    def cycle_horizon(self, n: int) -> int:
        """How many coming ``n``-token updates the key decides (a limit ahead, such as a static
        buffer's end, is not in the key)."""
        return UNBOUNDED

    def fields(self) -> dict[str, int]:
        """The integer fields (nested rules' as ``name.field``), for shifting by whole cycles."""
        out: dict[str, int] = {}
        for name, value in vars(self).items():
            if isinstance(value, Rule):
                out.update({f"{name}.{k}": v for k, v in value.fields().items()})
            elif isinstance(value, int) and not isinstance(value, bool):
                out[name] = value
        return out

    def shift(self, delta: dict[str, int], times: int) -> None:
        """Add ``times * delta[field]`` to each field: the state ``times`` cycles later."""
        for name, d in delta.items():
            if d:
                *path, attr = name.split(".")
                obj = self
                for part in path:
                    obj = getattr(obj, part)
                setattr(obj, attr, getattr(obj, attr) + times * d)

    def copy(self) -> Rule:
        return copy.copy(self)  # every field is an int, a str or a bool


class StepGrowth(Rule):
    """mlx-lm ``KVCache`` (and ``QuantizedKVCache``, whose packed arrays grow the same way):
    a buffer grown by whole steps; a buffer not filled to a step boundary is first cut at the
    offset, then ``ceil(S / step) * step`` slots are concatenated."""

    kind = "KVCache"

    def __init__(self, token_bytes: int, step: int = STEP, kind: str | None = None):
        super().__init__(token_bytes, kind)
        self.step = step
        self.cap = 0

    @property
    def capacity(self) -> int:
        return self.cap

    @property
    def tokens_held(self) -> int:
        return min(self.offset, self.cap)

    def update(self, n: int) -> int:
        before = self.bytes_allocated
        peak = before
        if self.cap == 0 or self.offset + n > self.cap:
            grow = _ceil_steps(n, self.step)
            if self.cap == 0:
                self.cap = grow
            else:
                base = self.offset if self.offset % self.step else self.cap
                self.cap = base + grow
            peak = before + self.bytes_allocated  # old buffer + concatenated buffer
        self.offset += n
        return peak

    def regular_steps(self) -> int:
        return max(0, self.cap - self.offset) if self.cap else 0

    def skip(self, k: int) -> None:
        self.offset += k

    def cycle_key(self, n: int):
        return self.cap == 0, self.cap - self.offset, self.offset % self.step


class Concatenate(Rule):
    """mlx-lm ``ConcatenateKVCache`` / transformers ``DynamicLayer``: the arrays are replaced by
    ``concat(old, new)`` at every update, so they hold exactly the tokens seen."""

    kind = "ConcatenateKVCache"

    def __init__(self, token_bytes: int, kind: str | None = None):
        super().__init__(token_bytes, kind)

    @property
    def capacity(self) -> int:
        return self.offset

    @property
    def tokens_held(self) -> int:
        return self.offset

    def update(self, n: int) -> int:
        before = self.bytes_allocated
        self.offset += n
        return before + self.bytes_allocated

    def regular_steps(self) -> int:
        return UNBOUNDED

    def skip(self, k: int) -> None:
        self.offset += k

    def cycle_key(self, n: int):
        return ()


class Rotating(Rule):
    """mlx-lm ``RotatingKVCache(max_size, keep)``. One-token updates write in place, growing the
    buffer by ``min(step, max_size - offset)`` until it reaches ``max_size``, trimming it back
    to ``max_size`` first if a multi-token update left it larger. Multi-token updates put the
    buffer in temporal order, cut it to ``max_size - 1`` tokens (keeping the first ``keep``) and
    append all ``S`` new ones: up to ``max_size + S - 1`` tokens."""

    kind = "RotatingKVCache"
    bounded = True

    def __init__(self, token_bytes: int, max_size: int, keep: int = 0, step: int = STEP):
        super().__init__(token_bytes)
        self.max_size, self.keep, self.step = max_size, keep, step
        self.cap = 0
        self.idx = 0  # mlx-lm's _idx: the slot the next token goes to

    @property
    def capacity(self) -> int:
        return self.cap

    @property
    def tokens_held(self) -> int:
        return min(self.offset, self.cap)

    def update(self, n: int) -> int:
        return self._in_place() if n == 1 else self._concat(n)

    def _concat(self, n: int) -> int:
        before = self.bytes_allocated
        plan = ring.write_block(n, self.offset, self.idx, self.cap, self.max_size, self.keep)
        # A wrapped ring is reordered into a new buffer first; otherwise the order is a view.
        extra = self.cap * self.token_bytes if plan.wrapped else 0
        self.cap = plan.capacity
        self.offset += n
        self.idx = plan.capacity
        return before + extra + self.bytes_allocated

    def _in_place(self) -> int:
        before = self.bytes_allocated
        peak = before
        prev = self.offset
        w = ring.write_one(prev, self.idx, self.cap, self.max_size, self.keep, self.step)
        if w.grow is not None:
            if w.grow <= 0:
                raise ValueError(
                    f"RotatingKVCache rule: cannot grow by {w.grow} slots at offset {prev} "
                    f"(capacity {self.cap}, max_size {self.max_size})"
                )
            self.cap += w.grow
            peak = before + self.bytes_allocated
        if w.cut:  # left over from a multi-token update: cut back
            old = self.bytes_allocated
            self.cap = w.capacity
            peak = max(peak, old + self.bytes_allocated)
        self.offset += 1
        self.idx = w.slot + 1
        return peak

    def regular_steps(self) -> int:
        k = ring.steady_writes(self.offset, self.cap, self.max_size)
        return UNBOUNDED if k is None else k

    def skip(self, k: int) -> None:
        self.offset += k
        self.idx = ring.advance(k, self.idx, self.cap, self.max_size, self.keep)

    def settled(self) -> bool:
        return self.cap == self.max_size

    def cycle_key(self, n: int):
        # Past every slot and max_size, the offset enters the ring's arithmetic only through
        # comparisons that stay true.
        if self.offset > max(self.cap, self.idx, self.max_size):
            return self.cap, self.idx
        return None


class Chunked(Rule):
    """mlx-lm ``ChunkedKVCache(chunk_size)`` driven as llama4 drives it: ``maybe_trim_front``
    before every update (slice to the last ``chunk_size`` tokens), then step growth as
    ``KVCache``. Once past the chunk, every decode step cuts the buffer to ``chunk_size`` slots
    and grows it by one step again."""

    kind = "ChunkedKVCache"
    bounded = True

    def __init__(self, token_bytes: int, chunk_size: int, step: int = STEP):
        super().__init__(token_bytes)
        self.chunk, self.step = chunk_size, step
        self.cap = 0
        self.start = 0

    @property
    def capacity(self) -> int:
        return self.cap

    @property
    def tokens_held(self) -> int:
        return min(self.offset - self.start, self.cap)

    def update(self, n: int) -> int:
        before = self.bytes_allocated
        peak = before
        if self.cap:
            valid = self.offset - self.start
            if valid > self.chunk:
                self.start += valid - self.chunk
                self.cap = self.chunk  # a view of the old buffer
        prev = self.offset - self.start
        if self.cap == 0 or prev + n > self.cap:
            grow = _ceil_steps(n, self.step)
            if self.cap == 0:
                self.cap = grow
            else:
                self.cap = (prev if prev % self.step else self.cap) + grow
            peak = before + self.bytes_allocated
        self.offset += n
        return peak

    def regular_steps(self) -> int:
        if self.cap == 0:
            return 0
        valid = self.offset - self.start
        if valid == self.chunk + 1 and self.cap == self.chunk + self.step:
            return UNBOUNDED  # periodic: trim one, grow one step, every step alike
        if valid > self.chunk:
            return 0
        return max(0, min(self.chunk - valid + 1, self.cap - valid))

    def skip(self, k: int) -> None:
        if self.offset - self.start > self.chunk:
            self.start += k
        self.offset += k

    def settled(self) -> bool:
        return self.regular_steps() == UNBOUNDED

    def cycle_key(self, n: int):
        return self.cap, self.offset - self.start


class Static(Rule):
    """transformers ``StaticLayer`` (and our MLX ``StaticKVCache``): ``max_len`` slots allocated
    at the first update; an update past ``max_len`` is refused."""

    kind = "StaticLayer"
    bounded = True

    def __init__(self, token_bytes: int, max_len: int):
        super().__init__(token_bytes)
        self.max_len = max_len
        self.started = False

    @property
    def capacity(self) -> int:
        return self.max_len if self.started else 0

    @property
    def tokens_held(self) -> int:
        return self.offset

    def update(self, n: int) -> int:
        if self.offset + n > self.max_len:
            raise ValueError(
                f"static: max_len={self.max_len} tokens are preallocated and {self.offset} are held; "
                f"{n} more do not fit (context {self.offset + n} > max_len {self.max_len}); raise max_len"
            )
        self.started = True
        self.offset += n
        return self.bytes_allocated

    def regular_steps(self) -> int:
        return self.max_len - self.offset if self.started else 0

    def skip(self, k: int) -> None:
        self.offset += k

    def settled(self) -> bool:
        return self.started

    def cycle_key(self, n: int):
        return (self.started,)

    def cycle_horizon(self, n: int) -> int:
        return max(0, (self.max_len - self.offset) // n)  # the updates that still fit


class DynamicSliding(Rule):
    """``DynamicSlidingWindowLayer(window)``: ``concat(old, new)`` then keep the last
    ``window - 1`` tokens, as transformers does. One difference: with ``window == 1``
    transformers' slice ``[-0:]`` keeps everything, while cachelib's layer keeps nothing."""

    kind = "DynamicSlidingWindowLayer"

    def __init__(self, token_bytes: int, window: int):
        super().__init__(token_bytes)
        self.window = window
        self.stored = 0
        self.bounded = True

    @property
    def capacity(self) -> int:
        return self.stored

    @property
    def tokens_held(self) -> int:
        return self.stored

    def _keep(self, full: int) -> int:
        return min(full, self.window - 1)

    def update(self, n: int) -> int:
        before = self.bytes_allocated
        full = self.stored + n
        self.stored = self._keep(full)
        self.offset += n
        return before + full * self.token_bytes

    def regular_steps(self) -> int:
        return UNBOUNDED

    def skip(self, k: int) -> None:
        self.stored = self._keep(self.stored + k)
        self.offset += k

    def settled(self) -> bool:
        return self.bounded and self.stored == self.window - 1

    def cycle_key(self, n: int):
        return (self.stored,)


class StaticSliding(Rule):
    """transformers ``StaticSlidingWindowLayer(max_cache_len, window)``: ``min(window,
    max_cache_len)`` slots allocated at the first update; once full, a 1-token update rolls a
    copy of the buffer, a longer one concatenates ``buffer[1:] + new``."""

    kind = "StaticSlidingWindowLayer"
    bounded = True

    def __init__(self, token_bytes: int, max_cache_len: int, window: int):
        super().__init__(token_bytes)
        self.cap_when_started = min(window, max_cache_len)
        self.started = False

    @property
    def capacity(self) -> int:
        return self.cap_when_started if self.started else 0

    @property
    def tokens_held(self) -> int:
        return min(self.offset, self.capacity)

    def update(self, n: int) -> int:
        self.started = True
        cap = self.cap_when_started
        before = self.bytes_allocated
        current = self.offset
        self.offset += n
        tb = self.token_bytes
        if current >= cap:
            return before + (cap if n == 1 else cap - 1 + n) * tb
        if current + n > cap:
            return before + (current + n) * tb if current else before
        return before

    def regular_steps(self) -> int:
        return UNBOUNDED if self.started else 0

    def skip(self, k: int) -> None:
        self.offset += k

    def settled(self) -> bool:
        return self.started and self.offset >= self.cap_when_started

    def cycle_key(self, n: int):
        return self.started, ("full" if self.offset >= self.cap_when_started else self.offset)


class Kivi(Rule):
    """transformers ``QuantizedLayer`` (KIVI-style) with our quantizer. The first update
    quantizes all its tokens; later ones dequantize everything, append the residual and the new
    tokens at full precision, and either keep the new tokens in the residual or, when the
    residual would reach ``residual_length``, requantize every token and empty the residual.
    The residual therefore holds at most ``residual_length - 1`` tokens."""

    kind = "QuantizedLayer"

    def __init__(self, fp_token_bytes: int, q_token_bytes: int, residual_length: int):
        super().__init__(fp_token_bytes)
        self.q_token_bytes = q_token_bytes
        self.residual_length = residual_length
        self.quantized = 0
        self.residual = 0
        self.started = False

    @property
    def capacity(self) -> int:
        return self.quantized + self.residual

    @property
    def tokens_held(self) -> int:
        return self.quantized + self.residual

    @property
    def bytes_allocated(self) -> int:
        return self.quantized * self.q_token_bytes + self.residual * self.token_bytes

    @property
    def bytes_used(self) -> int:
        return self.bytes_allocated

    def update(self, n: int) -> int:
        before = self.bytes_allocated
        self.offset += n
        if not self.started:
            self.started = True
            self.quantized = n
            return before + self.bytes_allocated
        total = self.quantized + self.residual + n
        # dequantized copy + the concatenated full-precision states returned to attention
        peak = before + (self.quantized + total) * self.token_bytes
        if self.residual + n >= self.residual_length:
            self.quantized, self.residual = total, 0
            return peak + self.bytes_allocated  # new quantized arrays while the old ones live
        self.residual += n
        return peak + self.residual * self.token_bytes  # the residual's concatenation

    def regular_steps(self) -> int:
        return max(0, self.residual_length - 1 - self.residual) if self.started else 0

    def skip(self, k: int) -> None:
        self.residual += k
        self.offset += k

    def cycle_key(self, n: int):
        return self.started, self.residual


class QuantizeAfter(Rule):
    """``QuantizedKVCache(start=N)`` of cachelib (both backends): full precision until an update
    begins with ``offset >= start``; that update first converts the buffer (as mlx-lm's
    ``to_quantized`` does between steps: the quantized arrays keep the full buffer's slot count,
    and the conversion holds both copies), then writes quantized."""

    def __init__(self, fp_token_bytes: int, q_token_bytes: int, start: int, step: int = STEP):
        super().__init__(fp_token_bytes)
        self.start = start
        self.inner: StepGrowth = StepGrowth(fp_token_bytes, step, kind="KVCache")
        self.q_token_bytes = q_token_bytes
        self.converted = False

    @property
    def kind(self) -> str:  # type: ignore[override]
        return self.inner.kind

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    @property
    def tokens_held(self) -> int:
        return self.inner.tokens_held

    @property
    def bytes_allocated(self) -> int:
        return self.inner.bytes_allocated

    @property
    def bytes_used(self) -> int:
        return self.inner.bytes_used

    def update(self, n: int) -> int:
        peak = 0
        if not self.converted and self.offset >= self.start:
            fp = self.inner.bytes_allocated
            q = StepGrowth(self.q_token_bytes, STEP, kind="QuantizedKVCache")
            q.cap, q.offset = self.inner.cap, self.inner.offset
            self.inner, self.converted = q, True
            peak = fp + q.bytes_allocated
        peak = max(peak, self.inner.update(n))
        self.offset = self.inner.offset
        return peak

    def regular_steps(self) -> int:
        k = self.inner.regular_steps()
        if not self.converted:
            k = min(k, max(0, self.start - self.offset))
        return k

    def skip(self, k: int) -> None:
        self.inner.skip(k)
        self.offset = self.inner.offset

    def cycle_key(self, n: int):
        inner = self.inner.cycle_key(n)
        return None if inner is None else (self.converted, inner)

    def cycle_horizon(self, n: int) -> int:
        if self.converted:
            return UNBOUNDED
        return max(0, -(-(self.start - self.offset) // n))  # the updates that begin before start

    def copy(self) -> Rule:
        twin = copy.copy(self)
        twin.inner = self.inner.copy()
        return twin


class RecurrentState(Rule):
    """mlx-lm ``ArraysCache`` / transformers ``LinearAttentionLayer`` of a Mamba-style layer:
    fixed-size conv and SSM state arrays, set at the first update and replaced (MLX) or copied
    into (torch) at every update. All of it counts as used."""

    kind = "ArraysCache"
    bounded = True

    def __init__(self, state_bytes: int, kind: str | None = None):
        super().__init__(0, kind)
        self.state_bytes = state_bytes
        self.started = False

    @property
    def capacity(self) -> int:
        return 0

    @property
    def tokens_held(self) -> int:
        return 0

    @property
    def bytes_allocated(self) -> int:
        return self.state_bytes if self.started else 0

    @property
    def bytes_used(self) -> int:
        return self.bytes_allocated

    def update(self, n: int) -> int:
        before = self.bytes_allocated
        self.started = True
        self.offset += n
        return before + self.bytes_allocated  # the new state is computed while the old one lives

    def regular_steps(self) -> int:
        return UNBOUNDED if self.started else 0

    def skip(self, k: int) -> None:
        self.offset += k

    def settled(self) -> bool:
        return self.started

    def cycle_key(self, n: int):
        return (self.started,)


# ---------------------------------------------------------------------------------------------
# runtimes' own storage formats and allocators

# KV storage formats by name: (bytes, elements) of one block, from the format table (core/formats.py,
# where each figure's source is given).
KV_FORMATS: dict[str, tuple[int, int]] = {f.name: (f.block_bytes, f.block) for f in FORMATS.values()}


def format_bytes(elements: int, kv_format: str) -> int:
    """Bytes ``elements`` values take in ``kv_format`` (a whole number of its blocks)."""
    if kv_format not in KV_FORMATS:
        raise ValueError(f"unknown KV format {kv_format!r}; allowed: {', '.join(KV_FORMATS)}")
    size, per = KV_FORMATS[kv_format]
    if elements % per:
        raise ValueError(f"{kv_format} stores blocks of {per} elements; {elements} is not a multiple of {per}")
    return elements // per * size


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


class Paged(Rule):
    """vLLM's paged allocation of a full-attention layer (``FullAttentionSpec``, the
    ``FullAttentionManager``): a sequence holds ``ceil(tokens / block_size)`` blocks of the
    preallocated pool; a new block is taken when a token passes the last one. No copies."""

    kind = "PagedBlocks"

    def __init__(self, token_bytes: int, block_size: int, max_slots: int | None = None, kind: str | None = None):
        super().__init__(token_bytes, kind)
        self.block = block_size
        self.max_slots = max_slots  # a cap on the slots (None: none)
        self.bounded = max_slots is not None

    @property
    def capacity(self) -> int:
        slots = _blocks(self.offset, self.block) * self.block
        return slots if self.max_slots is None else min(slots, self.max_slots)

    @property
    def tokens_held(self) -> int:
        return min(self.offset, self.capacity)

    def _capped(self) -> bool:
        return self.max_slots is not None and self.capacity == self.max_slots

    def update(self, n: int) -> int:
        self.offset += n
        return self.bytes_allocated

    def regular_steps(self) -> int:
        if self._capped():
            return UNBOUNDED
        return self.capacity - self.offset  # updates that fit the blocks held

    def skip(self, k: int) -> None:
        self.offset += k

    def settled(self) -> bool:
        return self._capped()

    def cycle_key(self, n: int):
        return ("capped",) if self._capped() else (self.offset % self.block,)


class PagedSliding(Rule):
    """vLLM's paged allocation of a sliding-window layer (``SlidingWindowManager``): before a
    step schedules ``n`` tokens at ``offset``, the blocks wholly before token ``offset - window
    + 1`` go back to the pool (``remove_skipped_blocks``), then blocks up to ``offset + n`` are
    taken; so a sequence holds at most ``ceil((window - 1 + n) / block_size) + 1`` blocks
    (``SlidingWindowSpec.max_memory_usage_bytes``)."""

    kind = "PagedSlidingWindow"
    bounded = True

    def __init__(self, token_bytes: int, window: int, block_size: int):
        super().__init__(token_bytes)
        self.window, self.block = window, block_size
        self.first_block = 0  # the first block still held

    @property
    def capacity(self) -> int:
        return (_blocks(self.offset, self.block) - self.first_block) * self.block

    @property
    def tokens_held(self) -> int:
        return self.offset - self.first_block * self.block

    def update(self, n: int) -> int:
        skipped = max(0, self.offset - self.window + 1)
        self.first_block = max(self.first_block, skipped // self.block)
        self.offset += n
        return self.bytes_allocated

    def _steady(self) -> bool:
        return self.offset >= self.window + self.block

    def cycle_key(self, n: int):
        if not self._steady():
            return None
        return self.offset % self.block, self.offset // self.block - self.first_block


class Preallocated(Rule):
    """llama.cpp's ``llama_kv_cache``: ``slots`` cells allocated when the context is created and
    written in place. ``limit``: the context the cells serve (a longer run is refused, as
    llama.cpp refuses to decode past ``n_ctx``); None: the cells are reused as a window (the SWA
    cache of ``llama_kv_cache_iswa``). ``seqs``: the sequences whose tokens the cells hold (the
    cells count every slot's; ``token_bytes`` is then one cell's)."""

    kind = "llama_kv_cache"
    bounded = True

    def __init__(self, token_bytes: int, slots: int, limit: int | None = None, kind: str | None = None, seqs: int = 1):
        super().__init__(token_bytes, kind)
        self.slots, self.limit, self.seqs = slots, limit, seqs

    @property
    def capacity(self) -> int:
        return self.slots

    @property
    def tokens_held(self) -> int:
        return min(self.offset * self.seqs, self.slots)

    def update(self, n: int) -> int:
        if self.limit is not None and self.offset + n > self.limit:
            raise ValueError(
                f"llama.cpp: a context of {self.limit} tokens (-c) is allocated and {self.offset} are held; "
                f"{n} more do not fit (context {self.offset + n} > {self.limit}); raise -c"
            )
        self.offset += n
        return self.bytes_allocated

    def regular_steps(self) -> int:
        return UNBOUNDED if self.limit is None else self.limit - self.offset

    def skip(self, k: int) -> None:
        self.offset += k

    def settled(self) -> bool:
        return True

    def cycle_key(self, n: int):
        return ()

    def cycle_horizon(self, n: int) -> int:
        return UNBOUNDED if self.limit is None else max(0, (self.limit - self.offset) // n)


# llama.cpp's context and KV sizes (build b10605). llama-context.cpp: n_batch = min(n_ctx, n_batch)
# for causal models, n_ubatch = min(n_batch, n_ubatch), n_ctx = GGML_PAD(n_ctx, 256); without a
# unified KV each of n_seq_max streams gets n_ctx_seq = GGML_PAD(n_ctx / n_seq_max, 256) cells.
# llama-kv-cache-iswa.cpp: the SWA cache has GGML_PAD(min(n_ctx_seq, n_swa * (unified ? n_seq_max : 1)
# + n_ubatch), 256) cells per stream, or n_ctx_seq with --swa-full.
LLAMA_CPP_PAD = 256


@dataclass(frozen=True)
class LlamaCppCells:
    """The cells a llama.cpp context allocates: ``n_ctx`` as llama.cpp logs it, ``n_ctx_seq``
    (one sequence's limit), ``streams`` (1 unified, else one per slot) and the cells per stream of
    the full and of the SWA cache (the log's "cells"; the bytes count ``cells x streams``)."""

    n_ctx: int
    n_ctx_seq: int
    streams: int
    full: int
    swa: int


def llama_cpp_cells(
    n_ctx: int,
    slots: int = 1,
    unified: bool = False,
    *,
    window: int = 0,
    swa_full: bool = False,
    ubatch: int = 512,
    n_batch: int = 2048,
) -> LlamaCppCells:
    """llama.cpp's cells for ``-c n_ctx --parallel slots [--kv-unified] [--swa-full] -ub ubatch
    -b n_batch`` on a model whose SWA layers have window ``window`` (0: none)."""
    if min(n_ctx, slots, ubatch, n_batch) < 1:
        raise ValueError(
            f"llama.cpp sizes need n_ctx, slots, ubatch and n_batch >= 1, got {n_ctx}, {slots}, {ubatch}, {n_batch}"
        )
    n_ubatch = min(n_ctx, n_batch, ubatch)
    ctx = _ceil_steps(n_ctx, LLAMA_CPP_PAD)
    if unified:
        seq, streams = ctx, 1
    else:
        seq, streams = _ceil_steps(ctx // slots, LLAMA_CPP_PAD), slots
        ctx = seq * slots
    swa = seq if swa_full else _ceil_steps(min(seq, window * (slots if unified else 1) + n_ubatch), LLAMA_CPP_PAD)
    return LlamaCppCells(ctx, seq, streams, seq, swa)


class LlamaCppGrowing(Rule):
    """llama.cpp's KV cache where each moment is sized as the smallest ``-c`` that holds the run
    so far would size it (a search over contexts): ``-c = offset * per`` (the batch's sequences
    with a unified KV, every slot without), cells as :func:`llama_cpp_cells` gives them for the
    full (``swa=False``) or the SWA cache. ``token_bytes`` is one cell's; ``seqs`` the batch."""

    kind = "llama_kv_cache"

    def __init__(
        self,
        token_bytes: int,
        *,
        per: int,
        slots: int,
        unified: bool,
        swa: bool,
        window: int = 0,
        swa_full: bool = False,
        ubatch: int = 512,
        n_batch: int = 2048,
        seqs: int = 1,
        kind: str | None = None,
    ):
        super().__init__(token_bytes, kind)
        self.per, self.slots, self.seqs = per, slots, seqs
        self.unified, self.swa, self.window, self.swa_full = unified, swa, window, swa_full
        self.ubatch, self.n_batch = ubatch, n_batch
        self.bounded = swa and not swa_full

    def _sizes(self) -> LlamaCppCells:
        return llama_cpp_cells(
            self.offset * self.per,
            self.slots,
            self.unified,
            window=self.window,
            swa_full=self.swa_full,
            ubatch=self.ubatch,
            n_batch=self.n_batch,
        )

    @property
    def capacity(self) -> int:
        if self.offset <= 0:
            return 0
        c = self._sizes()
        return (c.swa if self.swa else c.full) * c.streams

    @property
    def tokens_held(self) -> int:
        return min(self.offset * self.seqs, self.capacity)

    def update(self, n: int) -> int:
        self.offset += n
        return self.bytes_allocated

    def _capped(self) -> bool:
        # the SWA cells stop growing once n_ubatch is final and n_ctx_seq covers window * k + n_ubatch
        n_ub = min(self.ubatch, self.n_batch)
        if not self.bounded or self.offset * self.per < n_ub:
            return False
        return self._sizes().n_ctx_seq >= self.window * (self.slots if self.unified else 1) + n_ub

    def regular_steps(self) -> int:
        if self._capped():
            return UNBOUNDED
        if self.offset <= 0 or (self.bounded and self.offset * self.per < min(self.ubatch, self.n_batch)):
            return 0  # n_ubatch = min(n_ctx, ...) still moves the SWA cells
        # -c = offset * per keeps its padding (so its cells) while offset * per stays within it
        return _ceil_steps(self.offset * self.per, LLAMA_CPP_PAD) // self.per - self.offset

    def skip(self, k: int) -> None:
        self.offset += k

    def settled(self) -> bool:
        return self._capped()

    def cycle_key(self, n: int):
        if self._capped():
            return ("capped",)
        if self.bounded:
            return None  # a cap ahead
        return (self.offset % LLAMA_CPP_PAD,)


class BudgetEachStep(Rule):
    """The importance caches that evict every step (``knorm``, ``tova``, ``h2o``; both backends,
    :mod:`cachelib.core.importance`): an update of ``n`` tokens first gathers the kept ``budget
    - 1`` tokens (one-token updates) or ``budget`` (longer ones) into new arrays while the old
    ones live, then concatenates the ``n`` new ones (old + new)."""

    kind = "BudgetEachStep"
    bounded = True

    def __init__(self, token_bytes: int, budget: int, kind: str | None = None):
        super().__init__(token_bytes, kind)
        self.budget = budget
        self.held = 0

    @property
    def capacity(self) -> int:
        return self.held

    @property
    def tokens_held(self) -> int:
        return self.held

    def update(self, n: int) -> int:
        tb = self.token_bytes
        keep = self.budget - 1 if n == 1 else self.budget
        peak = self.held * tb
        if self.held > keep:
            peak = (self.held + keep) * tb
            self.held = keep
        peak = max(peak, (2 * self.held + n) * tb if self.held else n * tb)
        self.held += n
        self.offset += n
        return peak

    def regular_steps(self) -> int:
        if self.held == self.budget:
            return UNBOUNDED
        return max(0, self.budget - self.held) if self.held < self.budget else 0

    def skip(self, k: int) -> None:
        if self.held < self.budget:
            self.held += k
        self.offset += k

    def settled(self) -> bool:
        return self.held == self.budget

    def cycle_key(self, n: int):
        return (self.held,)


class BudgetOnce(Rule):
    """The importance caches that compress once (``snapkv``; ``pyramidkv`` with each layer's own
    budget): updates concatenate (old + new); the first one-token update first gathers
    ``budget`` of the held tokens into new arrays when more are held, and from then on nothing
    is evicted."""

    kind = "BudgetOnce"

    def __init__(self, token_bytes: int, budget: int, kind: str | None = None):
        super().__init__(token_bytes, kind)
        self.budget = budget
        self.held = 0
        self.done = False

    @property
    def capacity(self) -> int:
        return self.held

    @property
    def tokens_held(self) -> int:
        return self.held

    def update(self, n: int) -> int:
        tb = self.token_bytes
        peak = self.held * tb
        if not self.done and n == 1:
            self.done = True
            if self.held > self.budget:
                peak = (self.held + self.budget) * tb
                self.held = self.budget
        peak = max(peak, (2 * self.held + n) * tb if self.held else n * tb)
        self.held += n
        self.offset += n
        return peak

    def regular_steps(self) -> int:
        return UNBOUNDED if self.done else 0

    def skip(self, k: int) -> None:
        self.held += k
        self.offset += k

    def cycle_key(self, n: int):
        if not self.done and n == 1:
            return None  # the compression is ahead
        return (self.done,)


class BudgetOnceHeads(BudgetOnce):
    """SnapKV with Ada-KV's per-head budgets (``snapkv:adaptive=1``): as :class:`BudgetOnce`,
    but at the compression the layer's ``kv_heads`` heads share ``budget x kv_heads`` slots
    unevenly, each at least ``safe``, stored padded to the largest head's count. The tokens held
    (the used bytes) are exact; the padded slots depend on the scores, so the allocation is
    planned at its bound, ``min(held, budget x kv_heads - (kv_heads - 1) x safe)`` (one head
    taking every slot the others need not keep): measured bytes are at most these."""

    kind = "BudgetOnceHeads"

    def __init__(self, token_bytes: int, budget: int, kv_heads: int, safe: int, kind: str | None = None):
        super().__init__(token_bytes, budget, kind=kind)
        self.kv_heads = kv_heads
        self.safe = safe
        self.slots = 0

    @property
    def capacity(self) -> int:
        return self.slots

    def update(self, n: int) -> int:
        tb = self.token_bytes
        peak = self.slots * tb
        if not self.done and n == 1:
            self.done = True
            if self.held > self.budget:
                padded = min(self.held, self.budget * self.kv_heads - (self.kv_heads - 1) * self.safe)
                peak = (self.slots + padded) * tb
                self.held, self.slots = self.budget, padded
        peak = max(peak, (2 * self.slots + n) * tb if self.slots else n * tb)
        self.held += n
        self.slots += n
        self.offset += n
        return peak

    def skip(self, k: int) -> None:
        self.held += k
        self.slots += k
        self.offset += k
