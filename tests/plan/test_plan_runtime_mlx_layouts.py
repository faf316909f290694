"""The planner's MLX layouts are mlx-lm's own: every preset, and every model type mlx-lm 0.32.2
can build from a small config, is built with mlx-lm's own model class at tiny dimensions (its
layer pattern kept), run through ``make_prompt_cache`` and a few forwards, and each layer's cache
class and ``nbytes`` is compared with what the planner puts on it. Then the full-size targets,
with mlx-lm's ``KVCache`` as the reference."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import mlx.core as mx
import pytest

mlx_lm = pytest.importorskip("mlx_lm")
from mlx_lm import utils as mlx_utils  # noqa: E402
from mlx_lm.models import cache as C  # noqa: E402

from cachelib.plan import account, arch_from_config, cache_layout, preset, preset_names, trace  # noqa: E402
from cachelib.plan.layouts import MLX_MODELLED, MLX_OWN_MAKE_CACHE, MLX_REMAPPING, mlx_module  # noqa: E402
from cachelib.plan.runtimes import Deployment  # noqa: E402

UPDATES = [20, 1, 1, 7, 1]  # a prompt past the 8-token windows below, decode, a second prompt

_NOT_MODELS = {"base", "cache", "switch_layers", "rope_utils", "activations", "ssm", "pipeline", "bitlinear_layers"}
_MODULES = sorted(
    m.name for m in pkgutil.iter_modules(importlib.import_module("mlx_lm.models").__path__) if m.name not in _NOT_MODELS
)


def _reference(model, sizes):
    """Per-layer (class, nbytes) of mlx-lm's own cache after each forward."""
    cache = C.make_prompt_cache(model)
    out = []
    for n in sizes:
        model(mx.array([[1] * n]), cache=cache)
        out.append([(type(c).__name__, c.nbytes) for c in cache])
    return out


def _planned(arch, sizes):
    layout = cache_layout(arch, "standard", "mlx")
    steps = trace(arch, "standard", "mlx", updates=sizes, dtype="float32").steps
    return [[(lc.kind, b) for lc, b in zip(layout, s.layer_bytes)] for s in steps]


# ---------------------------------------------------------------------------------------------
# the tables read from mlx-lm's code, against the installed mlx-lm


def test_mlx_lm_is_the_version_the_tables_were_read_from():
    assert mlx_lm.__version__ == "0.32.2"


def test_remapping_and_make_cache_tables_equal_the_installed_mlx_lm():
    assert MLX_REMAPPING == mlx_utils.MODEL_REMAPPING
    own = set()
    for name in _MODULES:
        try:
            mod = importlib.import_module(f"mlx_lm.models.{name}")
        except BaseException:  # noqa: BLE001 - a module that needs an extra package to import
            source = importlib.util.find_spec(f"mlx_lm.models.{name}").origin
            if "def make_cache" in open(source).read():
                own.add(name)
            continue
        if hasattr(getattr(mod, "Model", None), "make_cache"):
            own.add(name)
    assert own == MLX_OWN_MAKE_CACHE
    assert set(MLX_MODELLED) <= MLX_OWN_MAKE_CACHE


# ---------------------------------------------------------------------------------------------
# every model type mlx-lm builds from a small config

SMALL = dict(
    hidden_size=64,
    num_hidden_layers=4,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,
    vocab_size=64,
    rms_norm_eps=1e-5,
    layer_norm_eps=1e-5,
    norm_eps=1e-5,
    max_position_embeddings=256,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
    num_experts=4,
    num_experts_per_tok=2,
    n_routed_experts=4,
    num_local_experts=4,
    moe_intermediate_size=32,
    sliding_window=8,
)


def _guess(field):
    """A small value for a required ModelArgs field the table above does not name."""
    name, kind = field.name, str(field.type)
    if "bool" in kind:
        return False
    if "float" in kind:
        return 1e-5 if "eps" in name else 1.0
    if "int" in kind:
        for part, value in (("layer", 4), ("tok", 2), ("expert", 4), ("window", 8)):
            if part in name:
                return value
        return 4 if "head" in name and "dim" not in name else 16
    if "str" in kind:
        return "silu" if "act" in name else "default"
    return None


