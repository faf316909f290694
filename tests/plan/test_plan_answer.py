"""The planner's answer: the strategy to deploy in the runtime's own flags, judged conservatively.

The flags are checked against the runtimes' own parsers where they are installed (mlx-lm's
``generate`` argparse, read back into the spec it builds), the rules against the committed
evidence (the issue's Llama-3.1-8B at 32,768 tokens in 24 GiB), and every recommendation the
docs state against what the planner now answers for the command printed beside it."""

from __future__ import annotations

import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest

from cachelib.cli import main
from cachelib.plan import GiB, PlanRequest, plan_request, preset
from cachelib.plan.answer import build_answer, default_strategies, runtime_command, runtime_flags
from cachelib.plan.quality import Evidence, is_exact, meets
from cachelib.plan.request import request_defaults, typed_size
from cachelib.plan.runtimes import Deployment, mlx_lm_spec, runtime_spec
from cachelib.profile.evidence import load_evidence
from cachelib.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]
LLAMA = preset("llama-3.1-8b")
EVIDENCE = load_evidence().points
ISSUE = ["standard", "quantized:bits=8", "quantized:bits=4,group_size=32", "kivi:bits=4,group_size=64,residual=128"]


def point(spec, kl, kl_ci, top1, top1_ci, context=8128):
    return Evidence(spec, "smollm2", "mlx", context, 1.0, 3, kl, top1, kl_ci, top1_ci)


# --- the runtime's own flags -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, flags",
    [
        ("standard", []),
        ("rotating:max_size=4096,keep=4", ["--max-kv-size", "4096"]),
        ("quantized:bits=8", ["--kv-bits", "8", "--quantized-kv-start", "0"]),
        ("quantized:bits=4,group_size=32,start=5000", ["--kv-bits", "4", "--kv-group-size", "32"]),
        ("rotating:max_size=4096,keep=0", None),  # mlx-lm's ring always keeps 4
        ("kivi", None),
        ("h2o:budget=256", None),
    ],
)
def test_mlx_lm_flags_read_back_by_mlx_lm_s_own_parser_are_the_same_cache(spec, flags):
    assert runtime_flags(spec, "mlx-lm") == flags
    if flags is None:
        assert runtime_command(PlanRequest([spec], context=8192, runtime="mlx-lm"), spec, "M") is None
        return
    generate = pytest.importorskip("mlx_lm.generate", reason="mlx-lm is not installed")
    command = runtime_command(PlanRequest([spec], context=8192, runtime="mlx-lm"), spec, "meta-llama/Llama-3.1-8B")
    argv = shlex.split(command)
    assert argv[0] == "mlx_lm.generate"
    args = generate.setup_arg_parser().parse_args(argv[1:])  # what mlx_lm.generate itself reads
    built = mlx_lm_spec(
        max_kv_size=args.max_kv_size,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        quantized_kv_start=args.quantized_kv_start,
    )
    # what mlx-lm builds for the flags is what the plan accounts under mlx-lm (--quantized-kv-start 0: start=1)
    assert parse_spec(built).key == runtime_spec(spec, Deployment.make("mlx-lm", "mlx")).key


def test_a_ring_is_no_mlx_lm_flag_for_a_model_class_that_builds_its_own_cache():
    # mlx-lm's llama Model has make_cache, so mlx_lm.generate ignores --max-kv-size for it
    ring = "rotating:max_size=2048,keep=4"
    assert runtime_flags(ring, "mlx-lm", "llama") is None
    assert runtime_flags(ring, "mlx-lm", "qwen2") == ["--max-kv-size", "2048"]
    request = PlanRequest(["standard"], context=8192, budget_bytes=24 * GiB, sessions=16, solve="max_kv_size")
    answer = build_answer(plan_request(preset("llama-3.1-8b"), request), "meta-llama/Llama-3.1-8B")
    assert "--max-kv-size" not in answer.text()
    assert "no mlx-lm option for llama-3.1-8b: cachelib's cache in your code" in answer.text()


