"""Which layers of a model slide, recur or attend in full, as each runtime builds its cache.

The layer kinds of :class:`~cachelib.plan.arch.Arch` follow transformers' conventions (its
``layer_types``, the window of a ``sliding_window`` config, gemma-2/3 patterns), which is what
``DynamicCache(config=...)`` builds. Other runtimes build their caches by their own rules, from
the same ``config.json``; this module says what each of them builds, read from its code:

- mlx-lm 0.32.2 (``mlx_lm.models.cache.make_prompt_cache``): a model class with its own
  ``make_cache`` decides; one without gets a plain ``KVCache`` on every layer, whatever its
  config says of windows (``gemma2`` has none, so all 42 layers of Gemma-2-9B are full; its
  ``utils.MODEL_REMAPPING`` maps ``mistral`` to ``llama``, whose ``make_cache`` slides only the
  layers ``layer_types`` names, so a Mistral-v0.1 ``sliding_window`` is ignored).
- llama.cpp (``src/llama-model.cpp``, ``load_hparams``): sliding-window layers only for the
  architectures that set a SWA pattern (gemma2: every other layer; gemma3: 5 in 6); every
  other layer is full.
- vLLM and transformers build from transformers' config classes: the :class:`Arch` kinds.

Nothing here imports a runtime; ``tests/plan/test_plan_runtime_layouts.py`` checks these rules
against mlx-lm's and transformers' own objects for every model type they can build.
"""

from __future__ import annotations

from typing import Mapping

MLX_LM_VERSION = "0.32.2"

# mlx_lm/utils.py MODEL_REMAPPING (0.32.2): config model_type -> the module mlx-lm loads
MLX_REMAPPING = {
    "mistral": "llama", "llava": "mistral3", "phi-msft": "phixtral", "falcon_mamba": "mamba",
    "joyai_llm_flash": "deepseek_v3", "kimi_k2": "deepseek_v3", "qwen2_5_vl": "qwen2_vl",
    "minimax_m2": "minimax", "iquestcoder": "llama", "xverse": "llama", "gemma4_unified": "gemma4",
    "deepseek_v41_text": "deepseek_v41",
}  # fmt: skip

# mlx_lm/models/*.py (0.32.2) whose Model class has a make_cache (its own or inherited): they
# choose each layer's cache
MLX_OWN_MAKE_CACHE = frozenset("""
afm7 afmoe baichuan_m1 bailing_hybrid bailing_moe_linear bailing_moe_v3 cohere2 deepseek_v32 deepseek_v41
exaone4 exaone_moe falcon_h1 gear gemma3 gemma3_text gemma3n gemma4 gemma4_text glm_moe_dsa gpt_oss
granitemoehybrid prism_hadamard_qwen35 qwen3_5_moe
iquestloopcoder jamba kimi_k3 kimi_linear laguna lfm2-vl lfm2 lfm2_moe llama llama4 longcat_flash
longcat_flash_ngram mamba mamba2 mellum mimo_v2_flash minimax_m3_vl ministral3 muse_glimmer muse_spark
nanbeige nemotron-nas nemotron_h olmo3 olmo_hybrid plamo2 plamo3 qwen3_5 qwen3_next recurrent_gemma rwkv7
spark2_5 step3p5
""".split())

# the make_cache methods the planner models (each one's rule is in _mlx_own_kinds)
MLX_MODELLED = ("llama", "gemma3_text", "gemma3", "jamba", "mamba", "cohere2", "gpt_oss", "olmo3")

# mlx-lm's ModelArgs defaults where a config omits the window (cohere2.py, gpt_oss.py; olmo3 requires it)
_MLX_WINDOW = {"cohere2": 4096, "gpt_oss": 128}

# latent-attention configs whose mlx-lm attention caches decompressed per-head keys and values
# (``cache.update_and_fetch(keys, values)`` after ``kv_b_proj``) instead of the latent
# (deepseek_v3 and glm4_moe_lite cache ``kv_latent, k_pe``): not modelled
MLX_MLA_PER_HEAD = frozenset({"deepseek_v2", "youtu_llm", "minicpm3"})

# mlx-lm's default window where a gemma3 config omits it (gemma3_text.ModelArgs.sliding_window)
_MLX_GEMMA3_WINDOW = 512

# llama.cpp's SWA patterns (src/llama-model.cpp, load_hparams: hparams.set_swa_pattern(n) means
# every n-th layer is full, the others slide; n_swa is the GGUF's sliding_window)
LLAMA_CPP_SWA_PATTERN = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6}


