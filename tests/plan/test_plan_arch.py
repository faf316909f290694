"""Reading architectures: any Hugging Face config.json (unknown fields ignored, missing ones
named), layer patterns, presets, and loaded models."""

from __future__ import annotations

import json

import pytest

from cachelib.plan import arch_from_config, arch_from_model_info, load_config, preset, resolve_model

LLAMA = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
}


def _write(tmp_path, config) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_config_json_with_unknown_fields_loads(tmp_path):
    arch = load_config(_write(tmp_path, {**LLAMA, "rope_scaling": {"type": "yarn"}, "some_future_field": [1, 2]}))
    assert (arch.num_layers, arch.num_kv_heads, arch.head_dim) == (3, 2, 64)  # head_dim = 256 / 4
    assert arch.layer_kinds == ("full",) * 3
    assert load_config(tmp_path) == arch  # the folder works too


def test_missing_required_fields_are_named(tmp_path):
    config = {k: v for k, v in LLAMA.items() if k not in ("num_hidden_layers", "hidden_size")}
    with pytest.raises(ValueError, match="missing required field.*num_hidden_layers, hidden_size"):
        load_config(_write(tmp_path, config))


def test_heads_that_do_not_divide_are_refused(tmp_path):
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by num_key_value_heads=3"):
        load_config(_write(tmp_path, {**LLAMA, "num_key_value_heads": 3}))
    with pytest.raises(ValueError, match="hidden_size=250 is not divisible by num_attention_heads=4"):
        arch_from_config({**LLAMA, "hidden_size": 250})


def test_bad_values_and_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match="num_hidden_layers must be a positive integer"):
        arch_from_config({**LLAMA, "num_hidden_layers": 0})
    with pytest.raises(ValueError, match="not found"):
        load_config(tmp_path / "nowhere.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config(bad)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match=r"unknown model 'llama-9000'.*llama-3\.1-8b.*tiny-mamba"):
        resolve_model("llama-9000")
    with pytest.raises(ValueError, match="unknown model preset 'x'.*gemma-3-27b"):
        preset("x")


def test_multimodal_config_reads_its_text_config():
    arch = arch_from_config(
        {
            "model_type": "gemma3",
            "vision_config": {"hidden_size": 1152},
            "text_config": {
                "model_type": "gemma3_text",
                "hidden_size": 128,
                "num_hidden_layers": 12,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 64,
                "sliding_window": 512,
            },
        },
        name="g3",
    )
    # transformers' default pattern: every 6th layer is global
    assert arch.layer_kinds == (("sliding",) * 5 + ("full",)) * 2
    assert arch.sliding_window == 512


def test_qwen_sliding_window_only_counts_when_switched_on():
    base = {**LLAMA, "model_type": "qwen2", "num_hidden_layers": 4, "sliding_window": 64, "max_window_layers": 2}
    assert arch_from_config({**base, "use_sliding_window": False}).layer_kinds == ("full",) * 4
    assert arch_from_config({**base, "use_sliding_window": True}).layer_kinds == ("full",) * 2 + ("sliding",) * 2


def test_mistral_window_slides_every_layer_and_null_means_none():
    assert arch_from_config({**LLAMA, "model_type": "mistral", "sliding_window": 4096}).layer_kinds == ("sliding",) * 3
    assert arch_from_config({**LLAMA, "model_type": "mistral", "sliding_window": None}).layer_kinds == ("full",) * 3


def test_explicit_layer_types_win_and_unknown_ones_are_named():
    arch = arch_from_config(
        {**LLAMA, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "sliding_window": 16}
    )
    assert arch.layer_kinds == ("sliding", "full", "sliding")
    with pytest.raises(ValueError, match=r"layer type\(s\) \['chunked_attention'\] are not modelled"):
        arch_from_config({**LLAMA, "layer_types": ["chunked_attention"] * 3})
    with pytest.raises(ValueError, match="sliding layers but no sliding_window"):
        arch_from_config({**LLAMA, "layer_types": ["sliding_attention"] * 3})


def test_unsupported_recurrent_family_is_named():
    with pytest.raises(ValueError, match="'qwen3_next' are not modelled"):
        arch_from_config({**LLAMA, "model_type": "qwen3_next", "layer_types": ["linear_attention"] * 3})


def test_mamba_config_gives_the_recurrent_state_shape():
    arch = arch_from_config(
        {
            "model_type": "mamba",
            "hidden_size": 768,
            "num_hidden_layers": 24,
            "state_size": 16,
            "conv_kernel": 4,
            "expand": 2,
            "vocab_size": 50280,
        }
    )
    assert arch.layer_kinds == ("recurrent",) * 24
    assert (arch.recurrent.channels, arch.recurrent.conv_kernel, arch.recurrent.state_size) == (1536, 4, 16)
    with pytest.raises(ValueError, match="missing required field.*state_size"):
        arch_from_config({"model_type": "mamba", "hidden_size": 768, "num_hidden_layers": 24, "conv_kernel": 4})


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-mamba"])
def test_a_loaded_model_gives_the_same_arch_as_its_preset(load_model, name):
    loaded = load_model(name, "mlx")
    arch = arch_from_model_info(loaded.info)
    ref = preset(name)
    fields = ("num_layers", "num_kv_heads", "head_dim", "layer_kinds", "sliding_window", "recurrent", "num_params")
    assert {f: getattr(arch, f) for f in fields} == {f: getattr(ref, f) for f in fields}
    assert arch.config["measured_weight_bytes"] == loaded.info.weight_bytes


@pytest.mark.bundled
def test_smollm2_preset_matches_the_bundled_gguf():
    from cachelib.models import gguf

    config = gguf.read_config(str(gguf.bundled_path()))
    arch, ref = arch_from_config(config, name="bundled"), preset("smollm2")
    for f in (
        "num_layers",
        "hidden_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "num_params",
    ):
        assert getattr(arch, f) == getattr(ref, f), f


def test_multi_query_means_one_kv_head_whatever_else_the_config_says():
    # transformers' and mlx-lm's gpt_bigcode cache one K/V head when multi_query is set
    arch = arch_from_config({**LLAMA, "model_type": "gpt_bigcode", "multi_query": True, "num_key_value_heads": 4})
    assert arch.num_kv_heads == 1


def test_kv_channels_is_the_head_dim_where_a_config_names_it_so():
    arch = arch_from_config({**LLAMA, "model_type": "jetmoe", "kv_channels": 128})  # hidden / heads would be 64
    assert arch.head_dim == 128


def test_a_latent_cache_does_not_need_heads_divisible_by_kv_heads():
    arch = arch_from_config(
        {**LLAMA, "model_type": "deepseek_v3", "num_key_value_heads": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 16}
    )
    assert (arch.kv_heads, arch.key_dim, arch.value_dim) == (1, 32, 16)


def test_attention_with_an_unmodelled_ssm_mixer_is_refused_by_name():
    with pytest.raises(ValueError, match="recurrent layers of model_type 'falcon_h1'.*mamba_d_ssm"):
        arch_from_config({**LLAMA, "model_type": "falcon_h1", "mamba_d_ssm": 64, "mamba_d_state": 16})
    with pytest.raises(ValueError, match="'openai-gpt' model keeps no KV cache"):
        arch_from_config({**LLAMA, "model_type": "openai-gpt"})
