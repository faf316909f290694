"""The capacity planner: exact KV-cache bytes for any model and strategy, and what fits in a
memory budget.

- :mod:`~cachelib.plan.arch`: the architecture record, read from any Hugging Face config.json.
- :mod:`~cachelib.plan.presets`: published architectures (Llama-3.1, Qwen2.5/3, Mistral,
  Gemma-2/3, DeepSeek-V3, Jamba), the bundled SmolLM2 and the toy presets.
- :mod:`~cachelib.core.rules`: each cache class's allocation rules, replayed on integers.
- :mod:`~cachelib.plan.accounting`: which cache each layer gets, step traces, final accounts.
- :mod:`~cachelib.plan.solver`: max context / batch / sessions in a budget, and the reverse.
- :mod:`~cachelib.plan.quality`: the measured quality price and the recommendation.
- :mod:`~cachelib.plan.request`: one planning request as the CLI and the app make it.
- :mod:`~cachelib.plan.cli`: ``python -m cachelib plan``.
"""

from .accounting import (
    Account,
    LayerAccount,
    LayerCache,
    StepBytes,
    Trace,
    Update,
    account,
    cache_layout,
    kv_bytes_per_token,
    quantized_storage_ratio,
    recurrent_state_bytes,
    schedule,
    token_bytes,
    trace,
)
from .arch import Arch, Latent, Recurrent, arch_from_config, arch_from_model_info, count_params, load_config
from .presets import preset, preset_names, resolve_model
from .request import PlanResult, gb_to_bytes, plan_request
from .solver import (
    GB,
    NO_LIMIT,
    Fit,
    Quality,
    attach_quality,
    budget_needed,
    cache_budget,
    max_batch,
    max_context,
    max_sessions,
    plan,
    weight_bytes,
)

__all__ = [
    "Account", "Arch", "Fit", "GB", "LayerAccount", "LayerCache", "Latent", "NO_LIMIT", "Quality", "Recurrent",
    "StepBytes", "Trace", "Update", "account", "arch_from_config", "arch_from_model_info", "attach_quality",
    "budget_needed", "cache_budget", "cache_layout", "count_params", "kv_bytes_per_token", "load_config",
    "max_batch", "max_context", "max_sessions", "plan", "PlanResult", "gb_to_bytes", "plan_request", "preset", "preset_names", "quantized_storage_ratio",
    "recurrent_state_bytes", "resolve_model", "schedule", "token_bytes", "trace", "weight_bytes",
]  # fmt: skip
