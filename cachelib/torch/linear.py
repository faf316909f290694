"""Recurrent state layers (Mamba, linear attention, short convolutions) and layers that carry
both such a state and attention K/V, written by us with transformers 5.x semantics.

A ``LinearAttentionLayer`` holds, per state index, a convolution window (B, C, kernel) and a
recurrent state; neither has a token axis. The model updates both in place during decode (it
fetches them with ``get_conv_state`` / ``get_recurrent_state`` and writes into them), so the
layer never learns how many tokens went by: its introspection reports the state bytes only.

A hybrid layer is composed of one attention layer (any of ours) and one linear layer, and
answers both protocols by delegation.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

from ..introspect import CacheView
from .base import AttentionLayer, CropError, check_ignored_keywords, dtype_name
from .layers import DynamicLayer
from .sliding import DynamicSlidingWindowLayer
from .static import StaticLayer, StaticSlidingWindowLayer


class LinearAttentionLayer(LinearAttentionCacheLayerMixin):
    supports_early_init = False
    is_sliding = False

    def __init__(self, number_of_states: int = 1, **ignored):
        check_ignored_keywords(type(self).__name__, ignored)
        if isinstance(number_of_states, bool) or not isinstance(number_of_states, int) or number_of_states < 1:
            raise ValueError(f"LinearAttentionLayer: number_of_states must be an int >= 1, got {number_of_states!r}")
        n = range(number_of_states)
        self.number_of_states = number_of_states
        self.conv_states: dict[int, torch.Tensor | None] = dict.fromkeys(n)
        self.recurrent_states: dict[int, torch.Tensor | None] = dict.fromkeys(n)
        self.is_conv_states_initialized = dict.fromkeys(n, False)
        self.is_recurrent_states_initialized = dict.fromkeys(n, False)
        self.has_previous_state = dict.fromkeys(n, False)
        self.conv_kernel_size: dict[int, int | None] = dict.fromkeys(n)
        self.device = None
        self.dtype = None
        self.record_past = False

    def __repr__(self):
        return f"{type(self).__name__}()"

    def lazy_initialization(
        self,
        conv_states: torch.Tensor | None = None,
        recurrent_states: torch.Tensor | None = None,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
    ) -> None:
        if conv_states is not None:
            if self.device is None:
                self.dtype, self.device = conv_states.dtype, conv_states.device
            kernel = conv_states.shape[-1] if conv_kernel_size is None else conv_kernel_size
            self.conv_kernel_size[state_idx] = kernel
            # (B, C, kernel): the last `kernel` inputs of the causal convolution
            self.conv_states[state_idx] = conv_states.new_zeros((*conv_states.shape[:-1], kernel))
            self.is_conv_states_initialized[state_idx] = True
        if recurrent_states is not None:
            if self.device is None:
                self.dtype, self.device = recurrent_states.dtype, recurrent_states.device
            self.recurrent_states[state_idx] = torch.zeros_like(recurrent_states)
            self.is_recurrent_states_initialized[state_idx] = True

    def update_conv_state(
        self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None, **kwargs
    ):
        """Append the convolution inputs ``conv_states`` (B, C, T); return the window the causal
        convolution needs (previous inputs + these), and keep the last ``kernel`` inputs."""
        if not self.is_conv_states_initialized[state_idx]:
            self.lazy_initialization(conv_states=conv_states, state_idx=state_idx, conv_kernel_size=conv_kernel_size)
        kernel = self.conv_kernel_size[state_idx]
        if self.has_previous_state[state_idx]:
            full = torch.cat((self.conv_states[state_idx], conv_states), dim=-1)
        else:
            full = conv_states
            self.has_previous_state[state_idx] = True
            if not self.record_past and full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0))
        if self.record_past:
            self.conv_states[state_idx] = full
        else:
            # In place: the model may hold this tensor and update it during decode.
            self.conv_states[state_idx].copy_(full[..., -kernel:])
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs):
        if not self.is_recurrent_states_initialized[state_idx]:
            self.lazy_initialization(recurrent_states=recurrent_states, state_idx=state_idx)
        self.recurrent_states[state_idx].copy_(recurrent_states)
        return self.recurrent_states[state_idx]

    # --- held arrays -----------------------------------------------------------------------------

    def held_arrays(self):
        for states in (self.conv_states, self.recurrent_states):
            yield from (t for t in states.values() if t is not None)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.held_arrays())

    def _map_states(self, fn) -> None:
        for states in (self.conv_states, self.recurrent_states):
            for i, t in states.items():
                if t is not None:
                    states[i] = fn(t)

    @property
    def batch_size(self) -> int | None:
        for t in self.held_arrays():
            return t.shape[0]
        return None

    def offload(self) -> None:
        self._map_states(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.device is not None:
            device = torch.device(self.device)
            self._map_states(lambda t: t if t.device == device else t.to(device, non_blocking=True))

    def reset(self) -> None:
        self._map_states(lambda t: t.zero_())
        for i in self.has_previous_state:
            self.has_previous_state[i] = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_states(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_states(lambda t: t[indices, ...])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_states(lambda t: t.repeat_interleave(repeats, dim=0))

    # --- rollback ------------------------------------------------------------------------------

    @property
    def is_croppable(self) -> bool:
        """A recurrent state cannot be rolled back; a pure convolution window can (with past
        recording). Unknown until the first update: False."""
        if any(self.is_recurrent_states_initialized.values()):
            return False
        return any(self.is_conv_states_initialized.values())

    @property
    def is_compileable(self) -> bool:
        return not self.record_past

    def activate_past_recording(self) -> None:
        """Keep every convolution input until the next ``crop``, so it can roll back."""
        self.record_past = True

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` convolution inputs and shrink the windows back
        to ``kernel`` inputs (so ``crop(0)`` may still shrink them). Refuses, changing nothing,
        to remove more inputs than were recorded (transformers leaves a window narrower than the
        kernel there)."""
        if not self.record_past:
            raise CropError(
                "LinearAttentionLayer.crop: past states were not recorded; call activate_past_recording() "
                "before the updates you may want to crop"
            )
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int) or tokens_to_remove > 0:
            raise CropError(
                f"LinearAttentionLayer.crop: tokens_to_remove must be an int <= 0, got {tokens_to_remove!r}"
            )
        n = -tokens_to_remove
        for conv in self.conv_states.values():
            if conv is not None and n > conv.shape[-1]:
                raise CropError(
                    f"LinearAttentionLayer.crop: tokens_to_remove={tokens_to_remove} passes the "
                    f"{conv.shape[-1]} recorded convolution inputs; allowed: -{conv.shape[-1]}..0"
                )
        for i, conv in self.conv_states.items():
            if conv is None:
                continue
            kernel = self.conv_kernel_size[i]
            end = conv.shape[-1] - n
            self.conv_states[i] = conv[..., max(end - kernel, 0) : end].clone()

    def get_max_length(self) -> int:
        return -1

    def introspect(self) -> CacheView:
        dtype = next(iter(self.held_arrays()), None)
        size = self.nbytes
        return CacheView(
            kind=type(self).__name__,
            layout="recurrent",
            offset=0,
            tokens_held=0,
            capacity=0,
            max_capacity=None,
            bytes_used=size,
            bytes_allocated=size,
            write_index=None,
            batch_size=self.batch_size or 1,
            dtype=dtype_name(dtype.dtype) if dtype is not None else "",
        )


