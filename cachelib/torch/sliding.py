"""transformers' dynamic sliding-window layer, written by us with transformers 5.x semantics.

A window of ``sliding_window`` means a query sees itself and the ``sliding_window - 1`` tokens
before it, so between updates the layer holds at most ``sliding_window - 1`` tokens; an update
returns what it held plus the new tokens. With past recording on (assisted decoding), it keeps
everything until the next ``crop`` so a rejected draft can be rolled back.

Unlike transformers, what it holds is compacted (a copy, not a view into the last update's
concatenation), so the bytes it reports are the bytes it keeps alive; and a window of 1 holds
nothing (transformers' slice ``[-0:]`` would keep everything).
"""

from __future__ import annotations

import torch

from ..introspect import CacheView
from .base import CropError, check_crop, check_ignored_keywords, dtype_name
from .layers import DynamicLayer


def _last(x: torch.Tensor, n: int) -> torch.Tensor:
    """The last ``n`` tokens of ``x`` (B, H, T, D), as a compact copy when that drops any."""
    if x.shape[-2] <= n:
        return x
    return x[..., x.shape[-2] - n :, :].clone()


class DynamicSlidingWindowLayer(DynamicLayer):
    is_sliding = True

    def __init__(self, sliding_window: int, **ignored):
        check_ignored_keywords(type(self).__name__, ignored)
        super().__init__()
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"DynamicSlidingWindowLayer: sliding_window must be an int >= 1, got {sliding_window!r}")
        self.sliding_window = sliding_window
        self.cumulative_length = 0
        self.record_past = False
        self._sliding_window_tensor = torch.tensor(sliding_window, dtype=torch.long)

    def activate_past_recording(self) -> None:
        """Keep every state until the next ``crop``, so that ``crop(-n)`` can roll back."""
        self.record_past = True

    def lazy_initialization(self, key_states, value_states) -> None:
        super().lazy_initialization(key_states, value_states)
        self._sliding_window_tensor = self._sliding_window_tensor.to(self.device)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n_new = key_states.shape[-2]
        self.cumulative_length += n_new
        if self.keys.shape[-2] == 0:
            full_keys, full_values = key_states, value_states
        else:
            full_keys = torch.cat((self.keys, key_states), dim=-2)
            full_values = torch.cat((self.values, value_states), dim=-2)
        if self.record_past:
            self.keys, self.values = full_keys, full_values
            # Several forwards may run before the next crop: return only what the mask expects.
            visible = self.sliding_window - 1 + n_new
            return full_keys[..., -visible:, :], full_values[..., -visible:, :]
        past = self.sliding_window - 1
        self.keys, self.values = _last(full_keys, past), _last(full_values, past)
        return full_keys, full_values

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        seen, window = self.cumulative_length, self.sliding_window
        kv_offset = max(seen - window + 1, 0)
        if seen >= window:
            return window - 1 + query_length, kv_offset
        return seen + query_length, kv_offset

    def get_max_length(self) -> int:
        return self.sliding_window

    def crop(self, tokens_to_remove: int) -> None:
        """Remove ``-tokens_to_remove`` tokens (all of them when that is more than seen). Once
        the window has been filled this needs past recording; ``crop(0)`` then just shrinks the
        held states back to the window."""
        name = type(self).__name__
        if self.cumulative_length < self.sliding_window:
            n = check_crop(tokens_to_remove, self.get_seq_length(), name)
            if n and self.is_initialized:
                super().crop(-n)
            self.cumulative_length = self.keys.shape[-2] if self.keys is not None else 0
            return
        if not self.record_past:
            raise CropError(
                f"{name}.crop: the window of {self.sliding_window} tokens is full and past states were "
                "dropped; call activate_past_recording() before the updates you may want to crop"
            )
        n = check_crop(tokens_to_remove, self.cumulative_length, name)
        if n == self.cumulative_length:  # every token seen: empty again (transformers' length goes below 0)
            self.keys, self.values = self.keys[..., :0, :].clone(), self.values[..., :0, :].clone()
            self.cumulative_length = 0
            return
        if n > self.keys.shape[-2]:
            # transformers slices to nothing here and keeps a positive length: a layer whose
            # mask sizes no longer match what it holds. Ours refuses and stays as it was.
            raise CropError(
                f"{name}.crop: tokens_to_remove={tokens_to_remove} passes the {self.keys.shape[-2]} tokens "
                f"recorded since the last crop (of {self.cumulative_length} seen); allowed: "
                f"-{self.keys.shape[-2]}..0, or -{self.cumulative_length} or less to empty the layer"
            )
        past = self.sliding_window - 1
        end = self.keys.shape[-2] - n
        start = max(end - past, 0)
        self.keys = self.keys[..., start:end, :].clone()
        self.values = self.values[..., start:end, :].clone()
        self.cumulative_length -= n

    def reset(self) -> None:
        super().reset()
        self.cumulative_length = 0

    def introspect(self) -> CacheView:
        held = 0 if self.keys is None else self.keys.shape[-2]
        return self._view(
            layout="linear",
            offset=self.cumulative_length,
            tokens_held=held,
            capacity=held,
            max_capacity=self.sliding_window,
            bytes_used=self.nbytes,
            write_index=held,
            start_position=self.cumulative_length - held,
            dtype=dtype_name(self.keys.dtype) if self.keys is not None else "",
        )