def _build_small(name):
    """mlx-lm's model ``name`` at tiny sizes, and the config it was built from (every field its
    ModelArgs resolved, as a config.json would carry them); None when it cannot be built so."""
    try:
        mod = importlib.import_module(f"mlx_lm.models.{name}")
        config = {"model_type": name}
        for f in dataclasses.fields(mod.ModelArgs):
            if f.name in SMALL:
                config[f.name] = SMALL[f.name]
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                if (g := _guess(f)) is not None:
                    config[f.name] = g
        args = mod.ModelArgs.from_dict(config)
        model = mod.Model(args)
        ref = _reference(model, UPDATES)
    except BaseException as e:  # noqa: BLE001 - mlx-lm's own refusal of a made-up small config
        return None, f"{type(e).__name__}: {e}"
    plain = (int, float, str, bool, type(None))
    resolved = {
        k: v
        for k, v in vars(args).items()
        if isinstance(v, plain) or (isinstance(v, (list, tuple)) and all(isinstance(x, plain) for x in v))
    }
    return (resolved | {"model_type": name}, ref), None


def test_every_mlx_lm_model_type_built_small_is_planned_as_mlx_lm_builds_it_or_refused_by_name():
    matched, refused, unbuilt, wrong = [], [], [], []
    for name in _MODULES:
        built, why = _build_small(name)
        if built is None:
            unbuilt.append(name)
            continue
        config, ref = built
        try:
            arch = arch_from_config(config, name=name)
            planned = _planned(arch, UPDATES)
        except ValueError as e:
            assert name in str(e), (name, str(e))  # the refusal names the model
            refused.append(name)
            continue
        (matched if planned == ref else wrong).append(name)
    assert not wrong, f"planned differently from mlx-lm: {wrong}"
    # the families users run are among those compared, not refused
    assert {"llama", "gemma", "gemma2", "qwen2", "phi3", "mixtral", "starcoder2", "deepseek_v3"} <= set(matched)
    assert len(matched) >= 48, (matched, refused, unbuilt)


def test_model_types_with_their_own_unmodelled_make_cache_are_refused_by_name():
    arch = arch_from_config(
        {"model_type": "exaone4", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}, name="c"
    )
    with pytest.raises(ValueError, match="exaone4.*make_cache"):
        cache_layout(arch, "standard", "mlx")
    # transformers' layout is still planned on torch
    assert len(cache_layout(arch, "concat", "torch")) == 2


# ---------------------------------------------------------------------------------------------
# every preset, at tiny sizes with its own layer pattern

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
        if k in small or k in ("head_dim",) and "num_attention_heads" in small:
            small[k] = v
    if small.get("sliding_window"):
        small["sliding_window"] = 8
    if small["model_type"] == "jamba":
        small |= {"num_experts": 4, "mamba_expand": 2}
    if small["model_type"] == "mamba":
        small |= {"intermediate_size": 128, "time_step_rank": 8}
    if small["model_type"] == "deepseek_v3":
        small |= {"num_key_value_heads": 4, "routed_scaling_factor": 1.0, "rms_norm_eps": 1e-6}
    small.setdefault("rms_norm_eps", 1e-6)
    small.setdefault("rope_theta", 10000.0)
    return small


def _mlx_model(config):
    model_type = config["model_type"]
    module = importlib.import_module(f"mlx_lm.models.{mlx_module(model_type)}")
    return module.Model(module.ModelArgs.from_dict(config))


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_at_tiny_size_is_planned_layer_by_layer_as_mlx_lm_builds_it(name):
    config = _shrunk(dict(preset(name).config))
    arch = arch_from_config(config, name=name)
    assert arch.num_layers == preset(name).num_layers
    assert _planned(arch, UPDATES) == _reference(_mlx_model(config), UPDATES)


# ---------------------------------------------------------------------------------------------
# the targets, full size


def _kvcache_nbytes(heads, head_dim, chunks, dtype=mx.float16):
    cache = C.KVCache()
    for n in chunks:
        k = mx.zeros((1, heads, n, head_dim), dtype=dtype)
        cache.update_and_fetch(k, k)
    return cache.nbytes


