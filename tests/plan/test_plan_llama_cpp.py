"""llama.cpp's KV cache as the planner sizes it, checked against llama.cpp itself (issue 28, item 2).

Two halves. With the side build (``bash scripts/llamacpp_env.sh``: llama.cpp b10605 from source,
CPU only, under ``.llamacpp/``; CI does not build it), llama.cpp creates contexts over a grid of
n_ctx x ``-ctk/-ctv`` x ``--parallel`` x ``--kv-unified`` x ``--swa-full`` x ``-fa`` on the
bundled GGUF and a tiny Gemma-2 GGUF, and every ``llama_kv_cache: size = ...`` line it logs must
equal the planner's (``bench/bench_llama_cpp.py`` holds the comparison); without it those tests
are skipped. The published checks below run everywhere: each number comes with its source.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from cachelib.plan import Deployment, account, arch_from_config, preset
from cachelib.plan.layouts import llama_cpp_layer_kinds
from cachelib.plan.request import PlanRequest
from cachelib.plan.runtimes import llama_cpp_stage_sizes, stage_arches

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def _bench():
    spec = importlib.util.spec_from_file_location("bench_llama_cpp", ROOT / "bench" / "bench_llama_cpp.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


needs_build = pytest.mark.skipif(
    not (ROOT / ".llamacpp" / "bin" / "llamacpp-kv").exists(),
    reason="no llama.cpp side build: run `bash scripts/llamacpp_env.sh` (builds llama.cpp b10605 under .llamacpp/)",
)


# ---------------------------------------------------------------------------------------------
# against llama.cpp itself


@pytest.fixture(scope="module")
def workdir():
    path = ROOT / ".llamacpp" / "models"  # beside the build: the tiny GGUF is written once (fixed seed)
    path.mkdir(parents=True, exist_ok=True)
    return path


@needs_build
@pytest.mark.bundled
def test_planner_bytes_equal_llama_cpps_own_log_line_on_a_grid(workdir):
    bench = _bench()
    rows = [bench.compare(c, workdir) for c in bench.grid(quick=True)]
    for r in rows:
        assert r["equal"], (r["case"].flags(), r["llama"], r["planned"], r["refusal"])
    # the grid holds what the issue asks for: 4 slots on a sliding model, a quantized V cache, a refusal
    sliding = [r for r in rows if r["case"].model == "gemma2-tiny" and r["case"].slots == 4 and len(r["llama"]) == 2]
    assert any(r["llama"][1].cells < r["llama"][0].cells for r in sliding)  # the SWA cache is the smaller
    assert any(r["case"].kv == "q4_0" and r["llama"] for r in rows)
    assert any(r["refusal"] and not r["llama"] for r in rows)  # -fa off with a quantized V: both refuse


@needs_build
@pytest.mark.slow
@pytest.mark.bundled
def test_planner_bytes_equal_llama_cpps_own_log_line_on_the_whole_grid(workdir):
    bench = _bench()
    for case in bench.grid():
        r = bench.compare(case, workdir)
        assert r["equal"], (case.flags(), r["llama"], r["planned"], r["refusal"])


# ---------------------------------------------------------------------------------------------
# published llama.cpp logs

# openai/gpt-oss-20b config.json: 24 layers (sliding, full alternating), 8 KV heads of 64, window 128
GPT_OSS_20B = {
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "vocab_size": 201088,
    "max_position_embeddings": 131072,
}
# google/gemma-2-2b config.json: 26 layers, 4 KV heads of 256, window 4096
GEMMA_2_2B = {
    "model_type": "gemma2",
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "sliding_window": 4096,
    "vocab_size": 256000,
    "max_position_embeddings": 8192,
}


def _kv_mib(arch, n_ctx, **settings) -> dict[str, float]:
    acc = account(arch, "standard", context=1, deployment=Deployment.make("llama.cpp", max_model_len=n_ctx, **settings))
    out: dict[str, float] = {}
    for layer in acc.layers:
        out[layer.layer_type] = out.get(layer.layer_type, 0) + layer.bytes_allocated / MiB
    return out


def test_gpt_oss_20b_at_131072_cells_plans_llama_cpps_3090_mib():
    # https://github.com/ikawrakow/ik_llama.cpp/issues/822 (llama.cpp build 6699, RTX 3070,
    # `llama-server -m gpt-oss-20b-mxfp4.gguf -c 131072 -fa on`, n_seq_max = 1):
    #   llama_kv_cache: size = 3072.00 MiB (131072 cells,  12 layers,  1/1 seqs), K (f16): 1536.00 MiB, ...
    #   llama_kv_cache: size =   18.00 MiB (   768 cells,  12 layers,  1/1 seqs), K (f16):    9.00 MiB, ...
    arch = arch_from_config(GPT_OSS_20B)
    assert _kv_mib(arch, 131072, slots=1, flash_attn="on") == {"full": 3072.0, "sliding": 18.0}  # 3,090 MiB
    kinds, window = llama_cpp_layer_kinds("gpt_oss", 24, 128)
    assert kinds[:2] == ("sliding", "full") and kinds.count("sliding") == 12 and window == 128
    # llama-server b10605's own default (--parallel auto: 4 slots, unified KV) keeps pad(128 x 4 + 512) cells
    assert _kv_mib(arch, 131072) == {"full": 3072.0, "sliding": 24.0}


def test_gpt_oss_20b_split_over_eight_devices_as_llama_cpp_assigns_layers():
    # A published llama-server log of gpt-oss-20b (-c 131072) on 8 Ascend NPUs (CANN backend,
    # default split; found in a public repository file by the search tools, address not given):
    # KV buffer per device, non-SWA: 512 256 512 256 512 256 512 256 MiB; SWA: 3 3 1.5 3 1.5 3 1.5 1.5 MiB.
    assert llama_cpp_stage_sizes(24, 8) == [4, 3, 3, 3, 3, 3, 3, 2]
    arch = arch_from_config(GPT_OSS_20B)
    one = account(arch, "standard", context=1, deployment=Deployment.make("llama.cpp", max_model_len=131072, slots=1))
    layer_mib = {a.layer_type: a.bytes_allocated / MiB for a in one.layers}  # one layer of each kind
    d = Deployment.make("llama.cpp", max_model_len=131072, slots=1, pp=8)
    kinds = ("full", "sliding")
    per_device = [tuple(s.layer_kinds.count(k) * layer_mib[k] for k in kinds) for s in stage_arches(arch, d)]
    assert per_device == [(512, 3), (256, 3), (512, 1.5), (256, 3), (512, 1.5), (256, 3), (512, 1.5), (256, 1.5)]
    assert account(arch, "standard", context=1, deployment=d).total_bytes == 3090 * MiB


def test_eighty_layers_split_41_39_over_two_devices():
    # llama-model.cpp load_tensors (b10605): layer il on the first device whose cumulative share
    # exceeds il / (n_layer + 1); the output layer is the 81st
    assert llama_cpp_stage_sizes(80, 2) == [41, 39]
    assert llama_cpp_stage_sizes(80, 2, (3.0, 1.0)) == [61, 19]
    llama70 = preset("llama-3.1-70b")
    d = Deployment.make("llama.cpp", max_model_len=8192, slots=1, pp=2)
    assert [a.num_layers for a in stage_arches(llama70, d)] == [41, 39]
    with pytest.raises(ValueError, match="leaves a device without layers"):
        llama_cpp_stage_sizes(80, 2, (1.0, 0.0))


def test_gemma_2_2b_at_8192_with_llama_servers_default_four_slots_holds_832_mib():
    # Issue 28: llama-server's default 4 slots with a unified KV size the SWA cache as
    # pad(min(n_ctx, n_swa x 4 + n_ubatch)) = 8192 cells (llama-kv-cache-iswa.cpp, b10605):
    # 13 full + 13 SWA layers x 8192 cells x 4 KV heads x 256 x 2 (K, V) x 2 bytes = 832 MiB
    arch = arch_from_config(GEMMA_2_2B)
    assert sum(_kv_mib(arch, 8192).values()) == 832
    assert sum(_kv_mib(arch, 8192, slots=1).values()) == 650  # one sequence: pad(4096 + 512) SWA cells
    assert sum(_kv_mib(arch, 8192, slots=4).values()) == 832  # 4 streams of 2048 cells: SWA min(2048, 4608)


# ---------------------------------------------------------------------------------------------
# llama.cpp's rules, by name


@pytest.mark.parametrize(
    "model_type, layers, window, text, sliding",
    [
        ("gemma2", 4, 4096, {}, (0, 2)),
        ("gemma3_text", 12, 1024, {}, (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)),
        ("cohere2", 8, 4096, {}, (0, 1, 2, 4, 5, 6)),
        ("llama4_text", 8, None, {"attention_chunk_size": 8192}, (0, 1, 2, 4, 5, 6)),
        ("olmo3", 4, 4096, {"layer_types": ["sliding_attention", "full_attention"] * 2}, (0, 2)),
        ("exaone4", 8, 4096, {}, ()),  # only the 64-layer model slides
        ("mistral", 4, 4096, {}, ()),  # llama.cpp ignores a Mistral / Qwen2 sliding_window
        ("qwen2", 4, 4096, {}, ()),
    ],
)
def test_llama_cpp_slides_the_layers_its_model_table_names(model_type, layers, window, text, sliding):
    kinds, w = llama_cpp_layer_kinds(model_type, layers, window, text)
    assert tuple(i for i, k in enumerate(kinds) if k == "sliding") == sliding
    assert (w is None) == (not sliding)
    if model_type.startswith("llama4"):
        assert w == 8192  # models/llama4.cpp: n_swa = 8192 whatever the GGUF says


def test_kv_sharing_architectures_are_refused_by_name():
    with pytest.raises(ValueError, match="shares KV caches between the layers of 'gemma3n'"):
        llama_cpp_layer_kinds("gemma3n", 30, 512)


def test_the_swa_cache_follows_ubatch_and_swa_full():
    arch = arch_from_config(GEMMA_2_2B)
    cells = {}
    for ub, full in ((512, False), (256, False), (512, True)):
        acc = account(
            arch,
            "standard",
            context=1,
            deployment=Deployment.make("llama.cpp", max_model_len=16384, slots=1, ubatch=ub, swa_full=full),
        )
        cells[(ub, full)] = {a.capacity for a in acc.layers if a.layer_type == "sliding"}
    assert cells == {(512, False): {4608}, (256, False): {4352}, (512, True): {16384}}


def test_a_batch_larger_than_the_slots_and_flags_on_other_runtimes_are_refused():
    arch = preset("smollm2")
    with pytest.raises(ValueError, match="at most --parallel 2 sequences at once; allowed: batch <= 2"):
        account(arch, "standard", context=10, batch=3, deployment=Deployment.make("llama.cpp", slots=2))
    with pytest.raises(ValueError, match="--parallel \\(slots\\) must be an integer >= 1, got 0"):
        Deployment.make("llama.cpp", slots=0)
    with pytest.raises(ValueError, match="--swa-full: vllm has no such setting"):
        Deployment.make("vllm", swa_full=True)
    with pytest.raises(ValueError, match="requires flash attention .* allowed: -fa on, -fa auto"):
        Deployment.make("llama.cpp", kv_format="q4_0", flash_attn="off")
    with pytest.raises(ValueError, match="-fa 'yes': allowed: on, off, auto"):
        Deployment.make("llama.cpp", flash_attn="yes")
    with pytest.raises(ValueError, match="give 2 non-negative shares"):
        Deployment.make("llama.cpp", pp=2, tensor_split=(1.0,))


def test_without_minus_c_each_moment_is_the_smallest_context_that_holds_the_batch():
    arch = arch_from_config(GEMMA_2_2B)
    for slots, unified, batch in ((4, True, 3), (4, False, 2), (1, False, 1)):
        grow = Deployment.make("llama.cpp", slots=slots, kv_unified=unified)
        for context in (100, 700, 5000, 9000):
            n_ctx = context * (batch if unified else slots)  # the smallest -c that holds every sequence
            fixed = Deployment.make("llama.cpp", slots=slots, kv_unified=unified, max_model_len=n_ctx)
            got = account(arch, "standard", context=context, batch=batch, deployment=grow).bytes_allocated
            assert got == account(arch, "standard", context=context, batch=batch, deployment=fixed).bytes_allocated


def test_the_request_and_its_command_line_carry_llama_cpps_flags():
    r = PlanRequest(
        ["standard"],
        context=4096,
        runtime="llama.cpp",
        slots=2,
        kv_unified=True,
        swa_full=True,
        flash_attn="on",
        ubatch=256,
        kv_format="q8_0",
    )
    argv = r.to_argv("smollm2")
    for flag in ("--parallel", "2", "--kv-unified", "--swa-full", "--flash-attn", "on", "--ubatch-size", "256"):
        assert flag in argv
    with pytest.raises(ValueError, match="--parallel: mlx-lm has no such setting"):
        PlanRequest(["standard"], context=100, slots=2)


@pytest.mark.parametrize(
    "settings, batch",
    [
        ({"slots": 4, "kv_unified": True}, 3),
        ({"slots": 3}, 2),
        ({"slots": 1, "swa_full": True}, 1),
        ({}, 1),
    ],
)
def test_account_equals_the_step_by_step_trace_with_slots(settings, batch):
    from cachelib.plan import trace

    arch = arch_from_config({**GEMMA_2_2B, "sliding_window": 40, "num_hidden_layers": 4})
    d = Deployment.make("llama.cpp", **settings)
    for context, prefill, chunk in ((3000, 700, 100), (517, 0, None), (2048, 2048, 300)):
        t = trace(arch, "standard", context=context, prefill=prefill, prefill_chunk=chunk, batch=batch, deployment=d)
        acc = account(
            arch, "standard", context=context, prefill=prefill, prefill_chunk=chunk, batch=batch, deployment=d
        )
        assert acc.bytes_allocated == t.steps[-1].bytes_allocated and acc.peak_bytes == t.peak_bytes


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--runtime", "llama.cpp", "--parallel", "0"], "argument -np/--parallel: must be >= 1, got 0"),
        (["--runtime", "vllm", "--swa-full"], "--swa-full: vllm has no such setting"),
        (["--parallel", "2"], "--parallel: mlx-lm has no such setting"),
        (["--runtime", "llama.cpp", "--kv-format", "q8_0", "-fa", "off"], "allowed: -fa on, -fa auto"),
        (["--runtime", "llama.cpp", "--batch", "3", "-np", "2"], "allowed: batch <= 2"),
    ],
)
def test_bad_llama_cpp_flags_exit_2_with_one_line(capsys, argv, message):
    from cachelib.cli import main

    assert main(["plan", "--model", "smollm2", "--context", "100", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_the_cli_plans_gemma_2_2b_with_llama_servers_slots(tmp_path, capsys):
    import json

    from cachelib.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(GEMMA_2_2B))
    base = ["plan", "--model", str(path), "--context", "8192", "--runtime", "llama.cpp"]
    assert main(base) == 0
    assert "832.00 MiB" in capsys.readouterr().out  # 4 slots, unified: the SWA layers keep 8,192 cells
    assert main([*base, "-np", "1"]) == 0
    assert "650.00 MiB" in capsys.readouterr().out
