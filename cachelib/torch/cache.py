"""Whole-model caches speaking transformers' ``Cache`` protocol: a list of layers, one per model
layer, plus CPU offloading with prefetch of the next layer.

``Cache`` routes every call a transformers model or ``generate()`` makes to the right layer;
``DynamicCache``, ``StaticCache`` and ``QuantizedCache`` are transformers' caches, written by
us (``EncoderDecoderCache``, which pairs two caches, is in :mod:`.encoder_decoder`). Which
layer class a model layer gets comes from its config (``layer_types``): full attention gets
the cache's own strategy, sliding-window layers a window layer, recurrent layers their state
layer. The mlx-lm strategies build on the same machinery (:mod:`.mlx_style`, :mod:`.rotating`).

Offloading: after a layer's update its arrays move to the CPU, and the next offloaded layer is
fetched back ahead of use. On CUDA the fetch runs on a side stream (so it overlaps the current
layer's compute) and the streams are ordered with ``wait_stream``; on CPU the moves are no-ops
and the same calls run synchronously.
"""

from __future__ import annotations

import importlib.util
import operator
from typing import Callable, Iterable

import torch
from transformers import cache_utils as _tf
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin, get_layer_types_and_kwargs

from ..introspect import CacheView
from .layers import DummyLayer, DynamicLayer
from .linear import (
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionAndStaticFullAttentionLayer,
    LinearAttentionAndStaticSlidingWindowAttentionLayer,
    LinearAttentionHybridLayer,
    LinearAttentionLayer,
)
from .quantized import QuantizedLayer
from .sliding import DynamicSlidingWindowLayer
from .static import StaticLayer, StaticSlidingWindowLayer

ATTENTION_TYPES = ("full_attention",)
WINDOW_TYPES = ("sliding_attention", "chunked_attention")
STATE_TYPES = ("conv", "linear_attention")
HYBRID_TYPES = ("hybrid", "hybrid_sliding")
LAYER_TYPES = ATTENTION_TYPES + WINDOW_TYPES + STATE_TYPES + HYBRID_TYPES + ("dummy",)


def build_layers(
    config,
    attention: Callable[[], CacheLayerMixin],
    window: Callable[[int], CacheLayerMixin] = DynamicSlidingWindowLayer,
    hybrid: Callable[[int], CacheLayerMixin] | None = None,
    hybrid_window: Callable[[int, int], CacheLayerMixin] | None = None,
) -> list:
    """One layer per model layer of ``config``: ``attention()`` for full-attention layers,
    ``window(sliding_window)`` for sliding/chunked ones, a state layer for recurrent ones, and
    for hybrid ones ``hybrid(number_of_states)`` / ``hybrid_window(sliding_window,
    number_of_states)`` (default: the attention or window layer combined with a state layer);
    an empty layer where nothing is cached."""
    if hybrid is None:
        hybrid = lambda states: LinearAttentionHybridLayer(attention(), states)  # noqa: E731
    if hybrid_window is None:
        hybrid_window = lambda size, states: LinearAttentionHybridLayer(window(size), states)  # noqa: E731
    text = config.get_text_config(decoder=True)
    types, per_layer = get_layer_types_and_kwargs(text)
    layers = []
    for layer_type, kwargs in zip(types, per_layer):
        states = kwargs.get("number_of_states", 1)
        if layer_type in ATTENTION_TYPES:
            layers.append(attention())
        elif layer_type in WINDOW_TYPES:
            layers.append(window(kwargs["sliding_window"]))
        elif layer_type in STATE_TYPES:
            layers.append(LinearAttentionLayer(number_of_states=states))
        elif layer_type == "hybrid":
            layers.append(hybrid(states))
        elif layer_type == "hybrid_sliding":
            layers.append(hybrid_window(kwargs["sliding_window"], states))
        elif layer_type == "dummy":
            layers.append(DummyLayer())
        else:
            raise ValueError(
                f"layer type {layer_type!r} (model_type {text.model_type!r}) is not supported by cachelib.torch; "
                f"supported: {', '.join(LAYER_TYPES)}"
            )
    return layers


