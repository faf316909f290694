"""The whole device: weights at their published precision and share of a deployment, the
activation peak against MLX's measured peak memory, what "fits" counts, and the questions users
ask (--solve, sessions vs batch)."""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np
import pytest

from cachelib.cli import plan as cli
from cachelib.plan import GiB, PlanRequest, account, plan, preset
from cachelib.plan.device import (
    WEIGHT_FORMATS,
    activation_peak,
    published_weights,
    weights_format,
    weights_per_device,
)
from cachelib.plan.request import solve_sessions
from cachelib.plan.runtimes import stage_sizes

LLAMA70 = preset("llama-3.1-70b")


def test_deepseek_v3_is_sized_at_its_published_fp8_not_at_16_bits():
    ds = preset("deepseek-v3")
    fmt = published_weights(ds)
    assert fmt.name == "fp8" and "quantization_config" in fmt.source
    weights = PlanRequest(["standard"], context=1).weights(ds)
    assert weights == pytest.approx(671e9 * (1 + 4 / (128 * 128)), rel=1e-9)  # one byte + a float32 per 128x128
    assert 671e9 <= weights < 672e9 < 1_342e9  # not the 1,342 GB of 16-bit weights
    assert published_weights(preset("llama-3.1-8b")).name == "bfloat16"
    assert published_weights(preset("gemma-2-9b")).bits == 16  # a float32 checkpoint is served at 16 bits


def test_gguf_and_mlx_formats_are_their_block_sizes():
    # ggml-common.h: block_q8_0 = fp16 scale + 32 int8; block_q4_0 = fp16 scale + 16 bytes; q4_K 144 B per 256
    assert weights_format("q8_0").bits * 32 / 8 == 34 and weights_format("Q4_0").bits * 32 / 8 == 18
    assert weights_format("q4_k").bits * 256 / 8 == 144 and weights_format("q6_k").bits * 256 / 8 == 210
    assert weights_format("mlx-4bit").bits == 4.5 and weights_format("bf16").name == "bfloat16"
    assert weights_format("4.5").bits == weights_format(4.5).bits == 4.5
    with pytest.raises(ValueError, match=r"unknown weights dtype 'q9_z'; allowed: float32, .*q4_k.*bits per parameter"):
        weights_format("q9_z")
    with pytest.raises(ValueError, match="must be > 0 and <= 64"):
        weights_format(0)
    assert len(WEIGHT_FORMATS) >= 15


