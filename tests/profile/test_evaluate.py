"""Long-context evaluation: chunked prefill then teacher-forced scoring against the full cache,
per window; its summary's confidence intervals; its file; its refusals; and, on the bundled
model, the quality orderings issue 11 requires (a bigger ring is better, sinks matter, 8-bit is
near-lossless)."""

from __future__ import annotations

import importlib
import math
import time

import numpy as np
import pandas as pd
import pytest

from cachelib.cli import main
from cachelib.profile import (
    Evaluation,
    EvaluationInterrupted,
    evaluate,
    load_evaluation,
    save_evaluation,
    teacher_forced_logits,
)
from cachelib.profile.evaluate import CORPUS, window_starts
from cachelib.profile.evaluation_file import SAMPLE_COLUMNS, SCHEMA, SUMMARY_COLUMNS, ci95, t_quantile_975, typed_frame

BACKENDS = ["mlx", "torch"]
TEXT = " ".join(f"The cache holds the keys and values of token number {i}, and the ring evicts." for i in range(300))
FOUR = ["standard", "concat", "rotating:max_size=32,keep=4", "quantized:bits=4"]


def _evaluate(loaded, strategies=FOUR, **kw):
    args = dict(texts=[("t", TEXT)], context=64, score_tokens=8, windows=2, prefill_chunk=16)
    return evaluate(loaded, strategies, **{**args, **kw})


@pytest.fixture(scope="module", params=BACKENDS)
def tiny(request):
    from cachelib.models import load

    return load("tiny-llama", request.param)


@pytest.fixture(scope="module")
def four(tiny):
    return _evaluate(tiny)


# --- what an evaluation holds ----------------------------------------------------------------------


def test_samples_hold_one_row_per_strategy_text_and_window_and_the_summary_one_per_strategy(tiny, four):
    s = four.samples
    assert list(s.columns) == list(SAMPLE_COLUMNS) and len(s) == 4 * 1 * 2
    assert list(s["strategy"].unique()) == FOUR and set(s["reference"]) == {"standard"}
    assert set(s["backend"]) == {tiny.backend} and set(s["model"]) == {"tiny-llama"}
    assert (s["context"] == 64).all() and (s["score_tokens"] == 8).all() and (s["prefill_chunk"] == 16).all()
    summary = four.summary()
    assert list(summary.columns) == list(SUMMARY_COLUMNS)
    assert list(summary["strategy"]) == FOUR and (summary["n"] == 2).all()
    assert four.complete and four.path is None


def test_the_reference_against_itself_has_zero_kl_and_full_agreement_and_a_lossless_cache_matches_it(four):
    s = four.samples.set_index("strategy")
    ref = s.loc["standard"]
    assert (ref["mean_kl"] == 0).all() and (ref["top1_agreement"] == 1).all() and (ref["delta_ppl"] == 0).all()
    assert (ref["nll"] == ref["nll_reference"]).all()
    np.testing.assert_allclose(ref["ppl"], np.exp(ref["nll"]))
    concat = s.loc["concat"]
    assert (concat["mean_kl"] < 1e-6).all() and (concat["top1_agreement"] == 1).all()
    ring = s.loc["rotating:max_size=32,keep=4"]
    assert (ring["mean_kl"] > 1e-3).all()  # it forgot half the context
    np.testing.assert_allclose(ring["delta_ppl"], ring["ppl"] - ring["ppl_reference"])


def test_kept_fraction_tokens_held_and_bytes_come_from_the_strategy_and_its_cache(four):
    s = four.samples.set_index("strategy")
    ring = s.loc["rotating:max_size=32,keep=4"]
    assert (ring["kept_fraction"] == 0.5).all() and (ring["tokens_held"] == 32).all()
    full = s.loc["standard"]
    assert (full["kept_fraction"] == 1.0).all() and (full["tokens_held"] == 64 + 8 - 1).all()
    quant = s.loc["quantized:bits=4"]
    assert quant["bytes_allocated"].max() < full["bytes_allocated"].min() and (quant["kept_fraction"] == 1).all()