def _has_tokens(layer) -> bool:
    """Attention-like layers: they have a token axis and answer get_seq_length / mask sizes."""
    return isinstance(layer, CacheLayerMixin)


class Cache(_tf.Cache):
    """A list of layer caches, one per model layer.

    Give ``layers``, or ``layer_class_to_replicate`` (any zero-argument callable) to create
    layers on demand as the model updates them.
    """

    def __init__(
        self,
        layers: list | None = None,
        layer_class_to_replicate: Callable[[], CacheLayerMixin] | None = None,
        offloading: bool = False,
        offload_only_non_sliding: bool = True,
    ):
        if (layers is None) == (layer_class_to_replicate is None):
            raise ValueError(
                "Cache: give exactly one of `layers` (a list of layer caches) or `layer_class_to_replicate`"
            )
        self.layers = list(layers) if layers is not None else []
        self.layer_class_to_replicate = layer_class_to_replicate
        self.offloading = bool(offloading)
        self.only_non_sliding = bool(offload_only_non_sliding)
        self.prefetch_stream = None  # created on the first CUDA update
        self._track_error = False

    def __repr__(self):
        return f"{type(self).__name__}(layers={self.layers})"

    def __len__(self):
        return len(self.layers)

    def __iter__(self):
        for layer in self.layers:
            yield layer.keys, layer.values, getattr(layer, "_sliding_window_tensor", None)

    # --- the hot path --------------------------------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store the new K/V of model layer ``layer_idx`` and return what its attention sees."""
        if self.layer_class_to_replicate is not None:
            while len(self.layers) <= layer_idx:
                self._append_layer()
        if not self.offloading:
            return self.layers[layer_idx].update(key_states, value_states)
        if key_states.is_cuda:
            return self._update_offloaded_cuda(key_states, value_states, layer_idx)
        self.prefetch(layer_idx + 1, self.only_non_sliding)
        out = self.layers[layer_idx].update(key_states, value_states)
        self.offload(layer_idx, self.only_non_sliding)
        return out

    def _update_offloaded_cuda(self, key_states, value_states, layer_idx):
        device = key_states.device
        if self.prefetch_stream is None:
            self.prefetch_stream = torch.cuda.Stream(device=device)
        default = torch.cuda.current_stream(device)
        # This layer's prefetch (started while the previous layer ran) must be done before we
        # read it, and the next prefetch must wait for the offload copies already queued.
        default.wait_stream(self.prefetch_stream)
        self.prefetch_stream.wait_stream(default)
        with torch.cuda.stream(self.prefetch_stream):
            self.prefetch(layer_idx + 1, self.only_non_sliding)
        out = self.layers[layer_idx].update(key_states, value_states)
        self.offload(layer_idx, self.only_non_sliding)
        return out

    def _append_layer(self) -> None:
        layer = self.layer_class_to_replicate()
        if self._track_error and hasattr(type(layer), "track_error"):
            layer.track_error = True
        self.layers.append(layer)

    def _offloaded(self, layer_idx: int, only_non_sliding: bool) -> bool:
        layer = self.layers[layer_idx]
        if not _has_tokens(layer):  # state and empty layers stay where they are
            return False
        return not (only_non_sliding and getattr(layer, "is_sliding", False))

    def prefetch(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        """Bring the next offloaded layer at or after ``layer_idx`` (wrapping around) to its device."""
        n = len(self.layers)
        for i in range(n):
            idx = (layer_idx + i) % n
            if self._offloaded(idx, only_non_sliding):
                self.layers[idx].prefetch()
                return

    def offload(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        if self._offloaded(layer_idx, only_non_sliding):
            self.layers[layer_idx].offload()

    # --- recurrent state -----------------------------------------------------------------------

    def _state_layer(self, layer_idx: int, what: str):
        layer = self.layers[layer_idx]
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            raise ValueError(f"{what}: layer {layer_idx} is a {type(layer).__name__}, which holds no recurrent state")
        return layer

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        layer = self._state_layer(layer_idx, "get_conv_state")
        return layer.conv_states[state_idx] if layer.has_previous_state[state_idx] else None

    def update_conv_state(self, conv_states, layer_idx: int, state_idx: int = 0, **kwargs):
        return self._state_layer(layer_idx, "update_conv_state").update_conv_state(conv_states, state_idx, **kwargs)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        layer = self._state_layer(layer_idx, "get_recurrent_state")
        return layer.recurrent_states[state_idx] if layer.has_previous_state[state_idx] else None

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        return self._state_layer(layer_idx, "update_recurrent_state").update_recurrent_state(
            recurrent_states, state_idx, **kwargs
        )

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        if layer_idx is not None and layer_idx >= len(self.layers):
            return False
        if layer_idx is None:
            found = [i for i, layer in enumerate(self.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]
            if not found:
                raise ValueError("has_previous_state: this cache has no recurrent-state layers")
            layer_idx = found[-1]
        layer = self._state_layer(layer_idx, "has_previous_state")
        if state_idx is None:
            return all(layer.has_previous_state.values())
        return layer.has_previous_state[state_idx]

    def update_indexer(self, indexer_key_states, layer_idx: int):
        raise ValueError("update_indexer: sparse-attention indexer caches are not supported by cachelib.torch")

    # --- sizes and positions -------------------------------------------------------------------

    def _token_layer(self, layer_idx: int, what: str) -> int:
        """``layer_idx`` itself for a token layer; for 0, the first token layer (hybrid models
        ask layer 0 even when it is recurrent)."""
        if _has_tokens(self.layers[layer_idx]):
            return layer_idx
        if layer_idx != 0:
            raise ValueError(
                f"{what}: layer {layer_idx} is a {type(self.layers[layer_idx]).__name__}, which has no token axis"
            )
        for i, layer in enumerate(self.layers):
            if _has_tokens(layer):
                return i
        raise ValueError(f"{what}: this cache holds only recurrent-state layers, which have no token axis")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen by layer ``layer_idx`` = position of the next token."""
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[self._token_layer(layer_idx, "get_seq_length")].get_seq_length()

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of what layer ``layer_idx`` will return for ``query_length`` new
        tokens: key slot j is masked as if it held position ``kv_offset + j``."""
        if layer_idx >= len(self.layers):
            return query_length, 0
        return self.layers[self._token_layer(layer_idx, "get_mask_sizes")].get_mask_sizes(query_length)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        if layer_idx is None:
            return max((layer.get_max_length() for layer in self.layers), default=-1)
        if layer_idx >= len(self.layers):
            return -1
        return self.layers[layer_idx].get_max_length()

    def early_initialization(self, batch_size: int, num_heads, head_dim, dtype: torch.dtype, device) -> None:
        """Allocate every layer now instead of on its first update."""
        n = len(self.layers)
        num_heads = [num_heads] * n if isinstance(num_heads, int) else list(num_heads)
        head_dim = [head_dim] * n if isinstance(head_dim, int) else list(head_dim)
        if len(num_heads) != n or len(head_dim) != n:
            raise ValueError(
                f"early_initialization: num_heads and head_dim must be ints or lists of {n} (one per layer), "
                f"got {len(num_heads)} and {len(head_dim)}"
            )
        for layer, heads, dim in zip(self.layers, num_heads, head_dim):
            if getattr(layer, "supports_early_init", False) and not layer.is_initialized:
                empty = torch.zeros((batch_size, heads, 0, dim), dtype=dtype, device=device)
                layer.lazy_initialization(empty, empty)

    # --- whole-cache edits ---------------------------------------------------------------------

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for layer in self.layers:
            layer.reorder_cache(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens from every layer (transformers 5.x:
        the argument is <= 0)."""
        for layer in self.layers:
            layer.crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        for layer in self.layers:
            layer.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for layer in self.layers:
            layer.batch_select_indices(indices)

    def activate_past_recording(self) -> None:
        for layer in self.layers:
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()

    def is_recording_past(self, layer_idx: int) -> bool:
        return bool(getattr(self.layers[layer_idx], "record_past", False))

    # --- properties transformers reads ---------------------------------------------------------

    @property
    def batch_size(self) -> int:
        sizes = {s for layer in self.layers if (s := getattr(layer, "batch_size", None)) is not None}
        if len(sizes) > 1:
            raise ValueError(f"batch_size: layers disagree: {sorted(sizes)}")
        return sizes.pop() if sizes else -1

    @property
    def is_compileable(self) -> bool:
        return bool(self.layers) and all(layer.is_compileable for layer in self.layers)

    @property
    def is_initialized(self) -> bool:
        layers = [layer for layer in self.layers if getattr(layer, "supports_early_init", False)]
        return bool(layers) and all(layer.is_initialized for layer in layers)

    @property
    def is_croppable(self) -> bool:
        return all(layer.is_croppable for layer in self.layers)

    @property
    def is_sliding(self) -> list[bool]:
        return [bool(getattr(layer, "is_sliding", False)) for layer in self.layers]

    @property
    def is_linear(self) -> list[bool]:
        return [isinstance(layer, LinearAttentionCacheLayerMixin) and not _has_tokens(layer) for layer in self.layers]

    @property
    def is_dummy(self) -> list[bool]:
        return [isinstance(layer, DummyLayer) for layer in self.layers]

    # --- ours: bytes, introspection, error probe ----------------------------------------------

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def introspect(self) -> list[CacheView]:
        """One :class:`~cachelib.introspect.CacheView` per layer, in layer order."""
        views = []
        for layer in self.layers:
            if not hasattr(layer, "introspect"):
                raise TypeError(
                    f"{type(layer).__name__} is not a cachelib layer; only cachelib layers can be introspected"
                )
            views.append(layer.introspect())
        return views

    @property
    def track_error(self) -> bool:
        """Whether quantizing layers measure the error of what they quantize (off: zero work)."""
        return self._track_error

    @track_error.setter
    def track_error(self, on: bool) -> None:
        self._track_error = bool(on)
        for part in self._error_parts():
            part.track_error = self._track_error

    def _error_parts(self) -> list:
        """The layers (and layers' attention parts) that have the switch: found once per list of
        layers (the profiler flips it twice a step), again when the layers change."""
        seen = getattr(self, "_error_parts_of", None)
        layers = self.layers
        if (
            seen is not None
            and seen[0] is layers
            and seen[1] == len(layers)
            and all(map(operator.is_, seen[2], layers))
        ):
            return seen[3]
        parts = [
            part
            for layer in layers
            for part in (layer, getattr(layer, "attention", None))
            if part is not None and hasattr(type(part), "track_error")
        ]
        self._error_parts_of = (layers, len(layers), list(layers), parts)
        return parts


class DynamicCache(Cache):
    """transformers' default cache: full-attention layers grow by concatenation; with a
    ``config``, sliding-window and recurrent layers get their own layer classes. Without one,
    ``DynamicLayer``s are created as the model updates them.

    ``layers`` (ours) builds the cache from given layers, e.g. a window on every layer.
    """

    def __init__(
        self,
        ddp_cache_data: Iterable[tuple[torch.Tensor | None, ...]] | None = None,
        config=None,
        offloading: bool = False,
        offload_only_non_sliding: bool = False,
        *,
        layers: list | None = None,
    ):
        if layers is not None and config is not None:
            raise ValueError("DynamicCache: give `config` or `layers`, not both")
        if config is not None:
            layers = build_layers(
                config,
                DynamicLayer,
                DynamicSlidingWindowLayer,
                LinearAttentionAndFullAttentionLayer,
                LinearAttentionAndSlidingWindowAttentionLayer,
            )
        if ddp_cache_data is not None:
            # One (keys, values[, sliding_window_tensor]) per layer, e.g. gathered across replicas.
            given = layers is not None
            layers = layers or []
            for idx, data in enumerate(ddp_cache_data):
                keys, values = data[:2]
                window = data[2] if len(data) == 3 else None
                if not given:
                    layers.append(DynamicSlidingWindowLayer(int(window)) if window is not None else DynamicLayer())
                if keys is not None and values is not None:
                    layers[idx].update(keys, values)
        if layers:
            super().__init__(layers=layers, offloading=offloading, offload_only_non_sliding=offload_only_non_sliding)
        else:
            super().__init__(
                layer_class_to_replicate=DynamicLayer,
                offloading=offloading,
                offload_only_non_sliding=offload_only_non_sliding,
            )


class StaticCache(Cache):
    """transformers' preallocated cache of ``max_cache_len`` tokens per layer (sliding-window
    layers preallocate their window). A forward whose tokens do not fit raises
    :class:`~cachelib.torch.CacheFullError` (a ``ValueError`` and an ``IndexError``, which
    transformers raises) before any layer changes."""

    def __init__(self, config, max_cache_len: int, offloading: bool = False, offload_only_non_sliding: bool = True):
        layers = build_layers(
            config,
            lambda: StaticLayer(max_cache_len),
            lambda window: StaticSlidingWindowLayer(max_cache_len, window),
            lambda states: LinearAttentionAndStaticFullAttentionLayer(max_cache_len, states),
            lambda window, states: LinearAttentionAndStaticSlidingWindowAttentionLayer(max_cache_len, window, states),
        )
        super().__init__(layers=layers, offloading=offloading, offload_only_non_sliding=offload_only_non_sliding)
        self.max_cache_len = max_cache_len
        self._first_token_layer = next((i for i, layer in enumerate(self.layers) if _has_tokens(layer)), None)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx == self._first_token_layer:
            # The first layer a forward updates checks them all, so a forward that cannot fit
            # leaves every layer unchanged.
            for layer in self.layers:
                static = getattr(layer, "attention", layer)
                if type(static) is StaticLayer:
                    static.check_room(key_states.shape[-2])
        return super().update(key_states, value_states, layer_idx)


class QuantizedCache(Cache):
    """transformers' KIVI-style quantized cache on full-attention layers, with our quantizer.

    ``backend="cachelib"`` (default) uses :class:`QuantizedLayer`. ``"quanto"`` and ``"hqq"``
    use transformers' own layers over optimum-quanto / HQQ when those are installed (they are
    not needed otherwise, and their layers cannot be introspected). Sliding-window and
    recurrent layers keep their own layer classes.
    """

    BACKENDS = ("cachelib", "quanto", "hqq")

    def __init__(
        self,
        config,
        nbits: int = 4,
        q_group_size: int = 64,
        residual_length: int = 128,
        backend: str = "cachelib",
    ):
        if backend not in self.BACKENDS:
            raise ValueError(
                f"QuantizedCache: backend={backend!r} is not supported; allowed: {', '.join(self.BACKENDS)}"
            )
        if backend == "cachelib":
            make = lambda: QuantizedLayer(nbits, q_group_size, residual_length)  # noqa: E731
            make()  # validate the arguments now, not at the first update
        else:
            module, package = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}[backend]
            if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
                raise ImportError(
                    f"QuantizedCache: backend={backend!r} needs {package} (pip install {package}), which is not "
                    "installed; backend='cachelib' needs nothing extra"
                )
            layer_class = _tf.QuantoQuantizedLayer if backend == "quanto" else _tf.HQQQuantizedLayer
            make = lambda: layer_class(  # noqa: E731
                nbits=nbits, q_group_size=q_group_size, residual_length=residual_length
            )
        super().__init__(layers=build_layers(config, make))
        self.backend = backend


# --- builders named by the strategy table (cachelib.spec.STRATEGIES): (spec, config) -> Cache


def build_concat(spec, config) -> DynamicCache:
    return DynamicCache(config=config)


def build_offloaded(spec, config) -> DynamicCache:
    return DynamicCache(config=config, offloading=True)


def build_static(spec, config) -> StaticCache:
    return StaticCache(config, max_cache_len=spec.get("max_len"))


def build_kivi(spec, config) -> QuantizedCache:
    return QuantizedCache(
        config, nbits=spec.get("bits"), q_group_size=spec.get("group_size"), residual_length=spec.get("residual")
    )


def build_sliding(spec, config) -> DynamicCache:
    """The spec's window on every attention layer, the model's own sliding layers included."""
    window = spec.get("window")
    layers = build_layers(
        config, lambda: DynamicSlidingWindowLayer(window), lambda _own: DynamicSlidingWindowLayer(window)
    )
    return DynamicCache(layers=layers)
