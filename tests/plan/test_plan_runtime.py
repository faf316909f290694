"""Runtimes as profiles of defaults, KV formats and parallelism: what one device of a deployment
holds, checked against the runtimes' own rules (llama.cpp's block sizes from the ``gguf``
package, vLLM's block bounds, mlx-lm's KVCache) and the published per-token figures."""

from __future__ import annotations

import pytest

from cachelib.core.rules import KV_FORMATS, format_bytes
from cachelib.plan import account, arch_from_config, cache_layout, kv_bytes_per_token, preset, token_bytes, trace
from cachelib.plan.accounting import replay
from cachelib.plan.runtimes import Deployment, device_arch, runtime_names, stage_sizes


def _arch(layers=4, heads=4, kv=2, head_dim=64, **extra):
    config = {
        "model_type": "llama",
        "num_hidden_layers": layers,
        "hidden_size": heads * head_dim,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        **extra,
    }
    return arch_from_config(config, name="t")


# ---------------------------------------------------------------------------------------------
# the API


def test_runtime_profiles_carry_their_defaults_and_imply_their_backend():
    assert runtime_names() == ["mlx-lm", "transformers", "vllm", "llama.cpp", "cachelib"]
    v = Deployment.make("vllm")
    assert (v.backend, v.block_size, v.gpu_memory_utilization, v.prefill_chunk) == ("torch", 16, 0.9, 2048)
    m = Deployment.make("mlx-lm")
    assert (m.backend, m.prefill_chunk, m.block_size) == ("mlx", 2048, None)
    assert Deployment.make("llama.cpp").backend == "ggml"
    assert Deployment.make("transformers").prefill_chunk is None  # the prompt in one forward
    assert Deployment.make(backend="torch") == Deployment(backend="torch")
    assert Deployment.make("vllm", tp=4, block_size=32).paged_block == 32


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(runtime="sglang"), "unknown runtime 'sglang'; allowed: mlx-lm, transformers, vllm, llama.cpp"),
        (dict(runtime="vllm", backend="mlx"), "runtime vllm runs on backend 'torch'"),
        (dict(backend="cuda"), "unknown backend 'cuda'; allowed: mlx, torch"),
        (dict(runtime="vllm", tp=0), "tp must be a positive integer"),
        (
            dict(runtime="mlx-lm", tp=2),
            "tp=2: mlx-lm is planned on one device here; tensor parallelism: transformers, vllm",
        ),
        (dict(runtime="transformers", pp=2), "pp=2: transformers .* pipeline parallelism: vllm, llama.cpp"),
        (
            dict(runtime="llama.cpp", kv_format="fp8"),
            "kv_format 'fp8' is not a format of llama.cpp; allowed: q8_0, q4_0",
        ),
        (dict(runtime="mlx-lm", kv_format="q8_0"), "not a format of mlx-lm; allowed: none"),
        (dict(runtime="llama.cpp", block_size=16), "does not allocate in blocks"),
        (dict(runtime="vllm", gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\]"),
    ],
)
def test_bad_deployments_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Deployment.make(**kwargs)


def test_strategies_do_not_apply_to_runtimes_that_allocate_their_own_cache():
    with pytest.raises(ValueError, match="runtime vllm allocates its own cache; strategy 'rotating'"):
        cache_layout(_arch(), "rotating:max_size=64", deployment=Deployment.make("vllm"))


# ---------------------------------------------------------------------------------------------
# KV formats


def test_fp8_kv_on_llama_3_1_8b_is_65536_bytes_per_token():
    arch = preset("llama-3.1-8b")
    assert kv_bytes_per_token(arch) == 131_072
    assert kv_bytes_per_token(arch, kv_format="fp8") == 65_536
    assert kv_bytes_per_token(arch, deployment=Deployment.make("vllm", kv_format="fp8")) == 65_536


def test_q8_0_and_q4_0_are_llama_cpp_block_sizes():
    gguf = pytest.importorskip("gguf")
    Q = gguf.GGMLQuantizationType
    for name, qtype in (("q8_0", Q.Q8_0), ("q4_0", Q.Q4_0)):
        per, size = gguf.GGML_QUANT_SIZES[qtype]
        assert KV_FORMATS[name] == (size, per)
        assert format_bytes(1024, name) == 1024 // per * size
    assert KV_FORMATS["q8_0"] == (34, 32) and KV_FORMATS["q4_0"] == (18, 32)
    arch = preset("llama-3.1-8b")  # a K row is 8 heads x 128 = 1024 elements, 32 blocks
    assert token_bytes(arch, kv_format="q8_0") == 2 * 32 * 34
    assert token_bytes(arch, kv_format="q4_0") == 2 * 32 * 18