def test_vllm_llama_cpp_and_transformers_commands():
    vllm = PlanRequest(["standard"], context=32768, runtime="vllm", kv_format="fp8", tp=2)
    assert runtime_command(vllm, "standard", "meta-llama/Llama-3.1-8B") == (
        "vllm serve meta-llama/Llama-3.1-8B --max-model-len 32768 --kv-cache-dtype fp8 "
        "--gpu-memory-utilization 0.9 -tp 2"
    )
    assert runtime_flags("quantized:bits=8", "vllm") is None and runtime_flags("rotating:max_size=64", "vllm") is None
    cpp = PlanRequest(["standard"], context=8192, runtime="llama.cpp", kv_format="q8_0")
    # -c is shared by the -np slots: 4 sessions of 8,192 tokens need -c 32768
    assert (
        runtime_command(cpp, "standard", "m.gguf", sessions=4) == "llama-server -m m.gguf -c 32768 -np 4 "
        "-ctk q8_0 -ctv q8_0 -fa on"
    )
    tf = PlanRequest(["standard"], context=8192, runtime="transformers")
    assert "StaticCache(config=model.config, max_cache_len=9000)" in runtime_command(tf, "static:max_len=9000", "m")
    assert runtime_flags("kivi", "transformers") is None


# --- the rules ---------------------------------------------------------------------------------------


def test_a_threshold_is_met_by_the_interval_s_bound_not_the_mean():
    # the issue's two cases: 0.076 ± 0.061 nats reaches 0.137; 90.6% ± 6.7% reaches 83.9%
    q4 = point("quantized:bits=4,group_size=32", 0.076, 0.061, 0.95, 0.01).quality()
    ok, why = meets(q4, max_kl=0.1)
    assert not ok and "upper 95% bound 0.137 > 0.1" in why
    kivi = point("kivi", 0.01, 0.001, 0.906, 0.067).quality()
    ok, why = meets(kivi, min_agreement=0.9)
    assert not ok and "lower 95% bound 83.9% < 90%" in why
    assert meets(point("quantized:bits=8", 0.02, 0.01, 0.99, 0.005).quality(), 0.1, 0.9)[0]
    one = Evidence("quantized:bits=8", "smollm2", "mlx", 8128, 1.0, 1, 0.0, 1.0)  # one sample: no interval
    assert meets(one.quality(), max_kl=1.0) == (False, "mean KL 0 from one sample: no 95% interval to bound it")


def test_the_issue_s_llama_at_32k_in_24_gib_on_mlx_lm_answers_with_an_mlx_lm_flag_set():
    request = PlanRequest(ISSUE, context=32768, budget_bytes=24 * GiB, runtime="mlx-lm", max_kl=0.1, min_agreement=0.9)
    result = plan_request(LLAMA, request, EVIDENCE)
    rec = result.choice
    assert rec.fit is not None and runtime_flags(rec.fit.spec, "mlx-lm") is not None
    assert rec.fit.spec == "standard"  # lossless, and it serves the request: nothing lossy is needed
    for f in result.fits:  # no strategy whose interval crosses a threshold is said to meet it
        q = f.quality
        if f.spec in rec.qualified and not is_exact(q):
            assert q.mean_kl + q.mean_kl_ci95 <= 0.1 and q.top1_agreement - q.top1_ci95 >= 0.9
    assert "quantized:bits=4,group_size=32" not in rec.qualified  # 0.076 ± 0.061 crosses 0.1
    assert "kivi" not in rec.qualified  # 90.6% ± 6.7% crosses 90%
    answer = build_answer(result, "llama-3.1-8b")
    assert answer.command == "mlx_lm.generate --model meta-llama/Llama-3.1-8B"
    assert "kivi" not in answer.title and "kivi" not in answer.command


def test_lossy_only_when_the_lossless_one_does_not_serve_the_sessions_and_in_mlx_lm_flags():
    base = PlanRequest(
        ISSUE, context=8192, prefill_chunk=512, budget_bytes=24 * GiB, runtime="mlx-lm", max_kl=0.1, min_agreement=0.9
    )
    few = plan_request(LLAMA, replace(base, sessions=2), EVIDENCE).choice
    assert few.fit.spec == "standard"
    many = plan_request(LLAMA, replace(base, sessions=16), EVIDENCE)
    standard = next(f for f in many.fits if f.spec == "standard")
    assert standard.sessions < 16  # the lossless cache does not serve 16 sessions here ...
    pick = many.choice.fit
    assert pick.spec == "quantized:bits=8" and pick.sessions >= 16  # ... so the lossy 8-bit one, an mlx-lm flag set
    assert build_answer(many, "llama-3.1-8b").command.endswith("--kv-bits 8 --quantized-kv-start 0")
    most = plan_request(LLAMA, replace(base, most_sessions=True), EVIDENCE).choice
    assert most.fit.sessions == max(f.sessions for f in many.fits if f.spec in most.qualified)


