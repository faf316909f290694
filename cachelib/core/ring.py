"""The ring of mlx-lm's ``RotatingKVCache`` as integers: what each update does to the slots.

A ring holds at most ``max_size`` token slots on the token axis. Slots ``[0, keep)`` hold the
first ``keep`` positions for good (attention sinks); the ring slots ``[keep, max_size)`` are
overwritten in turn. Its state is three integers, ``offset`` (tokens seen), ``idx`` (mlx-lm's
``_idx``: the slot after the last one written) and ``capacity`` (slots allocated now), and its
geometry is ``max_size``, ``keep`` and ``step`` (slots added per growth).

- A one-token update (:func:`write_one`) grows the buffer by up to ``step`` zero slots while it
  is below ``max_size``, first cuts the oldest ring slots if a block update left more than
  ``max_size``, and writes one slot, wrapping the pointer from ``max_size`` back to ``keep``.
- A block update (:func:`write_block`) puts the held tokens in temporal order, drops the oldest
  ring tokens so that ``max_size - 1`` old ones (sinks included) remain, and appends the block:
  the buffer briefly holds up to ``max_size + n - 1`` slots.
- :func:`trim` steps ``offset`` and ``idx`` back; :func:`ring_slot_positions` says which
  absolute position each slot holds.

Every ring cache (MLX, PyTorch, the MLX batch ring, the planner's byte rule) asks these
functions and applies the answer to its arrays, so the arithmetic exists once. Nothing here
knows arrays: the functions take and return integers (the slot table is a NumPy vector).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .units import STEP


class OneWrite(NamedTuple):
    """What a one-token update does, in this order: grow, cut, write ``slot``.

    After it: ``offset + 1``, ``idx = slot + 1``, ``capacity`` as given here.
    """

    # Zero slots appended at the end; None: the buffer does not grow. (0 or less only from a
    # state no update sequence reaches; the caches pass it on as mlx-lm does.)
    grow: int | None
    cut: int  # oldest ring slots [keep, keep + cut) dropped (0: none)
    slot: int  # the slot the token is written to
    wraps: bool  # the pointer went from max_size back to keep for this write
    capacity: int  # slots after the update


class BlockWrite(NamedTuple):
    """What a block update of ``n`` tokens does: order the held tokens, drop, append.

    After it: ``offset + n`` and ``idx = capacity``.
    """

    wrapped: bool  # held tokens are reordered: slots [0, keep), [idx, capacity), [keep, idx)
    held: int  # old tokens in temporal order (a prefix of the slots when not wrapped)
    drop: int  # oldest ring tokens (after the sinks) dropped from those (0: none)
    capacity: int  # slots after the update: held - drop + n


def write_one(offset: int, idx: int, capacity: int, max_size: int, keep: int, step: int = STEP) -> OneWrite:
    """The one-token update of a ring in state (``offset``, ``idx``, ``capacity``)."""
    grow = None
    if capacity == 0 or (offset >= capacity and capacity < max_size):
        # Still below max_size: the next step of slots (fewer near max_size); writing resumes
        # at the offset, since the slots past it are the fresh ones.
        grow = min(step, max_size - offset)
        capacity += grow
        idx = offset
    cut = capacity - max_size
    if cut > 0:  # a block update left more than max_size slots
        capacity = max_size
        idx = max_size
    else:
        cut = 0
    wraps = idx == max_size
    if wraps:
        idx = keep
    return OneWrite(grow, cut, idx, wraps, capacity)


def temporal_order(offset: int, idx: int, capacity: int, keep: int) -> tuple[bool, int]:
    """(wrapped, held): whether the slots must be reordered to put the held tokens oldest
    first (slots ``[0, keep)``, ``[idx:]``, ``[keep:idx]``), and how many slots that order
    yields. Unwrapped, the held tokens are the first ``held`` slots: those past ``idx`` are
    unused or trimmed. Lengths follow Python's slicing, so a ring trimmed below ``keep`` or
    past zero counts what its arrays would actually hold."""
    if idx == capacity:
        return False, capacity
    slots = range(capacity)
    if idx < offset:  # wrapped: the oldest ring token sits at idx
        return True, len(slots[:keep]) + len(slots[idx:]) + len(slots[keep:idx])
    return False, len(slots[:idx])


def make_room(held: int, n: int, max_size: int) -> tuple[int, int]:
    """(drop, capacity): old tokens to drop before appending ``n``, so that ``max_size - 1``
    remain and each new token sees ``max_size`` tokens, and the slots after appending."""
    drop = max(0, held - max_size + 1)
    return drop, held - drop + n


def write_block(n: int, offset: int, idx: int, capacity: int, max_size: int, keep: int) -> BlockWrite:
    """The update of ``n`` tokens at once (any ``n`` but the one-token write) of a ring in state
    (``offset``, ``idx``, ``capacity``). An empty ring takes the block as it is."""
    if capacity == 0:
        return BlockWrite(False, 0, 0, n)
    wrapped, held = temporal_order(offset, idx, capacity, keep)
    drop, capacity = make_room(held, n, max_size)
    return BlockWrite(wrapped, held, drop, capacity)


def trim(n: int, offset: int, idx: int) -> tuple[int, int, int]:
    """(trimmed, offset, idx) after dropping the last ``n`` tokens (at most ``offset``); the
    slots stay allocated."""
    n = min(offset, n)
    return n, offset - n, idx - n


def trimmable(offset: int, max_size: int) -> bool:
    """Trimming is exact only before the ring first overwrote a token."""
    return offset < max_size


def steady_writes(offset: int, capacity: int, max_size: int) -> int | None:
    """How many coming one-token updates neither grow nor cut the buffer (None: all of them)."""
    if capacity == 0 or capacity > max_size:
        return 0
    if capacity == max_size:
        return None
    return max(0, capacity - offset)


def advance(k: int, idx: int, capacity: int, max_size: int, keep: int) -> int:
    """``idx`` after ``k`` one-token updates that neither grow nor cut (see :func:`steady_writes`)."""
    if capacity < max_size or k == 0:
        return idx + k
    linear = min(k, max_size - idx)
    idx += linear
    k -= linear
    if k:  # the pointer sits at max_size: each write wraps around [keep, max_size)
        idx = keep + 1 + (k - 1) % (max_size - keep)
    return idx


def mask_slot(idx: int, max_size: int) -> int:
    """The slot mlx-lm's one-query mask takes the incoming token to land in: the pointer, or 0
    once it reached ``max_size`` (that mask does not know ``keep``; our caches keep it so)."""
    return idx if idx < max_size else 0


def ring_slot_positions(offset: int, write_index: int | None, keep: int, capacity: int) -> np.ndarray:
    """Absolute position held by each of ``capacity`` slots, -1 where a slot holds nothing.

    Until the ring first wraps (``offset <= capacity``) slots fill in order. After that, slots
    ``[0, keep)`` hold positions ``0..keep-1`` for good, the newest token sits just before the
    write index, and the ring slots ``[keep, capacity)`` hold the most recent
    ``capacity - keep`` positions in cyclic order starting at the write index.
    """
    slots = np.arange(capacity, dtype=np.int64)
    if offset <= capacity or write_index is None:
        return np.where(slots < offset, slots, -1)
    out = slots.copy()
    ring = capacity - keep
    # Distance back from the newest token (which sits at write_index - 1), cyclic in the ring.
    back = (write_index - 1 - slots[keep:]) % ring
    out[keep:] = offset - 1 - back
    return out