def test_windows_are_distinct_and_evenly_spaced_and_span_the_text():
    assert window_starts(1000, 100, 4) == [0, 300, 600, 900]
    assert window_starts(100, 100, 1) == [0]
    assert window_starts(103, 100, 4) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"'t' is too short: it has 102 tokens and needs 103"):
        window_starts(102, 100, 4, "t")


def test_every_window_of_a_run_starts_elsewhere(four):
    starts = four.samples.groupby("strategy")["window_start"].apply(list)
    assert all(len(set(v)) == 2 for v in starts)


def test_chunked_prefill_gives_the_logits_of_a_one_chunk_prefill(tiny):
    from cachelib.profile.backends import probe_for
    from cachelib.spec import parse_spec

    probe = probe_for(tiny)
    ids = tiny.tokenizer.encode(TEXT)[:90]
    prefix, continuation = ids[:80], ids[80:]
    chunked = teacher_forced_logits(tiny, probe.make_cache(parse_spec("standard")), prefix, continuation, 16)
    whole = teacher_forced_logits(tiny, probe.make_cache(parse_spec("standard")), prefix, continuation, 4096)
    assert chunked.shape == (10, tiny.info.vocab_size) and chunked.dtype == np.float32
    np.testing.assert_allclose(chunked, whole, rtol=1e-4, atol=1e-4)


def test_a_list_without_a_lossless_first_strategy_gets_standard_in_front(tiny):
    ev = _evaluate(tiny, ["quantized:bits=8"], windows=1)
    assert list(ev.samples["strategy"]) == ["standard", "quantized:bits=8"]
    moved = _evaluate(tiny, ["quantized:bits=8", "standard"], windows=1)
    assert list(moved.samples["strategy"]) == ["standard", "quantized:bits=8"]


def test_several_contexts_go_into_one_evaluation(tiny):
    ev = _evaluate(tiny, ["standard", "rotating:max_size=32,keep=4"], context=[32, 64], windows=1)
    assert list(ev.summary()["context"]) == [32, 32, 64, 64]
    ring = ev.summary().set_index(["strategy", "context"])["kept_fraction"]
    assert ring[("rotating:max_size=32,keep=4", 32)] == 1.0 and ring[("rotating:max_size=32,keep=4", 64)] == 0.5


# --- confidence intervals ------------------------------------------------------------------------


def test_ci95_is_the_student_t_half_width_over_the_values():
    # mean 2.5, sd 1.2910, n 4: t(0.975, 3) = 3.1824 -> 3.1824 * 1.2910 / 2
    assert ci95([1, 2, 3, 4]) == pytest.approx(2.0543, abs=1e-4)
    assert ci95([5.0, 5.0, 5.0]) == 0.0
    assert math.isnan(ci95([1.0])) and math.isnan(ci95([]))
    assert t_quantile_975(1) == pytest.approx(12.706, abs=1e-3)
    assert t_quantile_975(30) == pytest.approx(2.0423, abs=1e-4)
    assert t_quantile_975(31) == pytest.approx(2.0395, abs=1e-3)  # the expansion beyond the table
    assert t_quantile_975(1000) == pytest.approx(1.9623, abs=1e-3)
    assert t_quantile_975(31) < t_quantile_975(30)