class LinearAttentionHybridLayer(CacheLayerMixin, LinearAttentionCacheLayerMixin):
    """One model layer with both a recurrent state and attention K/V: ``attention`` is any of
    our attention layers, ``linear`` a :class:`LinearAttentionLayer`."""

    supports_early_init = False

    def __init__(self, attention: AttentionLayer, number_of_states: int = 1):
        self.attention = attention
        self.linear = LinearAttentionLayer(number_of_states)

    def __repr__(self):
        return f"{type(self).__name__}(attention={self.attention!r})"

    # attention side
    @property
    def keys(self):
        return self.attention.keys

    @property
    def values(self):
        return self.attention.values

    @property
    def is_initialized(self) -> bool:
        return self.attention.is_initialized

    @property
    def is_sliding(self) -> bool:
        return self.attention.is_sliding

    @property
    def device(self):
        return self.attention.device

    def update(self, key_states, value_states, *args, **kwargs):
        return self.attention.update(key_states, value_states)

    def get_seq_length(self) -> int:
        return self.attention.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.attention.get_mask_sizes(query_length)

    def get_max_length(self) -> int:
        # As transformers: the linear part (no sequence axis) answers.
        return -1

    # linear side
    @property
    def number_of_states(self) -> int:
        return self.linear.number_of_states

    @property
    def conv_states(self):
        return self.linear.conv_states

    @property
    def recurrent_states(self):
        return self.linear.recurrent_states

    @property
    def has_previous_state(self):
        return self.linear.has_previous_state

    @property
    def is_conv_states_initialized(self):
        return self.linear.is_conv_states_initialized

    @property
    def is_recurrent_states_initialized(self):
        return self.linear.is_recurrent_states_initialized

    @property
    def conv_kernel_size(self):
        return self.linear.conv_kernel_size

    @property
    def dtype(self):
        return self.linear.dtype

    def update_conv_state(self, conv_states, state_idx: int = 0, **kwargs):
        return self.linear.update_conv_state(conv_states, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states, state_idx: int = 0, **kwargs):
        return self.linear.update_recurrent_state(recurrent_states, state_idx, **kwargs)

    def lazy_initialization(self, *args, **kwargs) -> None:
        """Two positional tensors: the K/V side (``early_initialization``); keywords: a state."""
        if len(args) == 2 and not kwargs:
            self.attention.lazy_initialization(*args)
        elif not args:
            self.linear.lazy_initialization(**kwargs)

    # both
    @property
    def record_past(self) -> bool:
        return self.linear.record_past

    @record_past.setter
    def record_past(self, value: bool) -> None:
        self.linear.record_past = value
        if hasattr(self.attention, "record_past"):
            self.attention.record_past = value

    def activate_past_recording(self) -> None:
        self.record_past = True

    @property
    def is_croppable(self) -> bool:
        return self.linear.is_croppable

    @property
    def is_compileable(self) -> bool:
        return self.attention.is_compileable and self.linear.is_compileable

    @property
    def nbytes(self) -> int:
        return self.attention.nbytes + self.linear.nbytes

    def held_arrays(self):
        yield from self.attention.held_arrays()
        yield from self.linear.held_arrays()

    @property
    def batch_size(self) -> int | None:
        return self.attention.batch_size or self.linear.batch_size

    def offload(self) -> None:
        self.attention.offload()
        self.linear.offload()

    def prefetch(self) -> None:
        self.attention.prefetch()
        self.linear.prefetch()

    def reset(self) -> None:
        self.linear.reset()
        self.attention.reset()

    def reorder_cache(self, beam_idx) -> None:
        self.linear.reorder_cache(beam_idx)
        self.attention.reorder_cache(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        before = dict(self.linear.conv_states)  # crop replaces the windows, never edits them
        self.linear.crop(tokens_to_remove)
        try:
            self.attention.crop(tokens_to_remove)
        except ValueError:
            self.linear.conv_states.update(before)  # both halves as they were
            raise

    def batch_select_indices(self, indices) -> None:
        self.linear.batch_select_indices(indices)
        self.attention.batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.linear.batch_repeat_interleave(repeats)
        self.attention.batch_repeat_interleave(repeats)

    def introspect(self) -> CacheView:
        view = self.attention.introspect()
        state = self.linear.nbytes
        return replace(
            view,
            kind=type(self).__name__,
            bytes_used=view.bytes_used + state,
            bytes_allocated=view.bytes_allocated + state,
        )


class LinearAttentionAndFullAttentionLayer(LinearAttentionHybridLayer):
    def __init__(self, number_of_states: int = 1, **ignored):
        check_ignored_keywords(type(self).__name__, ignored)
        super().__init__(DynamicLayer(), number_of_states)


class LinearAttentionAndSlidingWindowAttentionLayer(LinearAttentionHybridLayer):
    def __init__(self, sliding_window: int, number_of_states: int = 1, **ignored):
        check_ignored_keywords(type(self).__name__, ignored)
        super().__init__(DynamicSlidingWindowLayer(sliding_window), number_of_states)

    @property
    def sliding_window(self) -> int:
        return self.attention.sliding_window

    @property
    def _sliding_window_tensor(self) -> torch.Tensor:
        # what DynamicCache's iteration yields per layer, as for transformers' hybrid
        return self.attention._sliding_window_tensor


class LinearAttentionAndStaticFullAttentionLayer(LinearAttentionHybridLayer):
    def __init__(self, max_cache_len: int, number_of_states: int = 1, **ignored):
        check_ignored_keywords(type(self).__name__, ignored)
        super().__init__(StaticLayer(max_cache_len), number_of_states)

    @property
    def max_cache_len(self) -> int:
        return self.attention.max_cache_len


class LinearAttentionAndStaticSlidingWindowAttentionLayer(LinearAttentionHybridLayer):
    def __init__(self, max_cache_len: int, sliding_window: int, number_of_states: int = 1, **ignored):
        check_ignored_keywords(type(self).__name__, ignored)
        super().__init__(StaticSlidingWindowLayer(max_cache_len, sliding_window), number_of_states)

    @property
    def max_cache_len(self) -> int:
        """The slots preallocated: min(max_cache_len, sliding_window), as in transformers."""
        return self.attention.max_cache_len

    @property
    def sliding_window(self) -> int:
        return self.attention.sliding_window