def test_ties_go_to_the_simplest_flag_set():
    same = dict(kl=0.001, kl_ci=0.001, top1=0.99, top1_ci=0.005)
    evidence = [point("quantized:bits=8", **same), point("quantized:bits=8,start=5000", **same)]
    request = PlanRequest(
        ["quantized:bits=8", "quantized:bits=8,start=5000"], context=4096, runtime="mlx-lm", max_kl=0.1
    )
    rec = plan_request(preset("smollm2"), request, evidence).choice
    # --kv-bits 8 alone, against --kv-bits 8 --quantized-kv-start 0
    assert rec.fit.spec == "quantized:bits=8,start=5000"


def test_strategies_a_runtime_cannot_run_go_to_the_in_code_section_never_the_answer():
    kivi = point("kivi", 0.001, 0.001, 0.995, 0.002)
    request = PlanRequest(["kivi"], context=8192, budget_bytes=24 * GiB, runtime="mlx-lm", max_kl=0.1)
    result = plan_request(LLAMA, request, [kivi])
    assert result.choice.fit is None and result.choice.elsewhere == ("kivi",)
    answer = build_answer(result, "llama-3.1-8b")
    assert answer.in_code and answer.in_code[0].startswith('cachelib.mlx.make_cache(model, "kivi")')
    assert "nothing to deploy" in answer.title


def test_vllm_fp8_is_judged_by_its_evidence_or_said_not_measured_and_the_answer_holds_the_vllm_command():
    request = PlanRequest(["standard"], context=32768, budget_bytes=80 * GiB, runtime="vllm", kv_format="fp8")
    result = plan_request(LLAMA, request, EVIDENCE)
    answer = build_answer(result, "llama-3.1-8b")
    assert answer.command.startswith("vllm serve meta-llama/Llama-3.1-8B --max-model-len 32768 --kv-cache-dtype fp8")
    fp8 = result.fits[0].quality
    if fp8 is None:  # no fp8 evidence in this cachelib: never called exact
        assert any("KV format fp8: not measured" in line for line in answer.facts)
        assert "NOT RECOMMENDED" in answer.title
    else:
        assert not is_exact(fp8) and "fp8" in result.judgements["standard"].reason


def test_the_solve_shows_the_ring_and_the_kv_bits_for_the_same_sessions_side_by_side():
    request = PlanRequest(
        ISSUE[:2],
        context=8192,
        prefill_chunk=512,
        budget_bytes=24 * GiB,
        runtime="mlx-lm",
        sessions=16,
        solve="max_kv_size",
        max_kl=0.1,
        min_agreement=0.9,
    )
    result = plan_request(LLAMA, request, EVIDENCE)
    assert [s.spec.name for s in result.solved] == ["rotating", "quantized"]
    ring = result.solved[0]
    assert ring.sessions >= 16 and str(ring.spec) in [f.spec for f in result.fits]
    side = build_answer(result, "llama-3.1-8b").side_by_side
    # mlx-lm's llama builds its own cache (make_cache) and ignores --max-kv-size: the ring is cachelib's, said so
    assert side[0].startswith(f"{ring.spec} (no mlx-lm option for llama-3.1-8b") and "kept" in side[0]
    assert side[1].startswith("quantized:bits=8 (--kv-bits 8 --quantized-kv-start 0)")
    assert all("mean KL" in line and ("meets" in line or "misses" in line) for line in side)


def test_suggestions_only_when_asked_and_at_sizes_a_person_types():
    request = PlanRequest(["standard"], context=32768, budget_bytes=24 * GiB, runtime="mlx-lm", max_kl=0.1)
    assert [f.spec for f in plan_request(LLAMA, request, EVIDENCE).fits] == ["standard"]
    suggested = plan_request(LLAMA, replace(request, suggest=True), EVIDENCE)
    assert suggested.added
    for spec in map(parse_spec, suggested.added):
        if spec.window is not None:
            assert spec.window % 256 == 0 or spec.window & (spec.window - 1) == 0, spec
    assert typed_size(3972) == 4096 and typed_size(100) == 128 and typed_size(30841) == 30976


