"""The capacity planner: exact KV-cache bytes for any model and strategy, and what fits in a
memory budget.

- :mod:`~cachelib.plan.arch`: the architecture record, read from any Hugging Face config.json.
- :mod:`~cachelib.plan.presets`: published architectures (Llama-3.1, Qwen2.5/3, Mistral,
  Gemma-2/3, DeepSeek-V3, Jamba), the bundled SmolLM2 and the toy presets.
- :mod:`~cachelib.core.rules`: each cache class's allocation rules, replayed on integers.
- :mod:`~cachelib.plan.accounting`: which cache each layer gets, step traces, final accounts.
- :mod:`~cachelib.plan.layouts` and :mod:`~cachelib.plan.runtimes`: which layers slide as each
  runtime builds its cache; runtimes' defaults (mlx-lm, transformers, vLLM, llama.cpp) and one
  device's share of a tensor- / pipeline-parallel :class:`Deployment`.
- :mod:`~cachelib.plan.device`: the whole device's memory: weights at their precision and share,
  the activation peak, the runtime's overhead.
- :mod:`~cachelib.plan.solver`: max context / batch / sessions in a budget, and the reverse.
- :mod:`~cachelib.plan.quality`: the quality price of evidence handed to it, and the recommendation
  (:mod:`cachelib.profile.evidence` reads that evidence from profiles).
- :mod:`~cachelib.plan.request`: :class:`PlanRequest`, one planning request as the CLI and the app
  make it, and what answers it (:func:`plan`, :func:`plan_request`).
- :mod:`~cachelib.plan.curves`: memory and fit frontier over a grid of contexts, for charts.
- ``python -m cachelib plan`` lives in :mod:`cachelib.cli.plan`, above the profile reader it uses.
"""

from ..core.layout import LayerLayout
from ..core.units import GB, GiB  # re-exported for callers writing sizes
from .accounting import Account, LayerAccount, StepBytes, Trace, Update, account, schedule, trace
from .arch import Arch, Latent, Recurrent, arch_from_config, arch_from_model_info, count_params, load_config
from .curves import chart_range, context_grid, frontier_curves, memory_curves
from .device import (
    Activations,
    DeviceMemory,
    WeightsFormat,
    activation_peak,
    published_weights,
    run_activation_peak,
    weights_format,
    weights_per_device,
)
from .layer_caches import cache_layout
from .presets import preset, preset_names, resolve_model
from .request import PlanRequest, PlanResult, memory_bytes, plan, plan_request
from .runtimes import RUNTIMES, Deployment, runtime_names
from .slot_bytes import kv_bytes_per_token, quantized_storage_ratio, recurrent_state_bytes, token_bytes
from .solver import (
    NO_LIMIT,
    Fit,
    Quality,
    attach_quality,
    budget_needed,
    cache_budget,
    max_batch,
    max_context,
    max_sessions,
    weight_bytes,
)

__all__ = [
    "RUNTIMES",
    "Deployment",
    "runtime_names",
    "Activations",
    "DeviceMemory",
    "WeightsFormat",
    "activation_peak",
    "published_weights",
    "run_activation_peak",
    "weights_format",
    "weights_per_device",
    "Account",
    "Arch",
    "Fit",
    "GB",
    "GiB",
    "LayerAccount",
    "LayerLayout",
    "Latent",
    "NO_LIMIT",
    "PlanRequest",
    "PlanResult",
    "Quality",
    "Recurrent",
    "StepBytes",
    "Trace",
    "Update",
    "account",
    "arch_from_config",
    "arch_from_model_info",
    "attach_quality",
    "budget_needed",
    "cache_budget",
    "cache_layout",
    "chart_range",
    "context_grid",
    "count_params",
    "frontier_curves",
    "memory_bytes",
    "kv_bytes_per_token",
    "load_config",
    "max_batch",
    "max_context",
    "max_sessions",
    "memory_curves",
    "plan",
    "plan_request",
    "preset",
    "preset_names",
    "quantized_storage_ratio",
    "recurrent_state_bytes",
    "resolve_model",
    "schedule",
    "token_bytes",
    "trace",
    "weight_bytes",
]
