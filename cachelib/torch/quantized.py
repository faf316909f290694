"""transformers' KIVI-style ``QuantizedLayer``, written by us on our own quantizer.

Bookkeeping follows transformers 5.x: the first update quantizes the whole prompt; after that,
new tokens collect in a full-precision residual until ``residual + new >= residual_length``,
when residual and new tokens are quantized together and the residual empties. Every update
returns dequantized(quantized) + residual + new, in token order.

Where ours differs (values only, never shapes or counts): groups run along head_dim, so each
token is quantized exactly once, when it leaves the residual, and appended; transformers
re-quantizes everything it dequantized at every flush, which compounds the error. Beam reorders
apply at once (reindexing codes is lossless), and ``crop`` removes tokens exactly.
"""

from __future__ import annotations

import torch

from ..introspect import CacheView, Written
from .base import AttentionLayer, Dequantized, QuantErrorProbe, cat, changed_slots, check_crop, dtype_name, each, tokens
from .quantizer import Quantizer, check_bits, check_group_size, check_head_dim


class QuantizedLayer(QuantErrorProbe, AttentionLayer):
    is_croppable = True
    _arrays = ("keys", "values", "quantized_keys", "quantized_values")

    def __init__(
        self,
        nbits: int = 4,
        q_group_size: int = 64,
        residual_length: int = 128,
        *,
        axis_key: int = 0,
        axis_value: int = 0,
    ):
        """``axis_key`` / ``axis_value`` are transformers' keywords, kept for drop-in use: its
        backends quantize along them; our quantizer always groups along head_dim."""
        super().__init__()
        for name, axis in (("axis_key", axis_key), ("axis_value", axis_value)):
            if isinstance(axis, bool) or not isinstance(axis, int):
                raise ValueError(f"QuantizedLayer: {name} must be an int, got {axis!r}")
        self.axis_key, self.axis_value = axis_key, axis_value
        check_bits(nbits, "QuantizedLayer", "nbits")
        check_group_size(q_group_size, "QuantizedLayer")
        if isinstance(residual_length, bool) or not isinstance(residual_length, int) or residual_length < 0:
            raise ValueError(f"QuantizedLayer: residual_length must be an int >= 0, got {residual_length!r}")
        self.nbits = nbits
        self.q_group_size = q_group_size
        self.residual_length = residual_length
        self.quantizer = Quantizer(nbits, q_group_size)
        self.cumulative_length = 0
        self.quantized_keys = self.quantized_values = None  # (codes, scales, biases), token axis -2
        self._store_returned: int | None = None  # store tokens behind the last return (None: not known)

    def lazy_initialization(self, key_states, value_states) -> None:
        check_head_dim(key_states.shape[-1], self.q_group_size, "QuantizedLayer")
        check_head_dim(value_states.shape[-1], self.q_group_size, "QuantizedLayer")
        self.device = key_states.device
        self.keys = key_states[..., :0, :].clone()  # the residual, (B, H, 0, D)
        self.values = value_states[..., :0, :].clone()
        self.is_initialized = True

    def _quantize(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize these tokens and append them to the quantized store."""
        if keys.shape == values.shape:  # one quantizer pass for both
            both_states = torch.stack((keys, values))
            both = self.quantizer.quantize(both_states)
            qk, qv = tuple(t[0] for t in both), tuple(t[1] for t in both)
            if self.track_error:  # that pass's stack, kept for the error probe
                self._record_stacked(both_states, Dequantized(self.quantizer, both))
        else:
            qk, qv = self.quantizer.quantize(keys), self.quantizer.quantize(values)
            if self.track_error:
                self._record_error([(keys, Dequantized(self.quantizer, qk), values, Dequantized(self.quantizer, qv))])
        if self.quantized_keys is None:
            self.quantized_keys, self.quantized_values = qk, qv
        else:
            self.quantized_keys = cat([self.quantized_keys, qk])
            self.quantized_values = cat([self.quantized_values, qv])

    def update(self, key_states, value_states, *args, **kwargs):
        return self._update(key_states, value_states, 0)[1:3]

    def update_changed(self, key_states, value_states, held: int, need: int):
        return self._update(key_states, value_states, held, need)

    def _update(self, key_states, value_states, held: int, need: int | None = None):
        """The update; returns ``(start, keys, values, length)`` as :meth:`update_changed` (with
        ``need`` None: every returned slot, as ``update``)."""
        prev = self.cumulative_length
        self.cumulative_length += key_states.shape[-2]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._quantize(key_states, value_states)
            # handed back at full precision: the store's tokens are all new to the next return
            self.written, self._store_returned = Written(prev, self.cumulative_length, True), 0
            return 0, key_states, value_states, key_states.shape[-2]
        # What comes back is the store dequantized, then residual and new tokens at full
        # precision; against the last return, the tokens the store took since are new.
        stored, end = tokens(self.quantized_keys), self.cumulative_length
        if self._store_returned == stored:
            self.written = Written(prev, end, True)
        else:
            self.written = None if self._store_returned is None else Written(self._store_returned, end, False)
        self._store_returned = stored
        start, stop = changed_slots(self.written, held, end if need is None else need, end)
        parts_k, parts_v = [], []
        if self.quantized_keys is not None and start < stored:
            first = lambda t: t[..., start:, :]  # noqa: E731
            parts_k.append(self.quantizer.dequantize(each(self.quantized_keys, first)).to(key_states.dtype))
            parts_v.append(self.quantizer.dequantize(each(self.quantized_values, first)).to(value_states.dtype))
        rest = max(start - stored, 0)  # residual tokens the caller holds
        out_k = torch.cat(parts_k + [self.keys[..., rest:, :], key_states], dim=-2)[..., : stop - start, :]
        out_v = torch.cat(parts_v + [self.values[..., rest:, :], value_states], dim=-2)[..., : stop - start, :]
        if self.keys.shape[-2] + key_states.shape[-2] >= self.residual_length:
            self._quantize(torch.cat((self.keys, key_states), -2), torch.cat((self.values, value_states), -2))
            self.keys, self.values = self.keys[..., :0, :].clone(), self.values[..., :0, :].clone()
        else:
            if self.track_error:
                self._record_error([])
            self.keys = torch.cat((self.keys, key_states), dim=-2)
            self.values = torch.cat((self.values, value_states), dim=-2)
        return start, out_k, out_v, end

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens exactly (all of them when that is more)."""
        n = check_crop(tokens_to_remove, self.cumulative_length, "QuantizedLayer")
        if n == 0:
            return
        from_residual = min(n, self.keys.shape[-2])
        keep = self.keys.shape[-2] - from_residual
        self.keys, self.values = self.keys[..., :keep, :].clone(), self.values[..., :keep, :].clone()
        from_quantized = n - from_residual
        if from_quantized:
            keep = tokens(self.quantized_keys) - from_quantized
            trim = lambda t: t[..., :keep, :].clone()  # noqa: E731
            self.quantized_keys = each(self.quantized_keys, trim)
            self.quantized_values = each(self.quantized_values, trim)
        self.cumulative_length -= n
        self._store_returned = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._map_arrays(lambda t: t.index_select(0, beam_idx.to(t.device)))
            self._store_returned = None

    def reset(self) -> None:
        self.keys = self.values = None
        self.quantized_keys = self.quantized_values = None
        self.is_initialized = False
        self.cumulative_length = 0
        self._store_returned = None

    def introspect(self) -> CacheView:
        quantized = tokens(self.quantized_keys)
        held = quantized + tokens(self.keys)
        dtype = self.quantized_keys[1].dtype if self.quantized_keys is not None else None
        allocated = self.nbytes
        return self._view(
            layout="linear",
            offset=self.cumulative_length,
            tokens_held=held,
            capacity=held,
            max_capacity=None,
            bytes_used=allocated,
            write_index=held,
            key_bits=self.nbits,
            value_bits=self.nbits,
            group_size=self.q_group_size,
            quantized_tokens=quantized,
            dtype=dtype_name(dtype) if dtype is not None else "",
            quant_error=self.quant_error,
        )