def test_the_summary_means_windows_and_gives_their_interval_and_nan_for_one_window():
    rows = [
        {
            "model": "m",
            "backend": "mlx",
            "dtype": "float32",
            "strategy": "quantized:bits=4",
            "context": 64,
            "score_tokens": 8,
            "prefill_chunk": 16,
            "text": "t",
            "window_start": i,
            "mean_kl": kl,
            "top1_agreement": 0.5,
            "nll": 1.0,
            "nll_reference": 1.0,
            "ppl": math.e + d,
            "ppl_reference": math.e,
            "delta_ppl": d,
            "kept_fraction": 1.0,
        }
        for i, (kl, d) in enumerate([(1.0, 0.1), (2.0, 0.2), (3.0, 0.3), (4.0, 0.4)])
    ]
    summary = Evaluation(typed_frame(rows, "sample")).summary().iloc[0]
    assert summary["n"] == 4 and summary["mean_kl"] == 2.5
    assert summary["mean_kl_ci95"] == pytest.approx(2.0543, abs=1e-4)
    assert summary["delta_ppl"] == pytest.approx(0.25) and summary["top1_ci95"] == 0.0
    assert summary["delta_ppl"] == pytest.approx(summary["ppl"] - summary["ppl_reference"])
    one = Evaluation(typed_frame(rows[:1], "sample")).summary().iloc[0]
    assert one["n"] == 1 and math.isnan(one["mean_kl_ci95"]) and math.isnan(one["delta_ppl_ci95"])


# --- the file --------------------------------------------------------------------------------------


def test_an_evaluation_round_trips_through_its_csv_exactly(four, tmp_path):
    path = save_evaluation(four, tmp_path / "ev.csv")
    assert path.read_text().splitlines()[0].startswith("schema,kind,")
    back = load_evaluation(path)
    pd.testing.assert_frame_equal(back.samples, four.samples, check_exact=True)
    pd.testing.assert_frame_equal(back.summary(), four.summary(), check_exact=True)
    assert back.complete and back.path == path and len(back.retrieval) == 0


def test_retrieval_rows_and_extra_columns_share_the_file(four, tmp_path):
    retrieval = typed_frame(
        [
            {
                "model": "tiny-llama",
                "strategy": "standard",
                "context": 64,
                "task": "passkey",
                "depth": 0.25,
                "exact_match": 1.0,
                "trial": 3,
            }
        ],
        "retrieval",
    )
    ev = Evaluation(four.samples, retrieval)
    back = load_evaluation(save_evaluation(ev, tmp_path / "both.csv"))
    pd.testing.assert_frame_equal(back.samples, four.samples, check_exact=True)
    pd.testing.assert_frame_equal(back.retrieval, retrieval, check_exact=True, check_dtype=False)
    assert back.retrieval["trial"].iloc[0] == 3 and math.isnan(back.retrieval["mean_kl"].iloc[0])


def test_a_text_a_spreadsheet_would_run_is_written_inert_and_reads_back_as_it_was(four, tmp_path):
    samples = four.samples.copy()
    samples["text"] = '=HYPERLINK("x")'
    samples["model"] = "'quoted"
    path = save_evaluation(Evaluation(typed_frame(samples, "sample")), tmp_path / "ev.csv")
    assert "'=HYPERLINK" in path.read_text() and "''quoted" in path.read_text()
    back = load_evaluation(path).samples
    assert set(back["text"]) == {'=HYPERLINK("x")'} and set(back["model"]) == {"'quoted"}


def test_a_file_of_another_schema_is_refused_naming_it(tmp_path, four):
    path = save_evaluation(four, tmp_path / "ev.csv")
    other = tmp_path / "v2.csv"
    other.write_text(path.read_text().replace(SCHEMA, "cachelib-evaluation/2"))
    with pytest.raises(ValueError, match=r"v2\.csv: evaluation schema cachelib-evaluation/2 is not supported"):
        load_evaluation(other)
    profile_like = tmp_path / "profile.csv"
    profile_like.write_text("table,key,value\nmeta,schema_version,1\n")
    with pytest.raises(ValueError, match=r"profile\.csv: not a cachelib evaluation"):
        load_evaluation(profile_like)
    with pytest.raises(ValueError, match=r"nope\.csv: no such evaluation file"):
        load_evaluation(tmp_path / "nope.csv")


