"""Model presets for planning: the published architecture numbers of widely used models, the
bundled SmolLM2 and the runnable toy presets of :mod:`cachelib.models.presets`.

Each preset is the relevant part of the model's Hugging Face ``config.json`` (the file named in
``source``), so presets and user files go through the same reader
(:func:`cachelib.plan.arch.arch_from_config`). Dense models get their parameter count counted from
the config (it reproduces the published counts exactly); mixture-of-experts and hybrid models
carry their published count. ``torch_dtype`` (and DeepSeek-V3's FP8 ``quantization_config``)
is the checkpoint's published precision, which sizes the weights
(:func:`cachelib.plan.device.published_weights`). Nothing here loads weights.
"""

from __future__ import annotations

import os
from pathlib import Path

from .arch import Arch, arch_from_config, load_config

_HF = "https://huggingface.co/{}/blob/main/config.json"

# name -> (config fields, HF repo, published parameter count or None to count from the config, note)
_MODELS: dict[str, tuple[dict, str, int | None, str]] = {
    "llama-3.1-8b": (
        dict(
            model_type="llama",
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=128256,
            max_position_embeddings=131072,
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
        ),
        "meta-llama/Llama-3.1-8B",
        None,
        "",
    ),
    "llama-3.1-70b": (
        dict(
            model_type="llama",
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=128256,
            max_position_embeddings=131072,
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
        ),
        "meta-llama/Llama-3.1-70B",
        None,
        "",
    ),
    "qwen2.5-7b": (
        dict(
            model_type="qwen2",
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
            max_position_embeddings=131072,
            sliding_window=131072,
            use_sliding_window=False,
            max_window_layers=28,
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
        ),
        "Qwen/Qwen2.5-7B",
        None,
        "",
    ),
    "qwen3-8b": (
        dict(
            model_type="qwen3",
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=40960,
            use_sliding_window=False,
            max_window_layers=36,
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
        ),
        "Qwen/Qwen3-8B",
        None,
        "",
    ),
    "qwen3-32b": (
        dict(
            model_type="qwen3",
            hidden_size=5120,
            intermediate_size=25600,
            num_hidden_layers=64,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=40960,
            use_sliding_window=False,
            max_window_layers=64,
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
        ),
        "Qwen/Qwen3-32B",
        None,
        "",
    ),
    "mistral-7b": (
        dict(
            model_type="mistral",
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=32768,
            max_position_embeddings=32768,
            sliding_window=None,
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
        ),
        "mistralai/Mistral-7B-v0.3",
        None,
        "",
    ),
    "gemma-2-9b": (
        dict(
            model_type="gemma2",
            hidden_size=3584,
            intermediate_size=14336,
            num_hidden_layers=42,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            vocab_size=256000,
            max_position_embeddings=8192,
            sliding_window=4096,
            tie_word_embeddings=True,
            torch_dtype="float32",
        ),
        "google/gemma-2-9b",
        None,
        "",
    ),
    "gemma-3-27b": (
        # text_config of the multimodal checkpoint: 5 sliding layers (window 1024) per global one
        dict(
            model_type="gemma3_text",
            hidden_size=5376,
            intermediate_size=21504,
            num_hidden_layers=62,
            num_attention_heads=32,
            num_key_value_heads=16,
            head_dim=128,
            vocab_size=262208,
            max_position_embeddings=131072,
            sliding_window=1024,
            sliding_window_pattern=6,
            tie_word_embeddings=True,
            torch_dtype="bfloat16",
        ),
        "google/gemma-3-27b-it",
        None,
        "text decoder; the checkpoint adds a ~0.4B vision tower",
    ),
    "deepseek-v3": (
        # multi-head latent attention: each token caches kv_lora_rank + qk_rope_head_dim values
        dict(
            model_type="deepseek_v3",
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_hidden_layers=61,
            num_attention_heads=128,
            num_key_value_heads=128,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            vocab_size=129280,
            n_routed_experts=256,
            n_shared_experts=1,
            num_experts_per_tok=8,
            first_k_dense_replace=3,
            max_position_embeddings=163840,
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
            quantization_config=dict(quant_method="fp8", fmt="e4m3", weight_block_size=[128, 128]),
        ),
        "deepseek-ai/DeepSeek-V3",
        671_000_000_000,
        "published: 671B total, 37B active (the checkpoint's 14B MTP module not counted)",
    ),
    "jamba-v0.1": (
        # hybrid: one attention layer (offset 4) in every 8, the rest Mamba; MoE every other layer
        dict(
            model_type="jamba",
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=65536,
            attn_layer_period=8,
            attn_layer_offset=4,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=256,
            num_experts=16,
            num_experts_per_tok=2,
            expert_layer_period=2,
            expert_layer_offset=1,
            max_position_embeddings=262144,
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
        ),
        "ai21labs/Jamba-v0.1",
        52_000_000_000,
        "published, rounded: 52B total, 12B active",
    ),
    "smollm2": (
        # the bundled GGUF (SmolLM2-135M-Instruct); tests check these against the file's metadata
        dict(
            model_type="llama",
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            vocab_size=49152,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
            torch_dtype="bfloat16",
        ),
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        None,
        "",
    ),
}


def _tiny_configs() -> dict[str, dict]:
    from ..models import presets as model_presets

    return {name: dict(cfg, vocab_size=model_presets.VOCAB_SIZE) for name, cfg in model_presets.PRESETS.items()}


def preset_names() -> list[str]:
    """Every preset name, published models first, then the bundled and toy models."""
    return [*_MODELS, *_tiny_configs()]


def preset(name: str) -> Arch:
    """The :class:`Arch` of preset ``name``."""
    if name in _MODELS:
        config, repo, params, note = _MODELS[name]
        return arch_from_config(config, name=name, num_params=params, params_note=note, source=_HF.format(repo))
    tiny = _tiny_configs()
    if name in tiny:
        return arch_from_config(tiny[name], name=name, source=f"cachelib.models preset {name!r} (random weights)")
    raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(preset_names())}")


def resolve_model(name_or_path: str | os.PathLike) -> Arch:
    """A preset by name, or a ``config.json`` (or a folder holding one) by path."""
    text = str(name_or_path)
    if text in _MODELS or text in _tiny_configs():
        return preset(text)
    path = Path(text).expanduser()
    if path.exists() or text.endswith(".json") or os.sep in text:
        return load_config(path)
    raise ValueError(
        f"unknown model {text!r}: not a preset and no such file; presets: {', '.join(preset_names())}, "
        "or give a path to a config.json"
    )
