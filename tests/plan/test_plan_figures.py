"""The planner reproduces published figures: KV bytes per token, latent-cache size, quantized
storage ratios, parameter counts and layer patterns of the preset models."""

from __future__ import annotations

import pytest

from cachelib.plan import (
    kv_bytes_per_token,
    preset,
    preset_names,
    quantized_storage_ratio,
    token_bytes,
    weight_bytes,
)


@pytest.mark.parametrize(
    "name, per_token",
    [
        ("llama-3.1-8b", 131_072),  # 32 layers x 8 kv heads x 128 x 2 (K, V) x 2 bytes
        ("llama-3.1-70b", 327_680),  # 80 layers x 8 x 128 x 2 x 2
        ("deepseek-v3", 70_272),  # 61 layers x (512 latent + 64 rope) x 2 bytes
    ],
)
def test_fp16_kv_bytes_per_token_match_published_figures(name, per_token):
    assert kv_bytes_per_token(preset(name), "float16") == per_token


def test_deepseek_v3_caches_the_latent_not_per_head_keys():
    arch = preset("deepseek-v3")
    assert (arch.num_layers, arch.kv_heads, arch.key_dim, arch.value_dim) == (61, 1, 512, 64)


@pytest.mark.parametrize("bits, ratio", [(4, 0.28125), (8, 0.53125)])
def test_group64_quantized_storage_ratio_with_fp16_scales(bits, ratio):
    assert quantized_storage_ratio(bits, 64, "float16") == ratio
    # and the per-token bytes of a real model's cache agree exactly
    arch = preset("llama-3.1-8b")
    q = token_bytes(arch, "float16", key_bits=bits, value_bits=bits, group_size=64)
    assert q / token_bytes(arch, "float16") == ratio
    assert kv_bytes_per_token(arch, bits=bits) == 131_072 * ratio


@pytest.mark.parametrize(
    "name, params",
    [  # counted from the config; equal to the counts the model cards publish
        ("llama-3.1-8b", 8_030_261_248),
        ("llama-3.1-70b", 70_553_706_496),
        ("qwen2.5-7b", 7_615_616_512),
        ("qwen3-8b", 8_190_735_360),
        ("qwen3-32b", 32_762_123_264),
        ("mistral-7b", 7_248_023_552),
        ("gemma-2-9b", 9_241_705_984),
        ("smollm2", 134_515_008),
    ],
)
def test_parameter_counts_reproduce_published_counts(name, params):
    assert preset(name).num_params == params


def test_fp16_weights_are_two_bytes_per_parameter():
    assert weight_bytes(preset("llama-3.1-8b"), 16) == 2 * 8_030_261_248
    assert weight_bytes(preset("llama-3.1-8b"), 4.5) == 4_517_021_952


def test_gemma3_27b_has_five_sliding_layers_per_global_one_with_window_1024():
    arch = preset("gemma-3-27b")
    assert arch.sliding_window == 1024
    assert arch.layer_kinds[:6] == ("sliding",) * 5 + ("full",)
    assert arch.layer_kinds.count("full") == 10 and arch.layer_kinds.count("sliding") == 52


def test_gemma2_9b_alternates_sliding_and_global_layers():
    arch = preset("gemma-2-9b")
    assert arch.layer_kinds[:4] == ("sliding", "full", "sliding", "full")
    assert arch.sliding_window == 4096


def test_jamba_is_one_attention_layer_in_eight_and_mamba_elsewhere():
    arch = preset("jamba-v0.1")
    assert [i for i, k in enumerate(arch.layer_kinds) if k == "full"] == [4, 12, 20, 28]
    assert (arch.recurrent.channels, arch.recurrent.conv_kernel, arch.recurrent.state_size) == (8192, 4, 16)
    # only the 4 attention layers cache K/V per token
    assert kv_bytes_per_token(arch) == 4 * 8 * 128 * 2 * 2


def test_every_required_preset_exists():
    names = set(preset_names())
    for required in (
        "llama-3.1-8b",
        "llama-3.1-70b",
        "qwen2.5-7b",
        "qwen3-8b",
        "qwen3-32b",
        "mistral-7b",
        "gemma-2-9b",
        "gemma-3-27b",
        "deepseek-v3",
        "jamba-v0.1",
        "smollm2",
        "tiny-llama",
        "tiny-gemma3",
        "tiny-mamba",
    ):
        assert required in names
    for name in names:
        assert preset(name).num_params, f"{name} has no parameter count"


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-mamba"])
def test_toy_preset_parameter_counts_equal_the_real_models(load_model, name):
    from mlx.utils import tree_flatten

    loaded = load_model(name, "mlx")
    assert preset(name).num_params == sum(v.size for _, v in tree_flatten(loaded.model.parameters()))