def test_weights_are_split_over_tensor_and_pipeline_parallel_devices():
    fmt = weights_format("bfloat16")
    whole = weights_per_device(LLAMA70, fmt)
    assert whole == LLAMA70.num_params * 2
    assert weights_per_device(LLAMA70, fmt, tp=8) == -(-whole // 8)
    # pp=3 over 80 layers: vLLM's stages of 27, 27, 26; the first holds the embeddings, the last the LM head
    assert stage_sizes(80, 3) == [27, 27, 26]
    embed = LLAMA70.vocab_size * LLAMA70.hidden_size
    per_layer = (LLAMA70.num_params - 2 * embed) / 80
    assert weights_per_device(LLAMA70, fmt, pp=3) == pytest.approx((27 * per_layer + embed) * 2, abs=1)


def test_a_budget_below_one_devices_weights_is_refused_and_tp_makes_it_fit():
    request = PlanRequest(["standard"], context=8192, runtime="vllm", budget_bytes=80 * GiB)
    with pytest.raises(
        ValueError, match=r"budget 80\.00 GiB per device is below the weights on one device \(131\.42 GiB\)"
    ):
        plan(LLAMA70, request)
    fit = plan(LLAMA70, replace(request, tp=2))[0]
    assert fit.weights_bytes == -(-LLAMA70.num_params * 2 // 2) and fit.fits
    # vLLM leaves 1 - gpu_memory_utilization alone, and holds its non-torch memory (calibrated default at tp=2)
    assert fit.overhead_bytes == 80 * GiB - int(80 * GiB * 0.9) + round(3.58 * GiB)
    assert fit.cache.bytes_per_token == 163_840  # 80 layers x 4 KV heads per rank x 128 x 2 x 2 bytes


def test_activation_terms_follow_the_architecture_and_the_kernel():
    smol = preset("smollm2")  # 9 heads x 64, 3 KV heads, MLP 1536, vocab 49152
    gpu = activation_peak(smol, "standard", tokens=512, seen=2048, dtype="float16")
    cpu = activation_peak(smol, "standard", tokens=512, seen=2048, dtype="float16", device="cpu")
    assert gpu.scores == 0 and cpu.scores == 9 * 512 * 2048 * 2 + 512 * 2048  # scores + the causal mask
    assert gpu.logits == 512 * 49152 * 2 and gpu.mlp == 3 * 512 * 1536 * 2 and gpu.hidden == 3 * 512 * 576 * 2
    quantized = activation_peak(smol, "quantized:bits=4", tokens=512, seen=2048, dtype="float16")
    assert quantized.scores == cpu.scores  # mlx-lm's quantized attention materialises them on any device
    ring = activation_peak(smol, "rotating:max_size=256", tokens=512, seen=2048, dtype="float16", device="cpu")
    assert ring.visible == 255 + 512  # the ring returns its last max_size - 1 keys and the new ones
    vllm = activation_peak(smol, "standard", tokens=512, seen=2048, backend="torch", runtime="vllm")
    assert vllm.logits == 49152 * 4 and vllm.scores == 0  # the last position's float32 logits only
    jamba = preset("jamba-v0.1")
    state = activation_peak(jamba, "standard", tokens=2048, seen=2048, dtype="bfloat16")
    # mlx-lm's jamba ssm_step: the (B, T, channels, d_state) state and its decay, at 2048-token chunks
    assert state.recurrent >= 2 * 2048 * 8192 * 16 * 2
    whole = activation_peak(jamba, "standard", tokens=65536, seen=65536, dtype="bfloat16")
    assert whole.recurrent >= 2 * 65536 * 8192 * 16 * 2 > 30 * 2**30  # a 65,536-token prompt in one update


def test_jamba_at_65k_no_longer_fits_34_batches_in_one_update():
    # cachelib's loop feeds the prompt in one update unless chunked (mlx-lm's would chunk it by 2,048)
    request = PlanRequest(["standard"], context=65536, budget_bytes=80 * GiB, weights_dtype="q4_0", runtime="cachelib")
    fit = plan(preset("jamba-v0.1"), request)[0]
    assert fit.activation_bytes > 30 * 2**30 and fit.max_batch <= 1
    chunked = plan(preset("jamba-v0.1"), replace(request, prefill_chunk=2048))[0]
    assert chunked.activation_bytes < 3 * 2**30 and chunked.max_batch > fit.max_batch


def _measured_peak(loaded, spec: str, prompt: int, chunk: int) -> int:
    """MLX's peak over a run, less what was live before it: the cache and the activations."""
    import mlx.core as mx

    from cachelib.mlx.factory import make_cache

    ids = np.random.default_rng(0).integers(0, loaded.info.vocab_size, size=prompt)
    mx.synchronize()
    mx.clear_cache()
    cache = make_cache(loaded.model, spec)
    before = int(mx.get_active_memory())  # the weights, and whatever else this process keeps alive
    mx.reset_peak_memory()
    for start in range(0, prompt, chunk):
        out = loaded.model(mx.array(ids[None, start : start + chunk]), cache=cache)
        mx.eval(out)
        del out
    mx.synchronize()
    return int(mx.get_peak_memory()) - before


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma3", "tiny-mamba"])
def test_predicted_peak_is_within_10_percent_of_mlxs_measured_peak(model):
    from cachelib.models import load

    loaded = load(model, "mlx", device="cpu", dtype="float32")
    weights = int(loaded.info.weight_bytes)
    for spec in ("standard", "quantized:bits=4"):
        request = PlanRequest(
            [spec],
            context=512,
            prefill_chunk=256,
            dtype="float32",
            weights_bytes=weights,
            device="cpu",
            runtime="cachelib",
        )  # _measured_peak runs cachelib's loop: every position's logits
        fit = plan(preset(model), request)[0]
        beyond = _measured_peak(loaded, spec, 512, 256)  # the cache and the activations, where the model could be wrong
        assert fit.cache.peak_bytes + fit.activation_bytes == pytest.approx(beyond, rel=0.10), (model, spec)
        assert fit.budget_needed == pytest.approx(weights + beyond, rel=0.10), (model, spec)


def test_solve_max_kv_size_is_the_largest_ring_that_fits_the_sessions():
    arch = preset("llama-3.1-8b")
    request = PlanRequest(
        ["standard"], context=8192, prefill_chunk=512, budget_bytes=24 * GiB, sessions=16, solve="max_kv_size"
    )
    found = solve_sessions(arch, request)
    assert found.sessions >= 16 and found.value < 8192
    ring = replace(request, strategies=(found.spec,), solve=None)
    bigger = replace(ring, strategies=(f"rotating:max_size={found.value + 1},keep=4",))
    assert plan(arch, ring)[0].sessions == found.sessions >= 16 > plan(arch, bigger)[0].sessions  # the evidence
    assert f"{found.value:,} is the largest max_kv_size" in found.text and "16 sessions of 8,192 tokens" in found.text
    bits = solve_sessions(arch, replace(request, solve="bits"))
    assert bits.spec is not None and plan(arch, replace(ring, strategies=(bits.spec,)))[0].sessions >= 16
    if bits.value < 8:
        more = replace(ring, strategies=(f"quantized:bits={[b for b in (8, 6, 5, 4, 3, 2) if b > bits.value][-1]}",))
        assert plan(arch, more)[0].sessions < 16


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="cachelib plan")
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(argv))


def test_cli_solves_and_explains_sessions_against_batch(capsys):
    assert (
        _run(
            [
                "--model",
                "llama-3.1-8b",
                "--context",
                "8192",
                "--prefill-chunk",
                "512",
                "--budget",
                "24GiB",
                "--sessions",
                "16",
                "--solve",
                "max_kv_size",
                "--no-default-evidence",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "--solve max_kv_size: " in out and "is the largest max_kv_size" in out
    assert "sessions: independent conversations of this context served concurrently" in out
    assert "memory per device (GiB = 2^30 bytes)" in out


def test_a_context_past_the_models_limit_is_planned_with_a_warning(capsys):
    assert (
        _run(["--model", "llama-3.1-8b", "--context", "1000000", "--prefill-chunk", "2048", "--no-default-evidence"])
        == 0
    )
    err = capsys.readouterr().err
    assert "context 1,000,000 is past llama-3.1-8b's limit of 131,072 tokens (max_position_embeddings)" in err


def test_tp_8_on_llama_70b_holds_40960_bytes_per_token_per_gpu_and_the_table_says_all_devices(capsys):
    assert (
        _run(
            [
                "--model",
                "llama-3.1-70b",
                "--runtime",
                "vllm",
                "--tp",
                "8",
                "--context",
                "8192",
                "--budget",
                "80",
                "--no-default-evidence",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if line.startswith("strategy"))
    assert "all devices" in head
    acc = account(
        LLAMA70,
        "standard",
        context=8192,
        deployment=PlanRequest(["standard"], context=1, runtime="vllm", tp=8).deployment,
    )
    assert acc.bytes_per_token == 40_960 and acc.total_bytes == 8 * acc.bytes_allocated
