"""The ring state machine of cachelib.core.ring against a brute-force ring of Python lists.

The list ring moves real slot contents (the absolute position each slot holds, -1 for none) the
way mlx-lm's RotatingKVCache moves its arrays, deciding from the contents themselves (what is
held, in which order); the state machine only sees integers. Every update of random sequences
must agree: the same slots written, the same capacity and pointer, the same slot table.
"""

from __future__ import annotations

import numpy as np
import pytest

from cachelib.core import ring
from cachelib.core.units import STEP


class ListRing:
    """A ring whose slots are a list of the positions they hold (-1: nothing)."""

    def __init__(self, max_size: int, keep: int, step: int):
        self.max_size, self.keep, self.step = max_size, keep, step
        self.slots: list[int] = []
        self.offset = 0
        self.pointer = 0  # where the next one-token write goes, before wrapping

    def write_one(self) -> int:
        if not self.slots or (self.offset >= len(self.slots) and len(self.slots) < self.max_size):
            self.slots += [-1] * min(self.step, self.max_size - self.offset)
            self.pointer = self.offset
        over = len(self.slots) - self.max_size
        if over > 0:  # a block left the slots in time order: drop the oldest after the sinks
            self.slots = self.slots[: self.keep] + self.slots[self.keep + over :]
            self.pointer = self.max_size
        if self.pointer == self.max_size:
            self.pointer = self.keep
        slot = self.pointer
        self.slots[slot] = self.offset
        self.offset += 1
        self.pointer += 1
        return slot

    def write_block(self, n: int) -> None:
        held = sorted(p for p in self.slots if 0 <= p < self.offset)  # oldest first
        drop = max(0, len(held) - (self.max_size - 1))
        held = held[: self.keep] + held[self.keep + drop :]
        self.slots = held + list(range(self.offset, self.offset + n))
        self.offset += n
        self.pointer = len(self.slots)

    def trim(self, n: int) -> None:
        n = min(n, self.offset)
        self.offset -= n
        self.pointer -= n
        self.slots = [p if p < self.offset else -1 for p in self.slots]


class IntRing:
    """The integers a ring cache keeps, advanced only by cachelib.core.ring."""

    def __init__(self, max_size: int, keep: int, step: int):
        self.max_size, self.keep, self.step = max_size, keep, step
        self.offset = self.idx = self.capacity = 0

    def write_one(self) -> ring.OneWrite:
        w = ring.write_one(self.offset, self.idx, self.capacity, self.max_size, self.keep, self.step)
        self.capacity = w.capacity
        self.offset += 1
        self.idx = w.slot + 1
        return w

    def write_block(self, n: int) -> ring.BlockWrite:
        b = ring.write_block(n, self.offset, self.idx, self.capacity, self.max_size, self.keep)
        self.capacity = b.capacity
        self.offset += n
        self.idx = b.capacity
        return b

    def trim(self, n: int) -> int:
        n, self.offset, self.idx = ring.trim(n, self.offset, self.idx)
        return n

    def slot_positions(self) -> np.ndarray:
        return ring.ring_slot_positions(self.offset, self.idx, self.keep, self.capacity)


def _agree(ints: IntRing, lists: ListRing, where: str) -> None:
    assert ints.capacity == len(lists.slots), where
    assert ints.offset == lists.offset, where
    assert ints.slot_positions().tolist() == lists.slots, where


def _random_run(rng, max_size: int, keep: int, step: int, updates: int) -> None:
    ints, lists = IntRing(max_size, keep, step), ListRing(max_size, keep, step)
    for i in range(updates):
        where = f"max_size={max_size} keep={keep} step={step} update {i}"
        r = rng.random()
        if r < 0.1 and ring.trimmable(ints.offset, max_size) and ints.offset:
            n = int(rng.integers(1, ints.offset + 1))
            assert ints.trim(n) == n
            lists.trim(n)
        elif r < 0.75:
            w = ints.write_one()
            assert w.slot == lists.write_one(), where
        else:
            n = int(rng.integers(2, 9))
            before = lists.slots
            b = ints.write_block(n)
            lists.write_block(n)
            assert b.capacity == len(lists.slots), where
            assert b.held - b.drop + n == b.capacity, where
            if b.wrapped:  # a wrapped ring's slots were out of time order
                assert [p for p in before if p >= 0] != sorted(p for p in before if p >= 0), where
        _agree(ints, lists, where)


@pytest.mark.parametrize("seed", range(8))
def test_random_updates_match_the_list_ring(seed):
    rng = np.random.default_rng(seed)
    for _ in range(40):
        max_size = int(rng.integers(1, 24))
        keep = int(rng.integers(0, min(max_size, 5)))
        step = int(rng.choice([1, 3, 4, STEP]))
        _random_run(rng, max_size, keep, step, int(rng.integers(1, 60)))


