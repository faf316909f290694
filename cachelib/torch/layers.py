"""transformers' unbounded attention layer (``DynamicLayer``) and the layer that holds nothing
(``DummyLayer``), written by us with transformers 5.x semantics.

``DynamicLayer`` concatenates every update onto what it holds, as transformers does: the memory
it reports is exactly the tokens it holds, and each step copies the whole cache. (The
step-allocated ``KVCache`` in :mod:`.mlx_style` is the strategy that avoids that copy.)
"""

from __future__ import annotations

import torch

from ..introspect import CacheView, Written
from .base import AttentionLayer, check_crop, check_ignored_keywords, dtype_name


class DynamicLayer(AttentionLayer):
    """Holds every token's K/V as (B, H, T, D) tensors grown by concatenation. Keywords that
    transformers' caches pass to every layer (``sliding_window=`` ...) are ignored, as there."""

    is_croppable = True

    def __init__(self, **ignored):
        check_ignored_keywords(type(self).__name__, ignored)
        super().__init__()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        # Zero tokens, but the right batch, heads, head_dim and dtype: (B, H, 0, D)
        self.keys = key_states[..., :0, :].clone()
        self.values = value_states[..., :0, :].clone()
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        prev = self.keys.shape[-2]
        self.written = Written(prev, prev + key_states.shape[-2], True)
        if self.keys.shape[-2] == 0:
            # Nothing to concatenate onto: hold the new states themselves (no copy).
            self.keys, self.values = key_states, value_states
        else:
            self.keys = torch.cat((self.keys, key_states), dim=-2)
            self.values = torch.cat((self.values, value_states), dim=-2)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (all of them when that is more than held)."""
        n = check_crop(tokens_to_remove, self.get_seq_length(), type(self).__name__)
        if n == 0 or not self.is_initialized:
            return
        keep = self.keys.shape[-2] - n
        # Cloned so the dropped tail's memory is released, not kept alive behind a view.
        self.keys = self.keys[..., :keep, :].clone()
        self.values = self.values[..., :keep, :].clone()

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False

    def introspect(self) -> CacheView:
        held = self.get_seq_length()
        return self._view(
            layout="linear",
            offset=held,
            tokens_held=held,
            capacity=held,
            max_capacity=None,
            bytes_used=self.nbytes,
            write_index=held,
            dtype=dtype_name(self.keys.dtype) if self.keys is not None else "",
        )


class DummyLayer:
    """A layer that stores nothing: for model layers without attention state (MoE/MLP-only
    layers) or layers that read another layer's K/V."""

    supports_early_init = False
    is_compileable = True
    is_croppable = True
    is_sliding = False

    def __init__(self, **ignored):
        check_ignored_keywords("DummyLayer", ignored)
        self.is_initialized = True
        self.keys = None
        self.values = None

    def __repr__(self):
        return "DummyLayer()"

    def update(self, key_states, value_states, *args, **kwargs):
        if key_states is None and value_states is None:
            return None, None
        raise ValueError("DummyLayer holds no K/V: this model layer must not call update()")

    def offload(self) -> None: ...
    def prefetch(self) -> None: ...
    def reset(self) -> None: ...
    def crop(self, tokens_to_remove: int) -> None: ...
    def reorder_cache(self, beam_idx) -> None: ...
    def batch_repeat_interleave(self, repeats: int) -> None: ...
    def batch_select_indices(self, indices) -> None: ...

    def get_max_length(self) -> int:
        return -1

    @property
    def nbytes(self) -> int:
        return 0

    def held_arrays(self):
        return iter(())

    def introspect(self) -> CacheView:
        return CacheView(
            kind="DummyLayer",
            layout="none",
            offset=0,
            tokens_held=0,
            capacity=0,
            max_capacity=0,
            bytes_used=0,
            bytes_allocated=0,
            write_index=None,
        )
