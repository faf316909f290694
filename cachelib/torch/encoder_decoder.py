"""transformers' ``EncoderDecoderCache``, written by us: a self-attention cache and a
cross-attention cache for encoder-decoder models (BART, T5, Whisper, ...).

It subclasses transformers' class only because models check ``isinstance`` against it to
find the two halves; every method is ours and delegates to the two caches.
"""

from __future__ import annotations

from transformers import cache_utils as _tf

from ..introspect import CacheView
from .cache import DynamicCache


class EncoderDecoderCache(_tf.EncoderDecoderCache):
    """``EncoderDecoderCache(self_attention_cache, cross_attention_cache)``, or one iterable of
    per-layer tensors (4 or 6 per layer, as gathered by DDP)."""

    def __init__(self, *caches):
        if len(caches) == 1:
            self_data, cross_data = [], []
            for data in caches[0]:
                if len(data) == 6:
                    self_data.append(data[:3])
                    cross_data.append(data[3:])
                elif len(data) == 4:
                    self_data.append(data[:2])
                    cross_data.append(data[2:])
                else:
                    raise ValueError(
                        f"EncoderDecoderCache: each layer's data must have 4 or 6 tensors, got {len(data)}"
                    )
            self.self_attention_cache = DynamicCache(self_data)
            self.cross_attention_cache = DynamicCache(cross_data)
        elif len(caches) == 2:
            for c in caches:
                if not isinstance(c, _tf.Cache):
                    raise TypeError(f"EncoderDecoderCache: expected two Cache objects, got a {type(c).__name__}")
            self.self_attention_cache, self.cross_attention_cache = caches
        else:
            raise ValueError(f"EncoderDecoderCache: expected 1 or 2 arguments, got {len(caches)}")
        # Whether each layer's cross-attention K/V are computed (they never change afterwards).
        self.is_updated = {
            i: self.cross_attention_cache.get_seq_length(i) > 0 for i in range(len(self.cross_attention_cache))
        }

    def __repr__(self):
        return (
            f"EncoderDecoderCache(self_attention_cache={self.self_attention_cache!r}, "
            f"cross_attention_cache={self.cross_attention_cache!r})"
        )

    def __iter__(self):
        for self_layer, cross_layer in zip(self.self_attention_cache, self.cross_attention_cache):
            yield self_layer + cross_layer

    def __len__(self):
        return len(self.self_attention_cache)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.self_attention_cache.get_seq_length(layer_idx)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.self_attention_cache.get_max_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.self_attention_cache.get_mask_sizes(query_length, layer_idx)

    def reset(self) -> None:
        self.self_attention_cache.reset()
        self.cross_attention_cache.reset()
        for i in self.is_updated:
            self.is_updated[i] = False

    def reorder_cache(self, beam_idx) -> None:
        self.self_attention_cache.reorder_cache(beam_idx)
        self.cross_attention_cache.reorder_cache(beam_idx)

    def _check_dynamic(self, method: str) -> None:
        for c in (self.self_attention_cache, self.cross_attention_cache):
            if not isinstance(c, (DynamicCache, _tf.DynamicCache)):
                raise TypeError(f"EncoderDecoderCache.{method} needs dynamic caches, got a {type(c).__name__}")

    def crop(self, tokens_to_remove: int) -> None:
        self._check_dynamic("crop")
        self.self_attention_cache.crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._check_dynamic("batch_repeat_interleave")
        self.self_attention_cache.batch_repeat_interleave(repeats)
        self.cross_attention_cache.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices) -> None:
        self._check_dynamic("batch_select_indices")
        self.self_attention_cache.batch_select_indices(indices)
        self.cross_attention_cache.batch_select_indices(indices)

    def activate_past_recording(self) -> None:
        self.self_attention_cache.activate_past_recording()

    def is_recording_past(self, layer_idx: int) -> bool:
        return self.self_attention_cache.is_recording_past(layer_idx)

    @property
    def is_sliding(self):
        return self.self_attention_cache.is_sliding

    @property
    def is_linear(self):
        return self.self_attention_cache.is_linear

    @property
    def is_dummy(self):
        return self.self_attention_cache.is_dummy

    @property
    def is_compileable(self) -> bool:
        return self.self_attention_cache.is_compileable

    @property
    def is_croppable(self) -> bool:
        return self.self_attention_cache.is_croppable

    @property
    def is_initialized(self) -> bool:
        return self.self_attention_cache.is_initialized

    @property
    def batch_size(self) -> int:
        return self.self_attention_cache.batch_size

    @property
    def nbytes(self) -> int:
        return self.self_attention_cache.nbytes + self.cross_attention_cache.nbytes

    def introspect(self) -> list[CacheView]:
        """Views of the self-attention layers, then of the cross-attention layers."""
        return self.self_attention_cache.introspect() + self.cross_attention_cache.introspect()
