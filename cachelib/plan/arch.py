"""The architecture numbers a KV-cache planner needs, read from a Hugging Face ``config.json``.

An :class:`Arch` says, per layer, what a cache must hold: K/V of full-attention layers, K/V of
sliding-window layers (and their window), the latent K/V of multi-head latent attention (MLA), or
the conv + SSM state of recurrent (Mamba-style) layers. It also carries the parameter count, so
weights can be sized.

This module knows config field names and the layer-type conventions of transformers (which
layers of gemma-2/3, qwen2/3, mistral and jamba slide or recur); it knows nothing of cache
strategies or backends' allocation rules (``cachelib.plan.accounting`` does).
Unknown config fields are ignored; a missing required field is named in the error.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

from ..core.reader import read_json
from ..core.units import clip_input

LayerKind = Literal["full", "sliding", "recurrent"]
LAYER_KINDS = ("full", "sliding", "recurrent")

# transformers' layer_types names -> ours
_LAYER_TYPE_NAMES = {
    "full_attention": "full",
    "sliding_attention": "sliding",
    "linear_attention": "recurrent",
    "mamba": "recurrent",
}
# transformers' defaults where a config may omit the window of a model that always slides
_DEFAULT_WINDOW = {
    "mistral": 4096,
    "gemma2": 4096,
    "gemma3_text": 4096,
    "gemma3": 4096,
    "cohere2": 4096,
    "gpt_oss": 128,
    "olmo3": 4096,
    "cwm": 8192,
    "afmoe": 1024,
    "mimo_v2_flash": 129,
    "granite_swa": 128,
}
_RECURRENT_TYPES = ("mamba", "falcon_mamba", "jamba")
_NO_KV_CACHE = ("openai-gpt",)  # transformers' OpenAIGPTModel takes no cache


@dataclass(frozen=True)
class Latent:
    """Multi-head latent attention: each token caches one latent vector and one shared RoPE key
    (deepseek-v2/v3 in mlx-lm and transformers: keys ``(B, 1, T, kv_lora_rank)``, values
    ``(B, 1, T, qk_rope_head_dim)``)."""

    kv_lora_rank: int
    qk_rope_head_dim: int


@dataclass(frozen=True)
class Recurrent:
    """State of a Mamba-style layer, per batch row: a causal-conv window over ``channels`` and an
    SSM state of ``channels x state_size``."""

    channels: int  # the mixer's inner width (expand * hidden_size)
    conv_kernel: int
    state_size: int


@dataclass(frozen=True)
class Arch:
    """One model's architecture, as far as cache and weight memory go."""

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_kinds: tuple[str, ...]  # one of LAYER_KINDS per layer
    sliding_window: int | None = None
    vocab_size: int | None = None
    intermediate_size: int | None = None
    max_position_embeddings: int | None = None
    latent: Latent | None = None
    recurrent: Recurrent | None = None
    num_params: int | None = None
    params_note: str = ""  # where num_params comes from ("published ...", "counted from the config")
    source: str = ""  # the file, preset or URL the numbers come from
    config: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if len(self.layer_kinds) != self.num_layers:
            raise ValueError(
                f"{self.name}: {len(self.layer_kinds)} layer kinds for num_hidden_layers={self.num_layers}"
            )
        bad = sorted(set(self.layer_kinds) - set(LAYER_KINDS))
        if bad:
            raise ValueError(f"{self.name}: unknown layer kind(s) {bad}; allowed: {', '.join(LAYER_KINDS)}")
        if "sliding" in self.layer_kinds and not self.sliding_window:
            raise ValueError(f"{self.name}: sliding layers need a sliding_window")
        if "recurrent" in self.layer_kinds and self.recurrent is None:
            raise ValueError(f"{self.name}: recurrent layers need their state sizes")

    @property
    def kv_heads(self) -> int:
        """Heads on the cached K/V arrays (1 for latent attention)."""
        return 1 if self.latent else self.num_kv_heads

    @property
    def key_dim(self) -> int:
        """Last dimension of the cached keys."""
        return self.latent.kv_lora_rank if self.latent else self.head_dim

    @property
    def value_dim(self) -> int:
        """Last dimension of the cached values."""
        return self.latent.qk_rope_head_dim if self.latent else self.head_dim

    @property
    def attention_layers(self) -> int:
        return sum(k != "recurrent" for k in self.layer_kinds)

    @property
    def names(self) -> frozenset[str]:
        """The names this model goes by: the preset or config name, and the repository name its
        source names (``smollm2`` is also ``SmolLM2-135M-Instruct``). Profiles record the latter."""
        names = {self.name}
        match = re.search(r"huggingface\.co/[^/]+/([^/]+)", self.source)
        if match:
            names.add(match.group(1))
        return frozenset(names)

    def describe(self) -> str:
        kinds = ", ".join(f"{self.layer_kinds.count(k)} {k}" for k in LAYER_KINDS if k in self.layer_kinds)
        kv = (
            f"latent {self.latent.kv_lora_rank}+{self.latent.qk_rope_head_dim}"
            if self.latent
            else f"{self.num_kv_heads} kv heads x {self.head_dim}"
        )
        window = f", window {self.sliding_window}" if "sliding" in self.layer_kinds else ""
        return f"{self.name}: {self.num_layers} layers ({kinds}), {kv}{window}"

    def context_warning(self, context: int) -> str | None:
        """What to say of a ``context`` past the model's length (``max_position_embeddings``);
        None within it, or when the config gives no length. The bytes are still exact: they are
        what a cache would hold, not what the model can attend over."""
        limit = self.max_position_embeddings
        if not limit or context <= limit:
            return None
        return (
            f"context {context:,} is past {self.name}'s limit of {limit:,} tokens (max_position_embeddings): "
            "the bytes are what the cache would hold, but the model was not built to attend that far"
        )


