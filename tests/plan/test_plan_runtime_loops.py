"""The runtime's own loop is the reference. mlx-lm's ``generate_step`` never computes a prefill
chunk's logits and feeds the prompt's last token alone; transformers' ``generate()`` builds its
own ``DynamicCache`` (or a ``StaticCache`` when asked); cachelib's profiler loop is one more
runtime, named as such; a plan that names no runtime uses the backend's deployed one. Config
files without ``layer_types`` are read as transformers' config classes read them.

The bundled-model cases are pinned against mlx-lm's own ``generate_step`` peak
(``bench/bench_runtime_peak.py`` prints the whole grid)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cachelib.plan import PlanRequest, account, arch_from_config, plan, preset
from cachelib.plan.accounting import schedule
from cachelib.plan.device import activation_peak, phase_activations
from cachelib.plan.request import solve_sessions
from cachelib.plan.runtimes import Deployment, mlx_lm_spec

ROOT = Path(__file__).resolve().parents[2]
TINY = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 1000,
}


def test_mlx_lm_computes_no_logits_in_a_prefill_chunk_and_one_position_per_step():
    arch = arch_from_config(TINY, name="tiny")
    kw = dict(seen=300, dtype="float32", backend="mlx", device="cpu")
    assert activation_peak(arch, tokens=300, runtime="mlx-lm", **kw).logits == 0  # state evaluated only
    assert activation_peak(arch, tokens=1, runtime="mlx-lm", **kw).logits == 2 * 1000 * 4  # logits + logprobs
    assert activation_peak(arch, tokens=300, runtime="cachelib", **kw).logits == 300 * 1000 * 4  # every position
    assert activation_peak(arch, tokens=300, runtime="transformers", **kw).logits == 1000 * 4  # last, float32


def test_mlx_lm_feeds_the_prompts_last_token_alone():
    # generate_step prefills while more than one prompt token is left: 1,024 in steps of 1,024 is 1,023 + 1
    assert [(u.tokens, u.repeat) for u in schedule(1028, 1024, 1024, last_alone=True)] == [(1023, 1), (1, 1), (1, 4)]
    assert [(u.tokens, u.repeat) for u in schedule(3000, 3000, 1024, last_alone=True)] == [(1024, 2), (951, 1), (1, 1)]
    arch = arch_from_config(TINY, name="tiny")
    pre, _ = phase_activations(arch, "standard", context=1028, prefill=1024, prefill_chunk=1024, runtime="mlx-lm")
    assert (pre.tokens, pre.logits) == (1023, 0)
    own, _ = phase_activations(arch, "standard", context=1028, prefill=1024, prefill_chunk=1024, runtime="cachelib")
    assert (own.tokens, own.logits) == (1024, 1024 * 1000 * 2)


def test_mlx_lm_quantizes_after_the_update_that_reaches_the_start():
    # maybe_quantize_kv_cache runs after each update: start 0 still writes the first update at full precision
    assert mlx_lm_spec(kv_bits=8, quantized_kv_start=0) == "quantized:bits=8,group_size=64,start=1"
    assert mlx_lm_spec(kv_bits=4) == "quantized:bits=4,group_size=64,start=5000"


def test_a_plan_without_a_runtime_plans_the_backends_deployed_runtime():
    assert PlanRequest(["standard"], context=10).runtime == "mlx-lm"
    assert PlanRequest(["standard"], context=10, backend="torch").runtime == "transformers"
    own = PlanRequest(["standard"], context=10, runtime="cachelib", backend="torch")
    assert (own.runtime, own.backend, own.chunk) == ("cachelib", "torch", None)
    assert PlanRequest(["standard"], context=10).chunk == 2048  # mlx-lm's prefill_step_size
    with pytest.raises(ValueError, match="unknown runtime 'mlx'; allowed: mlx-lm, transformers"):
        PlanRequest(["standard"], context=10, runtime="mlx")


def test_the_issues_question_gets_the_same_answer_without_a_runtime_and_says_which():
    arch = preset("llama-3.1-8b")
    kw = dict(context=8192, sessions=16, budget_bytes=24 * 2**30, solve="max_kv_size")
    none, named = (solve_sessions(arch, PlanRequest(["standard"], **kw, runtime=r)) for r in (None, "mlx-lm"))
    assert none == named and none.value is not None and none.sessions >= 16
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cachelib",
            "plan",
            "--model",
            "llama-3.1-8b",
            "--context",
            "8192",
            "--sessions",
            "16",
            "--budget",
            "24",
            "--solve",
            "max_kv_size",
            "--no-default-evidence",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout
    assert "runtime: mlx-lm, the default on backend mlx" in out and "loop planned: mlx-lm 0.32.2 generate_step" in out
    assert f"{none.value:,} is the largest max_kv_size" in out


def test_cachelibs_own_loop_counts_every_positions_logits_and_mlx_lm_does_not():
    arch = preset("smollm2")
    kw = dict(context=1028, prefill=1024, prefill_chunk=1024, dtype="float32", weights_bytes=0, device="cpu")
    own = plan(arch, PlanRequest(["standard"], runtime="cachelib", **kw))[0]
    mlx_lm = plan(arch, PlanRequest(["standard"], runtime="mlx-lm", **kw))[0]
    assert own.activation_bytes - mlx_lm.activation_bytes >= 1024 * arch.vocab_size * 4 * 0.9


# ---------------------------------------------------------------------------------------------
# configs as transformers reads them

transformers = pytest.importorskip("transformers")

DERIVED = {  # model_type -> extra fields of a tiny config without layer_types
    "qwen3_next": {"full_attention_interval": 3},
    "cohere2": {"sliding_window_pattern": 3, "sliding_window": 8},
    "gpt_oss": {"sliding_window": 8, "num_local_experts": 4, "num_experts_per_tok": 2},
    "olmo3": {"sliding_window": 8},
    "afmoe": {"global_attn_every_n_layers": 3, "sliding_window": 8},
    "cwm": {"sliding_window": 8},
    "mimo_v2_flash": {"sliding_window": 8},
    "granite_swa": {"sliding_window": 8},
    "gemma2": {"sliding_window": 8},
    "gemma3_text": {"sliding_window": 8},
}


@pytest.mark.parametrize("model_type", sorted(DERIVED))
def test_layer_kinds_of_a_config_without_layer_types_are_transformers_own(model_type):
    from transformers import AutoConfig

    fields = {**TINY, "num_hidden_layers": 7, **DERIVED[model_type]}
    fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    names = {"full_attention": "full", "sliding_attention": "sliding", "linear_attention": "recurrent"}
    expected = tuple(names[t] for t in config.layer_types)
    raw = {"model_type": model_type, **fields}
    if "recurrent" in expected:  # qwen3_next's gated delta-net state is refused, never planned as attention
        with pytest.raises(ValueError, match="recurrent layers of model_type 'qwen3_next' are not modelled"):
            arch_from_config(raw)
        return
    assert arch_from_config(raw).layer_kinds == expected


# ---------------------------------------------------------------------------------------------
# transformers' generate() and its own caches

torch = pytest.importorskip("torch")


def _cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            total += t.nbytes if isinstance(t, torch.Tensor) else 0
    return total


def _generate(config: dict, prompt: int, new: int, **options):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(config)
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, prompt))
    with torch.inference_mode():
        out = model.generate(
            ids,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            return_dict_in_generate=True,
            pad_token_id=0,
            **options,
        )
    return out.past_key_values


SLIDING = {
    "model_type": "gemma3_text",
    "num_hidden_layers": 6,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 1000,
    "sliding_window": 64,
}


@pytest.mark.parametrize("config", [TINY, SLIDING], ids=["llama", "gemma3-sliding"])
def test_transformers_standard_is_generates_own_dynamic_cache(config):
    prompt, new = 300, 4
    cache = _generate(config, prompt, new)
    assert type(cache).__name__ == "DynamicCache"
    arch = arch_from_config(config, name="tiny")
    planned = account(
        arch,
        "standard",
        context=prompt + new - 1,
        prefill=prompt,
        dtype="float32",
        deployment=Deployment.make("transformers"),
    )
    assert planned.bytes_allocated == _cache_bytes(cache)
    own = account(arch, "standard", "torch", context=prompt + new - 1, prefill=prompt, dtype="float32")
    assert own.bytes_allocated > planned.bytes_allocated  # cachelib's 256-token KVCache steps: not what runs


def test_transformers_static_cache_is_its_static_strategy():
    prompt, new = 40, 4
    cache = _generate(TINY, prompt, new, cache_implementation="static")
    assert type(cache).__name__ == "StaticCache"
    length = cache.layers[0].keys.shape[-2]  # generate sizes it to max_length
    arch = arch_from_config(TINY, name="tiny")
    planned = account(
        arch,
        f"static:max_len={length}",
        context=prompt + new - 1,
        prefill=prompt,
        dtype="float32",
        deployment=Deployment.make("transformers"),
    )
    assert planned.bytes_allocated == _cache_bytes(cache)


# ---------------------------------------------------------------------------------------------
# the bundled model against mlx-lm's own generate_step


@pytest.mark.slow
@pytest.mark.bundled
# one prefill chunk, and two (a full 1,024 and a partial one) before the last token alone; 3,000 x 2,048 and the
# rest of the grid are bench_runtime_peak's (it took 65 s of the suite)
@pytest.mark.parametrize("case", ["1024,1024,none", "1500,1024,none"])
def test_plan_is_within_5_percent_of_mlx_lms_own_generate_step(case):
    pytest.importorskip("mlx_lm")
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_runtime_peak import FLAGS, _case, planned

    prompt, step, flag = case.split(",")
    measured = _case(int(prompt), int(step), flag)  # a fresh interpreter: a clean peak
    fit, _ = planned(int(prompt), int(step), FLAGS[flag], measured["weights"])
    beyond = measured["peak"] - measured["weights"]
    assert abs(fit.budget_needed / measured["peak"] - 1) <= 0.05
    assert abs((fit.budget_needed - measured["weights"]) / beyond - 1) <= 0.10


def test_every_runtime_says_which_loop_it_plans():
    from cachelib.plan.runtimes import RUNTIMES

    for name, runtime in RUNTIMES.items():
        assert runtime.loop and "logits" in runtime.loop, name  # the plan prints it as "loop planned: ..."