def test_gemma2_9b_on_mlx_holds_every_layer_in_full_as_mlx_lm_does():
    g = preset("gemma-2-9b")
    assert g.layer_kinds.count("sliding") == 21  # transformers' convention, kept for torch
    layout = cache_layout(g, "standard", "mlx")
    assert {c.kind for c in layout} == {"KVCache"} and len(layout) == 42
    # mlx-lm: gemma2 has no make_cache, so make_prompt_cache puts a KVCache on each layer
    tiny = _mlx_model(_shrunk(dict(g.config)))
    assert [type(c).__name__ for c in C.make_prompt_cache(tiny)] == ["KVCache"] * 42
    reference = 42 * _kvcache_nbytes(8, 256, [2048] * 4)
    planned = account(g, "standard", "mlx", context=8192, prefill_chunk=2048).bytes_allocated
    assert planned == reference == 2_818_572_288
    # the mlx-lm runtime profile prefills in its 2048-token steps by default
    assert account(g, "standard", context=8192, deployment=Deployment.make("mlx-lm")).bytes_allocated == planned


def test_a_mistral_config_with_sliding_window_is_all_full_attention_on_mlx():
    config = {
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "sliding_window": 4096,
        "vocab_size": 32000,
        "rms_norm_eps": 1e-5,
    }
    arch = arch_from_config(config, name="mistral-v0.1")
    assert arch.layer_kinds == ("sliding",) * 32  # transformers slides every layer
    assert {c.layer_type for c in cache_layout(arch, "standard", "mlx")} == {"full"}
    assert mlx_utils.MODEL_REMAPPING["mistral"] == "llama"
    tiny = _mlx_model(_shrunk(config))
    assert {type(c).__name__ for c in C.make_prompt_cache(tiny)} == {"KVCache"}
    planned = account(arch, "standard", "mlx", context=32768, prefill_chunk=2048).bytes_allocated
    assert planned == 32 * _kvcache_nbytes(8, 128, [2048] * 16) == 4_294_967_296


# ---------------------------------------------------------------------------------------------
# mlx-lm's cache flags


def test_mlx_lm_flags_are_the_specs_mlx_lm_builds():
    from mlx_lm.generate import maybe_quantize_kv_cache

    from cachelib.plan.runtimes import mlx_lm_spec

    qwen = _mlx_model(_shrunk(dict(preset("qwen2.5-7b").config)))  # qwen2: no make_cache of its own
    ring = C.make_prompt_cache(qwen, max_kv_size=64)[0]
    assert (type(ring).__name__, ring.max_size, ring.keep) == ("RotatingKVCache", 64, 4)
    assert mlx_lm_spec("qwen2", max_kv_size=64) == "rotating:max_size=64,keep=4"
    # llama's own make_cache ignores max_kv_size
    llama = _mlx_model(_shrunk(dict(preset("tiny-llama").config)))
    assert type(C.make_prompt_cache(llama, max_kv_size=64)[0]).__name__ == "KVCache"
    with pytest.raises(ValueError, match="ignores --max-kv-size for model_type 'llama'"):
        mlx_lm_spec("llama", max_kv_size=64)
    # --kv-bits: mlx-lm converts after each step once the offset reaches the start
    arch = arch_from_config(
        {
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": 128,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 64,
        },
        name="q",
    )
    sizes = [300, 1, 1, 250, 1, 1]
    spec = mlx_lm_spec(kv_bits=4, quantized_kv_start=500)
    caches, ref = [C.KVCache()], []
    for n in sizes:
        k = mx.zeros((1, 2, n, 64), dtype=mx.float16)
        caches[0].update_and_fetch(k, k)
        ref.append(caches[0].nbytes)
        maybe_quantize_kv_cache(caches, 500, 64, 4)
    ours = [s.bytes_allocated for s in trace(arch, spec, "mlx", updates=sizes).steps]
    # cachelib converts at the start of the next update; mlx-lm right after this one
    assert ours[:4] == ref[:4] and ours[4:] == [caches[0].nbytes] * 2
    with pytest.raises(ValueError, match="cannot combine --max-kv-size with --kv-bits"):
        mlx_lm_spec(max_kv_size=64, kv_bits=4)