# ---------------------------------------------------------------------------------------------
# config.json -> Arch


def _first(config: Mapping, *names: str):
    for n in names:
        if config.get(n) is not None:
            return config[n]
    return None


class ConfigNumberError(ValueError):
    """A config number no model can have (0 layers, 10^12 layers, an infinite hidden size): every
    loader would fail on it too, so a run is refused with this before the model loads."""


MAX_LAYERS = 100_000  # far past any model (deepseek-v3: 61); a config of 10^12 layers is refused, not allocated


def _positive(name: str, value, where: str, most: int = 2**31 - 1) -> int:
    """``value`` as an int in [1, ``most``] (MLX's int32 indexes by default); else a ValueError."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or int(value) != value or not 0 < value <= most:
        raise ConfigNumberError(
            f"{where}: {name} must be a positive integer (1 to {most:,}), got {clip_input(repr(value))}"
        )
    return int(value)


def arch_from_config(
    config: Mapping[str, Any],
    name: str | None = None,
    *,
    num_params: int | None = None,
    params_note: str = "",
    source: str = "",
) -> Arch:
    """Build an :class:`Arch` from a Hugging Face config dict (``text_config`` is used when present).

    ``num_params`` (published count) wins; otherwise dense llama-family configs get their
    parameters counted from the config (see :func:`count_params`); others have none (give the
    weights explicitly).
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"a model config must be a JSON object, got {type(config).__name__}")
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    model_type = str(text.get("model_type") or config.get("model_type") or "")
    name = name or str(config.get("_name_or_path") or config.get("name") or model_type or "model")
    where = source or name

    required = {
        "num_hidden_layers": ("num_hidden_layers", "n_layer", "n_layers", "num_layers"),
        "hidden_size": ("hidden_size", "d_model", "n_embd"),
    }
    if model_type not in ("mamba", "falcon_mamba"):
        required["num_attention_heads"] = ("num_attention_heads", "n_head")
    values = {k: _first(text, *aliases) for k, aliases in required.items()}
    missing = [k for k, v in values.items() if v is None]
    if missing:
        raise ValueError(
            f"{where}: config is missing required field(s): {', '.join(missing)}"
            + (f" (model_type {model_type!r})" if model_type else "")
        )
    layers = _positive("num_hidden_layers", values["num_hidden_layers"], where, MAX_LAYERS)
    hidden = _positive("hidden_size", values["hidden_size"], where)

    latent = None
    if text.get("kv_lora_rank") is not None:
        latent = Latent(
            _positive("kv_lora_rank", text["kv_lora_rank"], where),
            _positive("qk_rope_head_dim", text.get("qk_rope_head_dim"), where),
        )

    if "num_attention_heads" in values:
        heads = _positive("num_attention_heads", values["num_attention_heads"], where)
        kv_heads = _first(text, "num_key_value_heads", "num_kv_heads", "n_head_kv")
        if text.get("multi_query"):  # gpt_bigcode: one K/V head, whatever else the config says
            kv_heads = 1
        kv_heads = _positive("num_key_value_heads", heads if kv_heads is None else kv_heads, where)
        if heads % kv_heads and latent is None:  # a latent cache has no key/value heads of its own
            raise ValueError(
                f"{where}: num_attention_heads={heads} is not divisible by num_key_value_heads={kv_heads}; "
                "each key/value head must serve a whole number of query heads"
            )
        head_dim = _first(text, "head_dim", "kv_channels")  # jetmoe / chatglm: kv_channels per head
        if latent is not None:
            head_dim = latent.qk_rope_head_dim  # unused for caching; transformers sets it so too
        elif head_dim is None:
            if hidden % heads:
                raise ValueError(
                    f"{where}: hidden_size={hidden} is not divisible by num_attention_heads={heads} "
                    "and the config gives no head_dim"
                )
            head_dim = hidden // heads
        head_dim = _positive("head_dim", head_dim, where)
    else:
        heads = kv_heads = head_dim = 0

    kinds, window = _layer_kinds(text, model_type, layers, where)
    recurrent = _recurrent(text, model_type, hidden, where) if "recurrent" in kinds else None

    arch = Arch(
        name=name,
        model_type=model_type,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        layer_kinds=kinds,
        sliding_window=window,
        vocab_size=_first(text, "vocab_size") or _first(config, "vocab_size"),
        intermediate_size=_first(text, "intermediate_size", "ffn_dim"),
        max_position_embeddings=_first(text, "max_position_embeddings", "n_positions"),
        latent=latent,
        recurrent=recurrent,
        source=source,
        config=dict(config),
    )
    if num_params is not None:
        return _with_params(arch, int(num_params), params_note or "given")
    counted = count_params(arch)
    if counted is not None:
        return _with_params(arch, counted, "counted from the config")
    return arch


