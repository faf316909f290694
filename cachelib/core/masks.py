"""The attention-mask rule, once: which key positions a query position may attend.

``visible(q, p, window)`` is elementwise over anything with comparison operators (Python ints,
NumPy arrays, MLX arrays), so each backend builds its dense masks by broadcasting a column of
query positions against a row of key positions, and the profiler's slot tables use the same
rule. Empty slots are marked by position -1 (see ``CacheView.slot_positions``) and are never
visible.
"""

from __future__ import annotations


def visible(query_pos, key_pos, window: int | None = None):
    """Causal attention, optionally windowed: key position ``p`` is visible to query position
    ``q`` iff ``p <= q`` and, with a window, ``q - p < window``."""
    mask = key_pos <= query_pos
    if window is not None:
        mask = mask & (query_pos - key_pos < window)
    return mask


def visible_held(query_pos, key_pos, window: int | None = None):
    """:func:`visible` for a slot table, where position -1 marks a slot that holds nothing."""
    return (key_pos >= 0) & visible(query_pos, key_pos, window)