def test_out_is_written_atomically_and_an_interrupted_run_never_replaces_it(tiny, tmp_path):
    out = tmp_path / "ev.csv"
    out.write_text("schema,kind\ncachelib-evaluation/1,sample\n")  # an earlier result (an evaluation file)
    seen = []

    def ctrl_c(step):
        seen.append(step)
        if step.done == 3:
            raise KeyboardInterrupt

    with pytest.raises(EvaluationInterrupted) as info:
        _evaluate(tiny, out=out, on_progress=ctrl_c)
    assert out.read_text() == "schema,kind\ncachelib-evaluation/1,sample\n"
    partial = info.value.evaluation
    assert partial.status == "incomplete" and "interrupted (Ctrl-C) after 3 of 8" in partial.reason
    assert partial.path == tmp_path / "ev.incomplete.csv"
    assert len(load_evaluation(partial.path).samples) == 3 and load_evaluation(partial.path).status == "incomplete"
    assert [s.done for s in seen] == [1, 2, 3] and all(s.total == 8 for s in seen)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left

    # the same call resumes: the 3 rows are not measured again, 2 more are, and it stops
    stopped = _evaluate(tiny, out=out, should_stop=lambda: len(seen) >= 5, on_progress=seen.append)
    assert not stopped.complete and "stopped by request" in stopped.reason and out.read_text().startswith("schema")
    assert len(stopped.samples) == 5 and [s.done for s in seen[3:]] == [4, 5]
    assert not stopped.samples.duplicated(["strategy", "text", "window_start"]).any()
    done = _evaluate(tiny, ["standard"], out=out, windows=1)
    assert done.path == out and len(load_evaluation(out).samples) == 1


# --- refused before the model loads ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"context": 0}, r"context must be an integer >= 1, got 0"),
        ({"context": [64, 64]}, r"context 64 is listed twice"),
        ({"score_tokens": 0}, r"score_tokens must be an integer >= 1, got 0"),
        ({"windows": 0}, r"windows must be an integer >= 1, got 0"),
        ({"prefill_chunk": -1}, r"prefill_chunk must be an integer >= 1, got -1"),
        ({"strategies": ["rotatin:max_size=4"]}, r"unknown strategy 'rotatin'"),
        ({"strategies": ["standard", "quantized:bits=4", "quantized:bits=4,group_size=64"]}, r"listed twice"),
        ({"strategies": ["offloaded"]}, r"'offloaded' is not available on mlx"),
        ({"strategies": ["static:max_len=64"]}, r"static:max_len=64 holds at most 64 tokens"),
        ({"texts": ["/no/such/text.txt"]}, r"evaluation text '/no/such/text.txt' not found"),
        ({"texts": [("t", "  ")]}, r"evaluation text 't' is empty"),
        ({"out": "ev.parquet"}, r"use a \.csv name"),
    ],
)
def test_bad_input_is_refused_before_the_model_loads(kwargs, message):
    args = {"strategies": ["standard"], "texts": [("t", TEXT)], "context": 64, **kwargs}
    strategies = args.pop("strategies")
    with pytest.raises(ValueError, match=message):
        evaluate("no-such-model", strategies, **args)  # the model would fail to load: nothing got that far


def test_without_texts_and_without_a_corpus_it_says_to_pass_texts(monkeypatch, tmp_path):
    module = importlib.import_module("cachelib.profile.evaluate")  # the attribute is the function

    monkeypatch.setattr(module, "CORPUS", tmp_path / "corpus")
    with pytest.raises(ValueError, match=r"no evaluation corpus at .*corpus.*pass texts="):
        evaluate("no-such-model", ["standard"], context=64)