def test_a_block_format_must_tile_the_rows():
    with pytest.raises(ValueError, match="not a whole number of 32-element blocks"):
        token_bytes(_arch(heads=1, kv=1, head_dim=48), kv_format="q8_0")


# ---------------------------------------------------------------------------------------------
# tensor and pipeline parallelism


def test_llama_3_1_70b_at_tp_8_holds_40960_bytes_per_token_per_gpu():
    arch = preset("llama-3.1-70b")
    d = Deployment.make("vllm", tp=8)
    assert device_arch(arch, d).num_kv_heads == 1
    assert kv_bytes_per_token(arch, deployment=d) == 40_960 == 80 * 1 * 128 * 2 * 2
    acc = account(arch, "standard", context=8192, deployment=d)
    assert acc.bytes_allocated == 8192 * 40_960  # 512 whole blocks of 16 tokens per layer
    assert acc.devices == 8 and acc.total_bytes == 8 * acc.bytes_allocated
    assert acc.total_bytes == account(arch, "standard", "torch", context=8192).bytes_allocated


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    arch = preset("llama-3.1-70b")
    d = Deployment.make("vllm", tp=16)
    assert kv_bytes_per_token(arch, deployment=d) == 40_960  # max(1, 8 // 16) = 1 head per rank
    acc = account(arch, "standard", context=1024, deployment=d)
    one_gpu = account(arch, "standard", context=1024, deployment=Deployment.make("vllm"))
    assert acc.total_bytes == 2 * one_gpu.bytes_allocated


def test_a_latent_cache_is_replicated_on_every_rank():
    arch = preset("deepseek-v3")
    one = kv_bytes_per_token(arch)
    assert one == 61 * (512 + 64) * 2
    assert kv_bytes_per_token(arch, deployment=Deployment.make("vllm", tp=8)) == one


@pytest.mark.parametrize(
    "tp, message",
    [
        (3, r"tp=3: vllm requires the attention heads \(64 in llama-3.1-70b\) divisible by the tensor-parallel size"),
        (128, "tp=128: vllm requires the attention heads"),
    ],
)
def test_a_tp_the_runtime_refuses_is_named(tp, message):
    with pytest.raises(ValueError, match=message):
        kv_bytes_per_token(preset("llama-3.1-70b"), deployment=Deployment.make("vllm", tp=tp))


def test_replicating_kv_heads_needs_tp_divisible_by_their_count():
    arch = _arch(heads=24, kv=8)
    with pytest.raises(ValueError, match="8 KV heads are replicated when tp > 8, which needs tp divisible by 8"):
        kv_bytes_per_token(arch, deployment=Deployment.make("vllm", tp=12))


def test_pipeline_stages_split_as_vllm_does_and_the_largest_is_per_device():
    assert stage_sizes(80, 3) == [27, 27, 26]  # vLLM get_pp_indices: the remainder before the last stage
    assert stage_sizes(32, 4) == [8, 8, 8, 8]
    assert stage_sizes(61, 4) == [15, 15, 16, 15]
    with pytest.raises(ValueError, match="pp=9 is more pipeline stages than the model's 8 layers"):
        stage_sizes(8, 9)
    arch = preset("llama-3.1-70b")
    d = Deployment.make("vllm", tp=4, pp=3)
    dev = device_arch(arch, d)
    assert (dev.num_layers, dev.num_kv_heads) == (27, 2)
    acc = account(arch, "standard", context=4096, deployment=d)
    per_layer_token = 2 * 128 * 2 * 2
    assert acc.bytes_allocated == 27 * 4096 * per_layer_token
    assert acc.total_bytes == 4 * 80 * 4096 * per_layer_token  # every stage, every rank
    # a hybrid model: the largest stage holds the most layers, then the most attention layers
    jamba = device_arch(preset("jamba-v0.1"), Deployment.make("vllm", pp=3))
    assert jamba.num_layers == 11 and jamba.layer_kinds.count("full") == 2


# ---------------------------------------------------------------------------------------------
# paged blocks (vLLM) and the whole context at start (llama.cpp)


