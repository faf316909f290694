"""transformers' preallocated layers (``StaticLayer``, ``StaticSlidingWindowLayer``), written by
us with transformers 5.x semantics.

Both allocate their (B, H, max_cache_len, D) buffers on the first update and write in place.
``update`` returns the whole buffer and ``get_mask_sizes`` says so; the model's mask hides the
slots not yet written. Positions are tracked as Python ints (transformers keeps a tensor for
cudagraphs). Writing past ``max_cache_len`` raises :class:`CacheFullError` (a ``ValueError`` and
the ``IndexError`` transformers raises) before anything is changed; cropping more than is held
empties the layer (transformers' length goes negative).
"""

from __future__ import annotations

import torch

from ..introspect import CacheView, Written
from .base import AttentionLayer, CacheFullError, CropError, check_crop, check_ignored_keywords, dtype_name


class StaticLayer(AttentionLayer):
    is_compileable = True
    is_croppable = True

    def __init__(self, max_cache_len: int, **ignored):
        check_ignored_keywords(type(self).__name__, ignored)
        super().__init__()
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"{type(self).__name__}: max_cache_len must be an int >= 1, got {max_cache_len!r}")
        self.max_cache_len = max_cache_len
        self.length = 0  # tokens written = position of the next token

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        batch, heads = key_states.shape[:2]
        self.keys = torch.zeros(
            (batch, heads, self.max_cache_len, key_states.shape[-1]), dtype=key_states.dtype, device=self.device
        )
        self.values = torch.zeros(
            (batch, heads, self.max_cache_len, value_states.shape[-1]), dtype=value_states.dtype, device=self.device
        )
        self.is_initialized = True

    def room(self) -> int:
        """Tokens that can still be written."""
        return self.max_cache_len - self.length

    def check_room(self, n_new: int) -> None:
        if n_new > self.room():
            raise CacheFullError(
                f"{type(self).__name__}: {n_new} new tokens at position {self.length} do not fit in "
                f"max_cache_len={self.max_cache_len} (room for {self.room()}); the cache is unchanged"
            )

    def update(self, key_states, value_states, *args, **kwargs):
        n_new = key_states.shape[-2]
        self.check_room(n_new)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.length
        self.keys[..., start : start + n_new, :] = key_states
        self.values[..., start : start + n_new, :] = value_states
        self.length += n_new
        self.written = Written(start, start + n_new, True)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (all of them when that is more than held)."""
        # The buffers stay as they are: the next update overwrites the dropped slots.
        self.length -= check_crop(tokens_to_remove, self.length, type(self).__name__)

    def reset(self) -> None:
        if self.is_initialized:
            self.keys.zero_()
            self.values.zero_()
        self.length = 0

    def introspect(self) -> CacheView:
        allocated = self.nbytes
        return self._view(
            layout="linear",
            offset=self.length,
            tokens_held=self.length,
            capacity=self.max_cache_len if self.is_initialized else 0,
            max_capacity=self.max_cache_len,
            bytes_used=allocated * self.length // self.max_cache_len if self.is_initialized else 0,
            write_index=self.length,
            dtype=dtype_name(self.keys.dtype) if self.keys is not None else "",
        )


class StaticSlidingWindowLayer(StaticLayer):
    """A static buffer of ``min(sliding_window, max_cache_len)`` slots holding the most recent
    tokens in order, oldest first. Once full, a one-token update shifts the window left by one;
    a longer update returns the window plus the new tokens and keeps the last slots' worth."""

    is_sliding = True

    def __init__(self, max_cache_len: int, sliding_window: int, **ignored):
        check_ignored_keywords(type(self).__name__, ignored)
        super().__init__(max_cache_len=min(sliding_window, max_cache_len))
        self.sliding_window = sliding_window
        self._croppable = max_cache_len <= sliding_window

    @property
    def is_croppable(self) -> bool:
        """Whether crop() can always restore the layer: only if it never drops tokens."""
        return self._croppable

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n_new = key_states.shape[-2]
        size, before = self.max_cache_len, self.length
        self.length += n_new
        if before >= size:
            shifted_keys = torch.cat((self.keys[..., 1:, :], key_states), dim=-2)
            shifted_values = torch.cat((self.values[..., 1:, :], value_states), dim=-2)
            if n_new == 1:
                self.keys.copy_(shifted_keys)
                self.values.copy_(shifted_values)
                return self.keys, self.values
            full_keys, full_values = shifted_keys, shifted_values
        elif before + n_new > size:
            if before == 0:
                full_keys, full_values = key_states, value_states
            else:
                full_keys = torch.cat((self.keys[..., :before, :], key_states), dim=-2)
                full_values = torch.cat((self.values[..., :before, :], value_states), dim=-2)
        else:
            self.keys[..., before : before + n_new, :] = key_states
            self.values[..., before : before + n_new, :] = value_states
            return self.keys, self.values
        # Keep the most recent `size` tokens; return them all so no query loses context.
        self.keys.copy_(full_keys[..., -size:, :])
        self.values.copy_(full_values[..., -size:, :])
        return full_keys, full_values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        size, seen = self.max_cache_len, self.length
        kv_offset = max(seen - size + 1, 0)
        if seen >= size:
            return size + query_length - 1, kv_offset
        if seen + query_length > size:
            return seen + query_length, kv_offset
        return size, kv_offset

    def crop(self, tokens_to_remove: int) -> None:
        if self.length > self.max_cache_len:
            raise CropError(
                f"StaticSlidingWindowLayer.crop: {self.length - self.max_cache_len} tokens already left the "
                f"window of {self.max_cache_len}; they cannot be restored"
            )
        super().crop(tokens_to_remove)

    def introspect(self) -> CacheView:
        held = min(self.length, self.max_cache_len)
        allocated = self.nbytes
        return self._view(
            layout="linear",
            offset=self.length,
            tokens_held=held,
            capacity=self.max_cache_len if self.is_initialized else 0,
            max_capacity=self.max_cache_len,
            bytes_used=allocated * held // self.max_cache_len if self.is_initialized else 0,
            write_index=held,
            start_position=self.length - held,
            dtype=dtype_name(self.keys.dtype) if self.keys is not None else "",
        )