def test_contexts_beyond_the_model_limit_and_texts_too_short_are_refused(tiny):
    limit = r"context 5000 is beyond tiny-llama's limit of 4096 positions \(allowed: 1\.\.4096\)"
    with pytest.raises(ValueError, match=limit):
        _evaluate(tiny, context=5000)
    with pytest.raises(ValueError, match=r"context 4090 \+ score_tokens 8 .* use context <= 4089"):
        _evaluate(tiny, context=4090)
    short = TEXT[:2000]
    n = len(tiny.tokenizer.encode(short))
    with pytest.raises(ValueError, match=rf"text 't' is too short: it has {n} tokens and needs {1000 + 8 + 1}"):
        _evaluate(tiny, texts=[("t", short)], context=1000)


# --- the command line --------------------------------------------------------------------------------


def test_the_cli_prints_one_line_per_strategy_and_context_and_writes_the_csv(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    out = tmp_path / "ev.csv"
    argv = [
        "evaluate",
        "--model",
        "tiny-llama",
        "--strategy",
        "standard",
        "--strategy",
        "rotating:max_size=32,keep=4",
        "--context",
        "32",
        "--context",
        "64",
        "--score-tokens",
        "4",
        "--windows",
        "2",
        "--prefill-chunk",
        "16",
        "--text",
        str(text),
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if "rotating" in line or line.strip().split()[1:2] == ["standard"]]
    assert len(rows) == 4 and "mean KL" in lines[0] and "Δppl" in lines[0]
    assert "50.0%" in next(line for line in rows if line.split()[0] == "64" and "rotating" in line)
    assert lines[-1] == f"evaluation: {out}"
    assert set(load_evaluation(out).samples["context"]) == {32, 64}


def test_the_cli_says_n_a_for_one_window_and_exits_2_on_bad_input(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    base = ["evaluate", "--model", "tiny-llama", "--text", str(text), "--score-tokens", "4"]
    assert main(base + ["--context", "16", "--windows", "1"]) == 0
    assert "n/a (n=1)" in capsys.readouterr().out
    for bad in (["--context", "0"], ["--context", "99999"], ["--context", "16", "--strategy", "bogus"]):
        assert main(base + bad) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ")


# --- the bundled model: the orderings issue 11 requires ----------------------------------------------

ORDERING = [
    "standard",
    "rotating:max_size=256,keep=4",
    "rotating:max_size=1024,keep=4",
    "rotating:max_size=256,keep=0",
    "quantized:bits=8",
]
CORPUS_TEXT = CORPUS / "pride-and-prejudice.txt"


@pytest.fixture(scope="module")
def bundled_2048(smollm2_torch):
    # on torch: MLX's CPU quantized attention makes the same run ~4x slower (452 s against 106 s)
    if not CORPUS_TEXT.exists():
        pytest.skip(f"the evaluation corpus is missing ({CORPUS_TEXT}); these orderings are measured on it")
    start = time.perf_counter()
    ev = evaluate(smollm2_torch, ORDERING, texts=[CORPUS_TEXT], context=2048, score_tokens=32, windows=2)
    return ev, time.perf_counter() - start


@pytest.mark.bundled
@pytest.mark.slow
def test_at_2048_tokens_a_ring_of_256_drifts_further_than_a_ring_of_1024(bundled_2048):
    kl = bundled_2048[0].summary().set_index("strategy")["mean_kl"]
    assert kl["rotating:max_size=256,keep=4"] > kl["rotating:max_size=1024,keep=4"]


@pytest.mark.bundled
@pytest.mark.slow
def test_at_2048_tokens_a_ring_without_sink_tokens_is_worse_than_one_with_four(bundled_2048):
    kl = bundled_2048[0].summary().set_index("strategy")["mean_kl"]
    assert kl["rotating:max_size=256,keep=0"] > kl["rotating:max_size=256,keep=4"]


@pytest.mark.bundled
@pytest.mark.slow
def test_at_2048_tokens_8_bit_quantized_stays_within_kl_0_01_of_the_full_cache(bundled_2048):
    summary = bundled_2048[0].summary().set_index("strategy")
    assert summary.loc["quantized:bits=8", "mean_kl"] < 0.01
    assert summary.loc["standard", "mean_kl"] == 0 and (summary["n"] == 2).all()