def test_vllm_full_layers_hold_whole_blocks():
    arch = _arch(layers=1)
    steps = trace(arch, "standard", updates=[5, 1, 10, 1], deployment=Deployment.make("vllm")).steps
    per_token = token_bytes(arch)
    assert [s.bytes_allocated // per_token for s in steps] == [16, 16, 16, 32]


def test_vllm_refuses_a_context_past_max_model_len():
    with pytest.raises(ValueError, match="context 5,000 is past max_model_len=4,096"):
        account(_arch(), "standard", context=5000, deployment=Deployment.make("vllm", max_model_len=4096))


def test_vllm_sliding_layers_hold_at_most_the_blocks_sliding_window_spec_bounds():
    g = preset("gemma-2-9b")
    d = Deployment.make("vllm")
    window, block, chunk = 4096, 16, 2048
    per_token = token_bytes(g)
    t = trace(g, "standard", context=8192 + 300, prefill=8192, deployment=d)
    sliding = [i for i, c in enumerate(t.layers) if c.layer_type == "sliding"]
    assert len(sliding) == 21 and all(t.layers[i].kind == "PagedSlidingWindow" for i in sliding)
    held = [s.layer_bytes[sliding[0]] // per_token // block for s in t.steps]
    prefill, decode = held[:4], held[4:]
    # SlidingWindowSpec.max_memory_usage_bytes: cdiv(min(window - 1 + scheduled, max_model_len), block) + 1
    assert max(prefill) <= -(-(window - 1 + chunk) // block) + 1
    assert max(decode) == -(-(window - 1 + 1) // block) + 1  # reached once the window straddles a block
    full = [i for i, c in enumerate(t.layers) if c.layer_type == "full"][0]
    assert t.steps[-1].layer_bytes[full] == -(-(8192 + 300) // block) * block * per_token


@pytest.mark.parametrize(
    "runtime, kwargs",
    [
        ("vllm", {}),
        ("vllm", {"kv_format": "fp8", "block_size": 32}),
        ("llama.cpp", {"kv_format": "q4_0"}),
        ("mlx-lm", {}),
        ("transformers", {}),
    ],
)
def test_account_equals_the_last_step_of_the_trace_under_a_runtime(runtime, kwargs):
    arch = _arch(layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=40)
    d = Deployment.make(runtime, **kwargs)
    for context, prefill, chunk in ((3000, 700, 100), (517, 0, None), (2048, 2048, 300)):
        spec = "concat" if runtime == "transformers" else "standard"
        t = trace(arch, spec, context=context, prefill=prefill, prefill_chunk=chunk, deployment=d)
        acc = account(arch, spec, context=context, prefill=prefill, prefill_chunk=chunk, deployment=d)
        assert acc.bytes_allocated == t.steps[-1].bytes_allocated
        assert acc.peak_bytes == t.peak_bytes
        assert acc.max_resident_bytes == max(s.device_bytes for s in t.steps)


def test_llama_cpp_allocates_the_padded_context_at_start_and_a_small_swa_cache():
    g = preset("gemma-2-9b")
    d = Deployment.make("llama.cpp", kv_format="q8_0", max_model_len=8000, slots=1)  # one sequence
    layout = cache_layout(g, "standard", deployment=d)
    cells = {c.layer_type: c.knob("slots") for c in layout}
    assert cells == {"full": 8192, "sliding": 4608}  # GGML_PAD(8000, 256); GGML_PAD(4096 + 512, 256)
    row = format_bytes(8 * 256, "q8_0")
    acc = account(g, "standard", context=100, deployment=d)
    assert acc.bytes_allocated == 21 * 8192 * 2 * row + 21 * 4608 * 2 * row  # whatever the run uses
    with pytest.raises(ValueError, match="raise -c"):
        account(g, "standard", context=9000, deployment=d)
    # without -c, every moment is what -c = the tokens so far allocates (a search over contexts)
    run = replay(g, "standard", deployment=Deployment.make("llama.cpp", kv_format="q8_0", slots=1))
    for n in (100, 4000, 1000, 3000):
        run.update(n, "prefill", False)
        context = run.offset
        assert (
            run.totals()[0]
            == account(
                g,
                "standard",
                context=context,
                deployment=Deployment.make("llama.cpp", kv_format="q8_0", max_model_len=context, slots=1),
            ).bytes_allocated
        )


def test_llama_cpp_slides_only_where_its_architecture_sets_a_pattern():
    mistral = arch_from_config(
        {
            "model_type": "mistral",
            "num_hidden_layers": 4,
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "sliding_window": 64,
        }
    )
    layout = cache_layout(mistral, "standard", deployment=Deployment.make("llama.cpp"), context=1000)
    assert {c.layer_type for c in layout} == {"full"}


def test_the_layout_is_described_as_the_runtime_builds_it():
    from cachelib.plan.runtimes import describe_layout

    g = preset("gemma-2-9b")
    assert "21 full, 21 sliding" in describe_layout(g, Deployment.make("transformers"))
    assert "42 layers (42 full)" in describe_layout(g, Deployment.make("mlx-lm"))
    text = describe_layout(preset("llama-3.1-70b"), Deployment.make("vllm", tp=8, pp=2))
    assert text.endswith("per device: 40 layers, 1 kv heads")