def test_the_runtime_s_standard_set_is_planned_when_no_strategy_is_given(capsys):
    assert main(["plan", "--model", "llama-3.1-8b", "--context", "4096", "--runtime", "mlx-lm"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("\nstrategy ") :]
    for spec in default_strategies("mlx-lm"):
        assert f"\n{spec} " in table
    # no --runtime: the backend's deployed runtime, with its standard set (not cachelib's loop's)
    for backend, runtime in (("mlx", "mlx-lm"), ("torch", "transformers")):
        assert main(["plan", "--model", "llama-3.1-8b", "--context", "4096", "--backend", backend]) == 0
        out = capsys.readouterr().out
        table = out[out.index("\nstrategy ") :]
        listed = [line.split()[0] for line in table.strip().splitlines()[1:] if line and not line[0].isspace()]
        assert listed[: len(default_strategies(runtime))] == list(default_strategies(runtime)), (backend, listed)
        assert "rotating:max_size=4096" not in table


# --- the CLI ---------------------------------------------------------------------------------------------


def test_cli_opens_with_the_answer_and_explains_and_lists_commands_on_request(capsys):
    args = [
        "plan",
        "--model",
        "llama-3.1-8b",
        "--context",
        "32768",
        "--budget",
        "24",
        "--runtime",
        "mlx-lm",
        "--strategy",
        "standard",
        "--strategy",
        "rotating:max_size=128,keep=4",
        "--max-kl",
        "0.1",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "answer: standard (no cache flag) on mlx-lm for llama-3.1-8b at 32,768 tokens\n"
        "  mlx_lm.generate --model meta-llama/Llama-3.1-8B\n"
    )
    assert "how: " not in out and "cachelib evaluate" not in out and "--commands prints them" in out
    assert main([*args, "--explain", "--commands"]) == 0
    out = capsys.readouterr().out
    assert "how: planned 2 strategies" in out and "4. standard is lossless" in out
    commands = out[out.index("to measure what the evidence does not cover:\n") :].splitlines()[1:]
    assert commands and all(c.startswith("python -m cachelib evaluate ") for c in commands)  # one per line


def test_the_defaults_have_one_source():
    from cachelib.cli import build_parser

    args = build_parser().parse_args(["plan", "--model", "smollm2", "--context", "64"])
    d = request_defaults()
    pairs = (
        ("batch", "batch"),
        ("backend", "backend"),
        ("dtype", "dtype"),
        ("tp", "tp"),
        ("pp", "pp"),
        ("device", "device"),
        ("reserve", "reserve_bytes"),
        ("max_kl", "max_kl"),
        ("sessions", "sessions"),
        ("suggest", "suggest"),
        ("most_sessions", "most_sessions"),
    )
    for flag, field in pairs:
        assert getattr(args, flag) == d[field], flag


# --- every recommendation the docs state -----------------------------------------------------------------


def _doc_plans(path: Path) -> list[tuple[list[str], str]]:
    """Each ``python -m cachelib plan`` command with a threshold in ``path``'s bash blocks, and the
    prose after the block up to the next one."""
    text = path.read_text()
    out = []
    for block in re.finditer(r"```bash\n(.*?)```", text, re.S):
        joined = block.group(1).replace("\\\n", " ")
        after = text[block.end() : text.find("```", block.end())]
        for line in joined.splitlines():
            if line.startswith("python -m cachelib plan") and ("--max-kl" in line or "--min-agreement" in line):
                out.append((shlex.split(line)[3:], after))
    return out


def _check_doc(path: Path, capsys) -> None:
    plans = _doc_plans(path)
    for argv, prose in plans:
        assert main(argv) == 0, argv
        out = capsys.readouterr().out
        picked = re.search(r"^recommendation: (\S+?):", out, re.M)
        assert picked, argv
        pick = picked.group(1)
        runtime = argv[argv.index("--runtime") + 1] if "--runtime" in argv else None
        assert runtime_flags(pick, runtime) is not None, (argv, pick)  # the runtime runs it natively
        said = re.findall(r"recommends `([^`]+)`|`([^`]+)` is recommended", prose)
        for a, b in said:
            assert parse_spec(a or b).key == parse_spec(pick).key, f"{path.name}: says {a or b}, the planner {pick}"


def test_every_recommendation_in_the_docs_holds_under_the_rules(capsys):
    checked = 0
    for path in sorted((ROOT / "docs").glob("*.md")):
        checked += len(_doc_plans(path))
        _check_doc(path, capsys)
    assert checked >= 1


def test_every_recommendation_in_the_readme_holds_under_the_rules(capsys):
    _check_doc(ROOT / "README.md", capsys)
