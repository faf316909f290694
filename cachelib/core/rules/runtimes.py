"""The runtimes' own storage formats and allocators: vLLM's paged blocks, preallocated pools and
llama.cpp's cells."""

from __future__ import annotations

from dataclasses import dataclass

from ..formats import FORMATS
from .base import UNBOUNDED, Rule, ceil_steps

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
    ctx = ceil_steps(n_ctx, LLAMA_CPP_PAD)
    if unified:
        seq, streams = ctx, 1
    else:
        seq, streams = ceil_steps(ctx // slots, LLAMA_CPP_PAD), slots
        ctx = seq * slots
    swa = seq if swa_full else ceil_steps(min(seq, window * (slots if unified else 1) + n_ubatch), LLAMA_CPP_PAD)
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
        return ceil_steps(self.offset * self.per, LLAMA_CPP_PAD) // self.per - self.offset

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