def _with_params(arch: Arch, n: int, note: str) -> Arch:
    return replace(arch, num_params=n, params_note=note)


def _every(n: int, first: str, rest: str, offset: int = 1) -> Callable[[int], str]:
    """Layer i is ``first`` when ``(i + offset) % n == 0``, else ``rest``."""
    return lambda i: first if (i + offset) % n == 0 else rest


# How transformers 5.24's config classes fill ``layer_types`` when a config.json omits it
# (``models/<type>/configuration_<type>.py``, ``__post_init__``); read with the config's own fields.
_DERIVED_LAYER_TYPES = {
    # full_attention_interval (default 4): every n-th layer full, the others gated-delta linear attention
    "qwen3_next": lambda t: _every(int(t.get("full_attention_interval", 4)), "full_attention", "linear_attention"),
    "cohere2": lambda t: _every(int(t.get("sliding_window_pattern", 4)), "full_attention", "sliding_attention"),
    "gpt_oss": lambda t: _every(2, "full_attention", "sliding_attention"),
    "olmo3": lambda t: _every(4, "full_attention", "sliding_attention"),
    "afmoe": lambda t: _every(int(t.get("global_attn_every_n_layers", 4)), "full_attention", "sliding_attention"),
    "cwm": lambda t: _every(4, "full_attention", "sliding_attention", offset=0),
    "granite_swa": lambda t: _every(4, "full_attention", "sliding_attention", offset=0),
    "mimo_v2_flash": lambda t: lambda i: "full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention",
}


def derived_layer_types(text: Mapping, model_type: str, layers: int) -> list[str] | None:
    """``layer_types`` as transformers' config class derives it for a config without one (None
    for a model type that derives none here)."""
    rule = _DERIVED_LAYER_TYPES.get(model_type)
    if rule is None:
        return None
    kind_of = rule(text)
    return [kind_of(i) for i in range(layers)]


