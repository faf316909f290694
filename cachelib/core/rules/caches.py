"""The rules of mlx-lm's and transformers' own layer-cache classes, and of cachelib's rings,
chunks and quantizing caches built on them."""

from __future__ import annotations

import copy

from .. import ring
from ..units import STEP
from .base import UNBOUNDED, Rule, ceil_steps


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
            grow = ceil_steps(n, self.step)
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
            grow = ceil_steps(n, self.step)
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
