"""The foundation: real models load and decode on both backends; bad input is named."""

from __future__ import annotations

import json

import pytest

from cachelib.decode import encode_prompt, greedy_decode
from cachelib.models import BACKENDS, available_devices, load, model_names

PROMPT = "What is the capital of France?"


@pytest.mark.bundled
@pytest.mark.parametrize("backend", BACKENDS)
def test_bundled_model_answers_paris(backend, smollm2_mlx, smollm2_torch):
    loaded = smollm2_mlx if backend == "mlx" else smollm2_torch
    out = greedy_decode(loaded, PROMPT, max_tokens=32)
    assert "Paris" in out.text


@pytest.mark.bundled
def test_mlx_keeps_gguf_blocks_as_quantized_weights_and_agrees_with_torch(smollm2_torch):
    import mlx.nn as nn

    quantized = load("smollm2", "mlx", weights="quantized")
    inner = quantized.model.model
    q_proj = inner.layers[0].self_attn.q_proj
    assert isinstance(q_proj, nn.QuantizedLinear) and (q_proj.bits, q_proj.group_size) == (4, 32)
    assert isinstance(inner.embed_tokens, nn.QuantizedEmbedding) and inner.embed_tokens.bits == 8
    assert quantized.info.weight_bytes < smollm2_torch.info.weight_bytes / 4
    # The same 32 greedy tokens on both backends proves the Q/K un-permutation (a wrong RoPE
    # layout turns the answer into noise within a few tokens).
    a = greedy_decode(quantized, PROMPT, max_tokens=32, stop_at_eos=False).ids
    b = greedy_decode(smollm2_torch, PROMPT, max_tokens=32, stop_at_eos=False).ids
    assert a == b


@pytest.mark.bundled
def test_tokenizer_and_chat_template_identical_on_both_backends(smollm2_mlx, smollm2_torch):
    a = encode_prompt(smollm2_mlx.tokenizer, PROMPT)
    b = encode_prompt(smollm2_torch.tokenizer, PROMPT)
    assert a == b
    text = smollm2_mlx.tokenizer.decode(a)
    assert "<|im_start|>user" in text and text.rstrip().endswith("<|im_start|>assistant")


@pytest.mark.bundled
def test_info_record_describes_the_model(smollm2_mlx, smollm2_torch):
    for loaded, backend in ((smollm2_mlx, "mlx"), (smollm2_torch, "torch")):
        info = loaded.info
        assert info.backend == backend and info.device in available_devices(backend)
        assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (30, 9, 3, 64)
        assert info.architecture == "llama" and not info.random_weights
        assert info.weight_bytes > 0 and info.dtype == "float32"


@pytest.mark.parametrize("name", [n for n in model_names() if n != "smollm2"])
def test_each_preset_prefills_and_decodes_16_steps_on_both_backends(name, load_model):
    ids = {}
    for backend in BACKENDS:
        loaded = load_model(name, backend)
        assert loaded.info.random_weights
        out = greedy_decode(loaded, "Tell me about caches.", max_tokens=17, stop_at_eos=False)
        assert len(out.ids) == 17
        ids[backend] = out.ids
    # Presets are written once as a folder, so both backends run the very same random weights.
    assert ids["mlx"] == ids["torch"]


def test_local_folder_loads_on_both_backends(tmp_path, load_model):
    import shutil

    src = load_model("tiny-llama", "torch").info.source
    dst = tmp_path / "my-model"
    shutil.copytree(src, dst)
    for backend in BACKENDS:
        loaded = load(str(dst), backend)
        assert loaded.info.name == "my-model" and loaded.info.architecture == "llama"
        assert len(greedy_decode(loaded, "hi", max_tokens=4, stop_at_eos=False).ids) == 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name_or_path": "gpt-17"}, "unknown model 'gpt-17'; use one of: smollm2, tiny-llama"),
        ({"name_or_path": "/no/such/folder"}, "does not exist"),
        ({"backend": "jax"}, "unknown backend 'jax'; allowed: mlx, torch"),
        ({"backend": "torch", "device": "tpu"}, "device 'tpu' is not available for torch on this machine; available:"),
        ({"dtype": "int3"}, "unknown dtype 'int3'; supported: float32, float16, bfloat16"),
    ],
)
def test_bad_input_names_the_problem_and_what_is_supported(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load(**kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unsupported_architecture_is_refused_with_the_supported_list(tmp_path, backend, load_model):
    import shutil

    folder = tmp_path / "weird"
    shutil.copytree(load_model("tiny-llama", "torch").info.source, folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "flux_capacitor"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=rf"architecture 'flux_capacitor' is not supported on {backend}; supported \(\d+\): .*llama"
    ):
        load(str(folder), backend)


def test_empty_prompt_is_refused(load_model):
    with pytest.raises(ValueError, match="prompt is empty"):
        greedy_decode(load_model("tiny-llama", "mlx"), "   ")