def test_one_token_updates_fill_in_steps_then_wrap_to_keep():
    ints = IntRing(max_size=5, keep=2, step=2)
    grows, slots = [], []
    for _ in range(8):
        w = ints.write_one()
        grows.append(w.grow)
        slots.append(w.slot)
    # growth by whole steps, the last one short of max_size; then the ring slots [2, 5) in turn
    assert grows == [2, None, 2, None, 1, None, None, None]
    assert slots == [0, 1, 2, 3, 4, 2, 3, 4]
    assert ints.capacity == 5
    assert ints.slot_positions().tolist() == [0, 1, 5, 6, 7]


def test_the_pointer_wraps_at_max_size_and_says_so():
    ints = IntRing(max_size=3, keep=1, step=STEP)
    wraps = [ints.write_one().wraps for _ in range(6)]
    assert wraps == [False, False, False, True, False, True]


def test_a_block_after_a_wrap_reorders_and_keeps_max_size_minus_one_old_tokens():
    ints, lists = IntRing(6, 2, STEP), ListRing(6, 2, STEP)
    for _ in range(9):  # positions 0..8; the ring wrapped once
        ints.write_one()
        lists.write_one()
    b = ints.write_block(3)
    lists.write_block(3)
    assert b.wrapped and b.held == 6
    assert b.drop == 1  # 6 held, 5 kept: each new token sees 6 tokens
    assert b.capacity == 8  # max_size + n - 1 slots until the next one-token update cuts
    # sinks 0, 1; of the ring's 5..8 the oldest goes; then the block
    assert lists.slots == ints.slot_positions().tolist() == [0, 1, 6, 7, 8, 9, 10, 11]


def test_a_one_token_update_after_an_oversized_block_cuts_back_to_max_size():
    ints = IntRing(4, 1, STEP)
    ints.write_block(7)
    w = ints.write_one()
    assert (w.grow, w.cut, w.slot, w.wraps) == (None, 3, 1, True)
    assert ints.capacity == 4
    assert ints.slot_positions().tolist() == [0, 7, 5, 6]


def test_a_block_into_an_empty_ring_is_taken_whole():
    assert ring.write_block(10, 0, 0, 0, max_size=4, keep=1) == ring.BlockWrite(False, 0, 0, 10)


def test_trim_steps_back_offset_and_pointer_and_a_block_then_cuts_the_trimmed_slots():
    ints = IntRing(10, 0, 4)
    for _ in range(6):
        ints.write_one()
    assert ring.trimmable(ints.offset, 10)
    assert ints.trim(2) == 2
    assert (ints.offset, ints.idx, ints.capacity) == (4, 4, 8)
    b = ints.write_block(3)
    assert (b.wrapped, b.held, b.drop, b.capacity) == (False, 4, 0, 7)
    assert ring.trim(5, offset=3, idx=3) == (3, 0, 0)  # at most offset
    assert not ring.trimmable(10, 10)


def test_held_counts_follow_slicing_for_a_ring_trimmed_below_keep():
    # A wrapped ring trimmed past its sinks (mlx-lm allows it): [:keep] + [idx:] + [keep:idx]
    # then yields keep + capacity - idx slots, which is what the arrays hold.
    assert ring.temporal_order(offset=20, idx=1, capacity=8, keep=3) == (True, 10)
    assert ring.temporal_order(offset=5, idx=9, capacity=8, keep=0) == (False, 8)


def test_steady_writes_and_advance_match_one_token_updates():
    rng = np.random.default_rng(7)
    for _ in range(200):
        max_size = int(rng.integers(1, 16))
        keep = int(rng.integers(0, max_size))
        ints = IntRing(max_size, keep, int(rng.choice([1, 4, STEP])))
        for _ in range(int(rng.integers(0, 30))):
            if rng.random() < 0.8:
                ints.write_one()
            else:
                ints.write_block(int(rng.integers(2, 6)))
        k = ring.steady_writes(ints.offset, ints.capacity, max_size)
        k = int(rng.integers(0, 40)) if k is None else k
        start = (ints.idx, ints.capacity)
        for _ in range(k):
            w = ints.write_one()
            assert w.grow is None and w.cut == 0
        assert ring.advance(k, start[0], start[1], max_size, keep) == ints.idx


def test_mask_slot_is_the_pointer_or_zero_at_max_size():
    assert ring.mask_slot(3, 8) == 3
    assert ring.mask_slot(8, 8) == 0


def test_slot_table_before_the_first_wrap_is_linear_and_marks_unused_slots():
    assert ring.ring_slot_positions(3, 3, 2, 6).tolist() == [0, 1, 2, -1, -1, -1]
    assert ring.ring_slot_positions(9, None, 2, 6).tolist() == [0, 1, 2, 3, 4, 5]
    assert ring.ring_slot_positions(9, 3, 2, 6).tolist() == [0, 1, 8, 5, 6, 7]
