"""Architecture presets: real mlx-lm / transformers model classes at toy sizes, random weights.

They exist so every cache strategy runs through real model code of each kind of layer: full
attention (llama), interleaved sliding-window and global attention (gemma3), and recurrent state
(mamba). A preset is materialised once as an ordinary model folder (config.json, safetensors
written by transformers, the bundled tokenizer) under the cachelib cache directory, so both
backends load the very same random weights through the local-folder path.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from .gguf import bundled_path, cache_dir, load_tokenizer

VOCAB_SIZE = 49152  # the bundled tokenizer's vocabulary, so prompts tokenize the same way

PRESETS: dict[str, dict] = {
    "tiny-llama": {
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        # Wider than the default 0.02 so that random logits are not flat and greedy tokens vary.
        "initializer_range": 0.25,
    },
    "tiny-gemma3": {
        "model_type": "gemma3_text",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 6,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "sliding_window": 32,
        "sliding_window_pattern": 3,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
        "max_position_embeddings": 4096,
        "query_pre_attn_scalar": 64,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "tie_word_embeddings": True,
    },
    "tiny-mamba": {
        "model_type": "mamba",
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "state_size": 16,
        "conv_kernel": 4,
        "expand": 2,
        "time_step_rank": 8,
        "use_conv_bias": True,
        "use_bias": False,
        "tie_word_embeddings": True,
    },
}

SEED = 0


def preset_names() -> list[str]:
    return list(PRESETS)


def preset_folder(name: str) -> Path:
    """The folder of preset ``name``, written on first use."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    config = dict(PRESETS[name], vocab_size=VOCAB_SIZE, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    key = hashlib.sha256(json.dumps([config, SEED], sort_keys=True).encode()).hexdigest()[:12]
    folder = cache_dir() / "presets" / f"{name}-{key}"
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder.parent))
    try:
        _write(config, tmp)
        try:
            tmp.rename(folder)
        except OSError:  # another process won the race
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _write(config: dict, folder: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**config)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model.save_pretrained(str(folder), safe_serialization=True)
    # Keep fields that mlx-lm reads but transformers may drop (e.g. gemma3's pattern).
    saved = json.loads((folder / "config.json").read_text())
    saved.update({k: v for k, v in config.items() if k not in saved})
    saved["cachelib_preset"] = True
    (folder / "config.json").write_text(json.dumps(saved, indent=2))
    load_tokenizer(str(bundled_path())).save_pretrained(str(folder))