def mlx_module(model_type: str) -> str:
    """The mlx-lm module a config's ``model_type`` loads (after ``MODEL_REMAPPING``)."""
    return MLX_REMAPPING.get(model_type, model_type)


def mlx_layer_kinds(
    text: Mapping, model_type: str, layers: int, window: int | None, where: str
) -> tuple[tuple[str, ...], int | None]:
    """The layer kinds and window mlx-lm 0.32.2 builds for a config (``text``: the text config).

    Raises ``ValueError`` for a model whose own ``make_cache`` the planner does not model."""
    module = mlx_module(model_type)
    if module in MLX_MLA_PER_HEAD and text.get("kv_lora_rank") is not None:
        raise ValueError(
            f"{where}: mlx-lm {MLX_LM_VERSION}'s {module!r} attention caches per-head keys and values, "
            "not the latent the planner sizes; not modelled on MLX"
        )
    if module not in MLX_OWN_MAKE_CACHE:
        # make_prompt_cache: KVCache() on every layer (RotatingKVCache under --max-kv-size, which
        # is the rotating strategy)
        return ("full",) * layers, None
    if module not in MLX_MODELLED:
        raise ValueError(
            f"{where}: mlx-lm {MLX_LM_VERSION}'s {module!r} model builds its own cache layout (make_cache), "
            f"which the planner does not model; modelled: {', '.join(MLX_MODELLED)} and every model type "
            "without its own make_cache"
        )
    if module == "llama":  # llama.Model.make_cache: RotatingKVCache on layer_types' sliding layers
        types = list(text.get("layer_types") or ["full_attention"] * layers)[:layers]
        kinds = tuple("sliding" if t == "sliding_attention" else "full" for t in types)
        return kinds, (window if "sliding" in kinds else None)
    if module in ("gemma3_text", "gemma3"):  # i % pattern == pattern - 1: KVCache, else a ring
        pattern = int(text.get("sliding_window_pattern", 6))
        kinds = tuple("full" if i % pattern == pattern - 1 else "sliding" for i in range(layers))
        w = text.get("sliding_window") or _MLX_GEMMA3_WINDOW
        return kinds, (int(w) if "sliding" in kinds else None)
    if module == "jamba":  # is_attn layers: KVCache, the others ArraysCache(2)
        block = text.get("layers_block_type")
        if block:
            kinds = tuple("full" if b == "attention" else "recurrent" for b in block[:layers])
        else:
            period, offset = int(text.get("attn_layer_period", 8)), int(text.get("attn_layer_offset", 4))
            kinds = tuple("full" if i % period == offset else "recurrent" for i in range(layers))
        return kinds, None
    if module == "cohere2":  # i % pattern == pattern - 1: KVCache, else RotatingKVCache(window, keep=0)
        pattern = int(text.get("sliding_window_pattern", 4))
        kinds = tuple("full" if i % pattern == pattern - 1 else "sliding" for i in range(layers))
        return kinds, (int(text.get("sliding_window") or _MLX_WINDOW["cohere2"]) if "sliding" in kinds else None)
    if module in ("gpt_oss", "olmo3"):  # layer_types (or its default): full -> KVCache, else a ring of the window
        if module == "gpt_oss":
            default = ["sliding_attention", "full_attention"] * (layers // 2)
        else:
            default = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)]
        types = list(text.get("layer_types") or default)[:layers]
        kinds = tuple("full" if t == "full_attention" else "sliding" for t in types)
        w = text.get("sliding_window") or _MLX_WINDOW.get(module)
        if "sliding" in kinds and not w:
            raise ValueError(f"{where}: mlx-lm's {module} needs a sliding_window in the config")
        return kinds, (int(w) if "sliding" in kinds else None)
    return ("recurrent",) * layers, None  # mamba: ArraysCache(2) on every layer


def llama_cpp_layer_kinds(model_type: str, layers: int, window: int | None) -> tuple[tuple[str, ...], int | None]:
    """The layer kinds llama.cpp gives a model: SWA layers only where its architecture sets a
    pattern, every other attention layer full."""
    pattern = LLAMA_CPP_SWA_PATTERN.get(model_type)
    if pattern is None or not window:
        return ("full",) * layers, None
    return tuple("full" if i % pattern == pattern - 1 else "sliding" for i in range(layers)), window
