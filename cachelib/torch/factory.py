"""Build a whole-model cache for a transformers model from a strategy spec.

The strategy applies to the model's full-attention layers; sliding-window layers keep a
sliding-window layer and recurrent layers keep their state layers (the ``sliding`` strategy
instead puts its window on every attention layer). Knob values come validated from
:mod:`cachelib.spec`; what only the model can tell (does ``group_size`` divide head_dim?) is
checked here, before anything is allocated.
"""

from __future__ import annotations

from ..spec import Spec, parse_spec
from .cache import Cache
from .quantizer import check_head_dim


def _config(model):
    """The decoder config of a transformers model, a LoadedModel, or a config itself."""
    model = getattr(model, "model", model) if hasattr(model, "info") else model
    config = getattr(model, "config", model)
    if not hasattr(config, "get_text_config"):
        raise ValueError(f"make_cache: expected a transformers model or config, got a {type(model).__name__}")
    return config.get_text_config(decoder=True)


def _head_dim(config) -> int | None:
    head_dim = getattr(config, "head_dim", None)
    if head_dim:
        return int(head_dim)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    return hidden // heads if heads and hidden else None


def make_cache(model, spec: Spec | str) -> Cache:
    """A cache for ``model`` (a transformers model, a ``LoadedModel`` or a config) following
    ``spec`` (e.g. ``"rotating:max_size=512,keep=4"``)."""
    spec = parse_spec(spec)
    spec.check_backend("torch")
    config = _config(model)
    if spec.key_bits is not None or spec.value_bits is not None:
        head_dim = _head_dim(config)
        if head_dim is not None:
            check_head_dim(head_dim, spec.get("group_size"), f"{spec.name} (model head_dim)")
    return spec.strategy.builder("torch")(spec, config)
