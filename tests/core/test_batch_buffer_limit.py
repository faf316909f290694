"""The strategy batch's buffer limit: a quarter of the memory available, never under 1 GiB."""

from __future__ import annotations

from cachelib.core import memory


def test_the_limit_is_a_quarter_of_the_available_memory_with_a_floor_of_one_gib():
    gib = 1 << 30
    assert memory.batch_buffer_limit(0) == gib
    assert memory.batch_buffer_limit(3 * gib) == gib  # a quarter is 0.75 GiB: the floor holds
    assert memory.batch_buffer_limit(16 * gib) == 4 * gib
    assert memory.batch_buffer_limit(22 * gib + 3) == int((22 * gib + 3) * 0.25)
