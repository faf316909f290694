"""The one attention-mask predicate (cachelib.core.masks) against the rule written out by hand,
on Python ints and on NumPy arrays, and the profiler's dense mask that is built from it."""

from __future__ import annotations

import numpy as np
import pytest

from cachelib.core.masks import visible, visible_held
from cachelib.core.ring import ring_slot_positions
from cachelib.introspect import dense_causal_mask


def _by_hand(q: int, p: int, window: int | None) -> bool:
    if p > q:  # a key from the future
        return False
    return window is None or q - p < window


@pytest.mark.parametrize("window", [None, 1, 3, 8])
def test_visible_on_ints_is_causal_and_windowed(window):
    for q in range(10):
        for p in range(-2, 12):
            assert bool(visible(q, p, window)) == _by_hand(q, p, window), (q, p, window)


def test_a_window_of_one_sees_only_the_query_itself():
    assert [bool(visible(5, p, 1)) for p in range(8)] == [p == 5 for p in range(8)]


@pytest.mark.parametrize("window", [None, 2, 5])
def test_visible_broadcasts_over_arrays_like_elementwise_ints(window):
    q = np.arange(3, 9)[:, None]
    p = np.arange(-1, 10)[None, :]
    mask = visible(q, p, window)
    assert mask.shape == (6, 11) and mask.dtype == bool
    expected = [[_by_hand(int(a), int(b), window) for b in p[0]] for a in q[:, 0]]
    assert mask.tolist() == expected


def test_visible_held_hides_empty_slots():
    p = np.array([0, -1, 2, 3, -1])
    assert visible_held(3, p).tolist() == [True, False, True, True, False]
    assert visible_held(3, p, window=2).tolist() == [False, False, True, True, False]
    # without the held check, -1 would pass as a past position
    assert bool(visible(3, -1)) is True


@pytest.mark.parametrize("window", [None, 3])
def test_dense_mask_of_a_wrapped_ring_follows_the_slot_table(window):
    slots = ring_slot_positions(offset=9, write_index=3, keep=2, capacity=6)  # [0 1 8 5 6 7]
    mask = dense_causal_mask(2, slots, query_start=8, window=window)
    expected = [[_by_hand(q, int(p), window) and p >= 0 for p in slots] for q in (8, 9)]
    assert mask.tolist() == expected
    unused = dense_causal_mask(1, np.array([0, 1, -1]), query_start=1)
    assert unused.tolist() == [[True, True, False]]
