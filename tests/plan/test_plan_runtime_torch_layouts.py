"""The planner's PyTorch layouts are transformers' own: every preset, built with transformers'
own config and model classes at tiny dimensions (its layer pattern kept), runs through
``DynamicCache(config=...)`` and a few forwards; each layer's cache class and bytes are compared
with what the planner puts on it. Then the full-size targets: Gemma-2-9B keeps its sliding
layers on torch."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache  # noqa: E402
from transformers import cache_utils as T  # noqa: E402

from cachelib.plan import account, arch_from_config, cache_layout, preset, preset_names, trace  # noqa: E402
from cachelib.plan.runtimes import Deployment  # noqa: E402

UPDATES = [20, 1, 1, 7, 1]

# the same tiny sizes as the MLX reference (tests/plan/test_plan_runtime_mlx_layouts.py)
_SHRINK = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    vocab_size=64,
    head_dim=16,
    kv_lora_rank=32,
    q_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=4,
    num_experts=4,
    num_experts_per_tok=2,
    mamba_d_state=4,
    mamba_dt_rank=8,
    state_size=4,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    expand=2,
)


def _shrunk(config):
    small = dict(config)
    heads = config.get("num_attention_heads")
    if heads:
        kv = config.get("num_key_value_heads", heads)
        small["num_attention_heads"] = 4
        small["num_key_value_heads"] = 4 if kv == heads else 2
    for k, v in _SHRINK.items():
        if k in small or (k == "head_dim" and "num_attention_heads" in small):
            small[k] = v
    if small.get("sliding_window"):
        small["sliding_window"] = 8
    if small["model_type"] == "jamba":
        small |= {"num_experts": 4, "mamba_expand": 2}
    if small["model_type"] == "mamba":
        small |= {"intermediate_size": 128, "time_step_rank": 8}
    if small["model_type"] == "deepseek_v3":
        small |= {"n_group": 1, "topk_group": 1}
    small.pop("torch_dtype", None)
    return small


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_tensor_bytes(x) for x in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(x) for x in obj)
    return 0


def _layer_bytes(layer) -> int:
    if isinstance(layer, T.LinearAttentionLayer):
        return _tensor_bytes(layer.conv_states) + _tensor_bytes(layer.recurrent_states)
    return _tensor_bytes(getattr(layer, "keys", None)) + _tensor_bytes(getattr(layer, "values", None))


def _reference(config):
    """Per-layer (class, bytes) of transformers' own DynamicCache after each forward."""
    model = AutoModelForCausalLM.from_config(config).eval()
    cache = DynamicCache(config=config)
    out = []
    with torch.inference_mode():
        for n in UPDATES:
            model(input_ids=torch.full((1, n), 3), cache=cache, use_cache=True)
            out.append([(type(layer).__name__, _layer_bytes(layer)) for layer in cache.layers])
    return out


def _planned(arch):
    layout = cache_layout(arch, "concat", "torch")
    steps = trace(arch, "concat", "torch", updates=UPDATES, dtype="float32").steps
    return [[(lc.kind, b) for lc, b in zip(layout, s.layer_bytes)] for s in steps]


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_at_tiny_size_is_planned_layer_by_layer_as_transformers_builds_it(name):
    small = _shrunk(dict(preset(name).config))
    config = AutoConfig.for_model(small["model_type"], **{k: v for k, v in small.items() if k != "model_type"})
    arch = arch_from_config(small, name=name)
    assert arch.num_layers == preset(name).num_layers
    assert _planned(arch) == _reference(config)


def test_gemma2_9b_on_torch_keeps_its_sliding_layers():
    g = preset("gemma-2-9b")
    fields = {k: v for k, v in g.config.items() if k not in ("model_type", "torch_dtype")}
    config = AutoConfig.for_model("gemma2", **fields)
    reference = [type(layer).__name__ for layer in DynamicCache(config=config).layers]
    assert reference.count("DynamicSlidingWindowLayer") == 21
    assert [c.kind for c in cache_layout(g, "concat", "torch")] == reference
    acc = account(g, "concat", context=8192, deployment=Deployment.make("transformers"))
    # transformers' sliding layer keeps window - 1 tokens after the prompt
    per_token = 8 * 256 * 2 * 2
    assert acc.bytes_allocated == 21 * 8192 * per_token + 21 * 4095 * per_token
    mlx = account(g, "standard", context=8192, deployment=Deployment.make("mlx-lm"))
    assert mlx.bytes_allocated == 42 * 8192 * per_token


# ---------------------------------------------------------------------------------------------
# every causal-LM model type transformers builds from a small config

_SMALL = dict(
    hidden_size=64,
    num_hidden_layers=4,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,
    vocab_size=64,
    n_embd=64,
    n_layer=4,
    n_head=4,
    num_layers=4,
    d_model=64,
    ffn_dim=128,
    n_inner=128,
    max_position_embeddings=512,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    sliding_window=8,
    kv_lora_rank=32,
    q_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
)
_MAX_PARAMS = 3_000_000  # a default the generic shrink misses (a wide vocab, many experts): skipped


def _small_transformers_config(model_type):
    """transformers' default config for ``model_type`` with the sizes above; None when the small
    config cannot be built or would still be big."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            base = AutoConfig.for_model(model_type)
            text = base.get_text_config(decoder=True)
            fields = text.to_dict()
            small = {k: v for k, v in _SMALL.items() if k in fields}
            if fields.get("layer_types"):
                layers = small.get("num_hidden_layers", len(fields["layer_types"]))
                small["layer_types"] = fields["layer_types"][:layers]
            drop = ("model_type", "transformers_version", "architectures")
            kept = {k: v for k, v in fields.items() if k not in drop}
            config = AutoConfig.for_model(text.model_type, **(kept | small))
            with torch.device("meta"):
                params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    except Exception:  # noqa: BLE001 - transformers' own refusal of the made-up config
        return None
    return config if params <= _MAX_PARAMS else None


@pytest.mark.slow
def test_every_transformers_causal_lm_built_small_is_planned_as_it_builds_its_cache_or_refused_by_name():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    matched, refused, unbuilt, wrong = [], [], [], []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        config = _small_transformers_config(model_type)
        try:
            reference = None if config is None else _reference(config)
        except Exception:  # noqa: BLE001 - built, but its forward refuses the made-up sizes
            reference = None
        if reference is None:
            unbuilt.append(model_type)
            continue
        try:
            planned = _planned(arch_from_config(config.to_dict(), name=model_type))
        except ValueError as e:
            assert model_type in str(e), (model_type, str(e))
            refused.append(model_type)
            continue
        (matched if planned == reference else wrong).append(model_type)
    assert not wrong, f"planned differently from transformers: {wrong}"
    assert {
        "llama",
        "mistral",
        "gemma2",
        "gemma3_text",
        "qwen2",
        "qwen3",
        "deepseek_v3",
        "mamba",
        "mixtral",
        "starcoder2",
        "olmo2",
        "cohere2",
        "gpt_oss",
    } <= set(matched)
    assert len(matched) >= 90, (len(matched), refused)
    print(f"{len(matched)} planned as transformers builds them, {len(refused)} refused, {len(unbuilt)} not built")