def _layer_kinds(text: Mapping, model_type: str, layers: int, where: str) -> tuple[tuple[str, ...], int | None]:
    window = text.get("sliding_window")
    explicit = text.get("layer_types") or derived_layer_types(text, model_type, layers)
    mixer = sorted(k for k in text if k.startswith(("mamba_", "ssm_")))
    if mixer and model_type not in _RECURRENT_TYPES:  # e.g. falcon_h1: attention and SSM in each layer
        raise ValueError(
            f"{where}: recurrent layers of model_type {model_type!r} (config fields {', '.join(mixer[:3])}) are not "
            f"modelled by the planner; supported: {', '.join(_RECURRENT_TYPES)}"
        )
    if model_type in _NO_KV_CACHE:
        raise ValueError(f"{where}: transformers' {model_type!r} model keeps no KV cache; nothing to plan")
    if model_type == "jamba":
        period = _positive("attn_layer_period", text.get("attn_layer_period", 8), where)
        offset = int(text.get("attn_layer_offset", 4))
        kinds = tuple("full" if i % period == offset else "recurrent" for i in range(layers))
        return kinds, None
    if model_type in ("mamba", "falcon_mamba"):
        return ("recurrent",) * layers, None
    if explicit:
        if len(explicit) < layers:
            raise ValueError(f"{where}: layer_types lists {len(explicit)} layers, num_hidden_layers={layers}")
        unknown = sorted({t for t in explicit[:layers] if t not in _LAYER_TYPE_NAMES})
        if unknown:
            raise ValueError(
                f"{where}: layer type(s) {unknown} are not modelled by the planner; "
                f"supported: {', '.join(_LAYER_TYPE_NAMES)}"
            )
        kinds = tuple(_LAYER_TYPE_NAMES[t] for t in explicit[:layers])
    elif model_type == "gemma2":
        kinds = tuple("sliding" if (i + 1) % 2 else "full" for i in range(layers))
    elif model_type in ("gemma3", "gemma3_text"):
        pattern = _positive("sliding_window_pattern", text.get("sliding_window_pattern", 6), where)
        kinds = tuple("sliding" if (i + 1) % pattern else "full" for i in range(layers))
    elif "use_sliding_window" in text:  # qwen2/qwen3: the window is off unless switched on
        first = int(text.get("max_window_layers", layers))
        on = bool(text.get("use_sliding_window")) and window is not None
        kinds = tuple("sliding" if on and i >= first else "full" for i in range(layers))
    elif window is not None or (model_type in _DEFAULT_WINDOW and "sliding_window" not in text):
        kinds = ("sliding",) * layers  # transformers: a window in the config slides every layer
    else:
        kinds = ("full",) * layers
    if "sliding" in kinds:
        window = window if window is not None else _DEFAULT_WINDOW.get(model_type)
        if window is None:
            raise ValueError(f"{where}: config has sliding layers but no sliding_window")
        window = _positive("sliding_window", window, where)
    else:
        window = None
    return kinds, window


def _recurrent(text: Mapping, model_type: str, hidden: int, where: str) -> Recurrent:
    if model_type == "jamba":
        expand, state, kernel = text.get("mamba_expand", 2), text.get("mamba_d_state", 16), text.get("mamba_d_conv", 4)
        channels = int(expand) * hidden
    elif model_type in ("mamba", "falcon_mamba"):
        state = _first(text, "state_size", "d_state")
        kernel = _first(text, "conv_kernel", "d_conv")
        missing = [n for n, v in (("state_size", state), ("conv_kernel", kernel)) if v is None]
        if missing:
            raise ValueError(
                f"{where}: config is missing required field(s): {', '.join(missing)} (model_type {model_type!r})"
            )
        channels = _first(text, "intermediate_size", "d_inner")
        if channels is None:
            channels = int(text.get("expand", 2)) * hidden
    else:
        raise ValueError(
            f"{where}: recurrent layers of model_type {model_type!r} are not modelled by the planner; "
            f"supported: {', '.join(_RECURRENT_TYPES)}"
        )
    return Recurrent(
        _positive("intermediate_size", channels, where),
        _positive("conv_kernel", kernel, where),
        _positive("state_size", state, where),
    )


