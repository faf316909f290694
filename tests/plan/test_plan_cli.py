"""``cachelib plan`` on the command line: the table, the CSV, and one-line errors with exit 2."""

from __future__ import annotations

import argparse
import csv
import json

import pytest

from cachelib.cli import plan as cli
from cachelib.core.units import GB
from cachelib.plan import PlanRequest, account, plan, preset


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="cachelib plan")
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(argv))


def test_table_lists_every_strategy_with_bytes_and_fit(capsys):
    rc = _run(
        [
            "--model",
            "llama-3.1-8b",
            "--context",
            "32768",
            "--strategy",
            "standard",
            "--strategy",
            "quantized:bits=4",
            "--budget",
            "80",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "llama-3.1-8b: 32 layers" in out and "weights             14.96 GiB" in out  # 16.06e9 bytes, bfloat16
    for term in ("cache peak", "activations peak", "runtime overhead", "reserve", "total"):
        assert f"  {term} " in out  # what "fits" counted
    lines = out.splitlines()
    standard = next(line for line in lines if line.startswith("standard "))
    assert "4.00 GiB" in standard and "yes" in standard  # 32768 x 131,072 bytes
    assert any(line.startswith("quantized:bits=4 ") and "1.12 GiB" in line for line in lines)
    assert "sessions can exceed the max batch" in out


def test_csv_holds_the_api_numbers(tmp_path, capsys):
    out = tmp_path / "plan.csv"
    rc = _run(
        [
            "--model",
            "tiny-gemma3",
            "--context",
            "3000",
            "--prefill",
            "1000",
            "--prefill-chunk",
            "256",
            "--strategy",
            "standard",
            "--strategy",
            "rotating:max_size=512,keep=4",
            "--backend",
            "torch",
            "--budget",
            "1GB",
            "--csv",
            str(out),
        ]
    )
    assert rc == 0
    rows = list(csv.DictReader(out.open()))
    assert [r["strategy"] for r in rows] == ["standard", "rotating:max_size=512,keep=4"]
    request = PlanRequest(
        ["standard", "rotating:max_size=512,keep=4"],
        context=3000,
        prefill=1000,
        prefill_chunk=256,
        backend="torch",
        budget_bytes=1 * GB,
    )
    fits = plan(preset("tiny-gemma3"), request)
    for row, fit in zip(rows, fits):
        assert int(row["bytes_allocated"]) == fit.cache.bytes_allocated
        assert int(row["peak_bytes"]) == fit.cache.peak_bytes
        assert int(row["budget_needed"]) == fit.budget_needed
        assert int(row["max_batch"]) == fit.max_batch
        assert row["context_limit"] == fit.context_limit
    assert set(rows[0]) == set(cli.CSV_COLUMNS)


def test_layers_flag_prints_each_layer_cache(capsys):
    assert _run(["--model", "tiny-gemma3", "--context", "100", "--layers"]) == 0
    out = capsys.readouterr().out
    assert "RotatingKVCache" in out and "KVCache" in out
    acc = account(preset("tiny-gemma3"), "standard", context=100)
    assert f"{acc.layers[0].tokens_held:>8}" in out


def test_config_json_path_works(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 512,
                "num_hidden_layers": 2,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
            }
        )
    )
    assert _run(["--model", str(path), "--context", "10"]) == 0
    assert "2 layers (2 full), 2 kv heads x 64" in capsys.readouterr().out


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    return err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "gpt-9", "--context", "10"], "unknown model 'gpt-9'"),
        (["--model", "llama-3.1-8b", "--context", "10", "--budget", "8"], "is below the weights on one device"),
        (
            ["--model", "qwen2.5-7b", "--context", "10", "--runtime", "vllm", "--tp", "8"],
            "tp=8: vllm requires the attention heads (28 in qwen2.5-7b) divisible by the tensor-parallel size",
        ),
        (["--model", "llama-3.1-8b", "--context", "10", "--tp", "2"], "tp=2: mlx-lm is planned on one device"),
        (["--model", "llama-3.1-8b", "--context", "10", "--weights-dtype", "q9"], "unknown weights dtype 'q9'"),
        (
            ["--model", "llama-3.1-8b", "--context", "10", "--solve", "bits"],
            "--solve bits needs --sessions N and --budget",
        ),
        (["--model", "llama-3.1-8b", "--context", "10", "--strategy", "rotating"], "knob 'max_size' is required"),
        (["--model", "llama-3.1-8b", "--context", "10", "--strategy", "offloaded"], "not available on mlx"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, argv, message):
    assert _run(argv) == 2
    assert message in _one_line_error(capsys)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--context", "0"], "argument --context: must be >= 1, got 0"),
        (["--context", "-3"], "argument --context: must be >= 1, got -3"),
        (["--context", "10", "--batch", "0"], "argument --batch: must be >= 1, got 0"),
        (["--context", "10", "--budget", "inf"], "argument --budget: must be a finite size >= 0, got 'inf'"),
        (["--context", "10", "--budget", "24GiBs"], "argument --budget: unknown unit 'GiBs'"),
    ],
)
def test_bad_numbers_are_refused_by_the_flag_with_the_range(capsys, argv, message):
    from cachelib.cli import main

    assert main(["plan", "--model", "llama-3.1-8b", *argv]) == 2
    assert message in _one_line_error(capsys)


def test_config_whose_heads_do_not_divide_exits_2(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 512,
                "num_hidden_layers": 2,
                "num_attention_heads": 8,
                "num_key_value_heads": 3,
            }
        )
    )
    assert _run(["--model", str(path), "--context", "10"]) == 2
    assert "num_attention_heads=8 is not divisible by num_key_value_heads=3" in _one_line_error(capsys)