def load_config(path: str | os.PathLike) -> Arch:
    """An :class:`Arch` from a ``config.json`` file, or a folder holding one."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise ValueError(
            f"model config {clip_input(str(path))!r} not found (give a config.json or a folder holding one)"
        )
    config = read_json(p, "model config")  # bounded: no device or pipe, nesting capped
    name = p.parent.name if p.name == "config.json" else p.stem
    return arch_from_config(config, name=name, source=str(p))


def arch_from_model_info(info) -> Arch:
    """An :class:`Arch` for a model loaded by :func:`cachelib.models.load`, with its measured
    weight bytes kept in ``config['measured_weight_bytes']``.

    A model folder's own config.json is read when there is one (it has every field, recurrent
    ones included); otherwise the fields of ``info`` describe an attention-only model.
    """
    source = Path(str(info.source))
    if source.is_dir() and (source / "config.json").is_file():
        config = read_json(source / "config.json", "model config")
    else:
        config = {
            "model_type": info.architecture,
            "num_hidden_layers": info.num_layers,
            "hidden_size": info.hidden_size,
            "num_attention_heads": info.num_heads,
            "num_key_value_heads": info.num_kv_heads,
            "head_dim": info.head_dim,
            "vocab_size": info.vocab_size,
            "sliding_window": info.sliding_window,
            "max_position_embeddings": info.max_position_embeddings,
        }
        if info.layer_types:
            config["layer_types"] = list(info.layer_types)
    arch = arch_from_config(config, name=info.name, source=str(info.source))
    return replace(arch, config={**arch.config, "measured_weight_bytes": int(info.weight_bytes)})


# ---------------------------------------------------------------------------------------------
# parameters

_QKV_BIAS = ("qwen2",)
_QK_NORM = ("qwen3", "gemma3", "gemma3_text")
_FOUR_NORMS = ("gemma2", "gemma3", "gemma3_text")  # input, post-attention, pre- and post-MLP
_DENSE = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text")


def count_params(arch: Arch) -> int | None:
    """Exact parameter count of a dense llama-family decoder (gated MLP, RMSNorm) or of a pure
    Mamba model, or None for other families (MoE, latent attention, hybrids), whose counts must
    be given."""
    cfg = arch.config.get("text_config") if isinstance(arch.config.get("text_config"), Mapping) else arch.config
    if arch.model_type in ("mamba", "falcon_mamba") and arch.recurrent and arch.vocab_size:
        return _count_mamba_params(arch, cfg)
    if arch.model_type not in _DENSE or arch.latent or arch.recurrent:
        return None
    if any(cfg.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        return None
    if not arch.vocab_size or not arch.intermediate_size:
        return None
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_heads * d, arch.num_kv_heads * d
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * arch.intermediate_size
    per_layer += (4 if arch.model_type in _FOUR_NORMS else 2) * h
    if arch.model_type in _QKV_BIAS or cfg.get("attention_bias"):
        per_layer += q + 2 * kv
    if arch.model_type in _QK_NORM:
        per_layer += 2 * d
    embed = arch.vocab_size * h
    tied = cfg.get("tie_word_embeddings", arch.model_type in _FOUR_NORMS)
    return arch.num_layers * per_layer + embed * (1 if tied else 2) + h


def _count_mamba_params(arch: Arch, cfg: Mapping) -> int:
    h, inner = arch.hidden_size, arch.recurrent.channels
    n, k = arch.recurrent.state_size, arch.recurrent.conv_kernel
    rank = cfg.get("time_step_rank", "auto")
    rank = -(-h // 16) if rank == "auto" else int(rank)
    bias = bool(cfg.get("use_bias", False))
    per_layer = (
        h * 2 * inner
        + (2 * inner if bias else 0)  # in_proj
        + inner * k
        + (inner if cfg.get("use_conv_bias", True) else 0)  # depthwise conv1d
        + inner * (rank + 2 * n)  # x_proj
        + rank * inner
        + inner  # dt_proj (always biased)
        + inner * n
        + inner  # A_log, D
        + inner * h
        + (h if bias else 0)  # out_proj
        + h  # norm
    )
    tied = cfg.get("tie_word_embeddings", True)
    return arch.num_layers * per_layer + arch.vocab_size * h * (1 if tied else 2) + h
