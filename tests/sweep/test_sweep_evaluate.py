"""Evaluation grids: a grid with `contexts` expands into one `evaluate` run per model x backend x
device x context x knob setting, refuses keys that belong to profile grids, and its points run,
are written, and are skipped on a re-run like profile points."""

from __future__ import annotations

import pandas as pd
import pytest

from cachelib.profile import evaluate, load_evaluation
from cachelib.sweep import GridError, parse_grid, plan_sweep, run_sweep
from cachelib.sweep.grid import EvaluationPoint
from cachelib.sweep.run import run_point

TEXT = " ".join(f"The cache holds the keys and values of token number {i}." for i in range(400))

EVAL = """\
models = ["tiny-llama"]
devices = ["cpu"]
strategies = [{ name = "rotating", max_size = [32, 64], keep = 4 }, "quantized:bits=8"]
texts = ["t.txt"]
contexts = [64, 128]
score_tokens = 8
windows = 2
prefill_chunk = 32
"""


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "t.txt").write_text(TEXT, encoding="utf-8")
    return tmp_path


def _grid(folder, text=EVAL):
    path = folder / "grid.toml"
    path.write_text(text, encoding="utf-8")
    return parse_grid(text, path)


def test_an_evaluation_grid_has_one_point_per_model_backend_device_context_and_setting(folder):
    g = _grid(folder, EVAL.replace('devices = ["cpu"]', 'backends = ["mlx", "torch"]\ndevices = ["cpu"]'))
    assert g.kind == "evaluation"
    points = g.points()
    assert all(isinstance(p, EvaluationPoint) for p in points)
    assert len(points) == 2 * 2 * 2  # backends x contexts x settings
    assert [(p.backend, p.context, p.setting) for p in points[:4]] == [
        ("mlx", 64, 0),
        ("mlx", 64, 1),
        ("mlx", 128, 0),
        ("mlx", 128, 1),
    ]
    assert [str(s) for s in points[1].strategies] == ["standard", "rotating:max_size=64,keep=4", "quantized:bits=8"]
    assert len({p.id for p in points}) == len(points)
    kwargs = points[0].run_kwargs()
    assert kwargs["texts"] == [("t", TEXT)] and kwargs["context"] == 64
    assert (kwargs["score_tokens"], kwargs["windows"], kwargs["prefill_chunk"]) == (8, 2, 32)
    assert points[0].id.startswith("tiny-llama-mlx-cpu-eval-64c-")
    # another scoring setting is another run, so another file
    other = _grid(folder, EVAL.replace("score_tokens = 8", "score_tokens = 9")).points()
    assert other[0].id != points[0].id


def test_an_evaluation_grid_without_texts_uses_the_corpus(folder):
    from cachelib.profile.evaluate import CORPUS

    if not list(CORPUS.glob("*.txt")):
        pytest.skip(f"no evaluation corpus at {CORPUS}")
    g = _grid(folder, EVAL.replace('texts = ["t.txt"]\n', ""))
    names = [t.source for t in g.inputs]
    assert names == [f"assets/corpus/{p.name}" for p in sorted(CORPUS.glob("*.txt"))]


def test_profile_grids_are_unchanged_and_refuse_evaluation_keys(folder):
    profile = _grid(folder, 'models = ["tiny-llama"]\nprompts = ["hi"]\nstrategies = ["concat"]\n')
    assert profile.kind == "profile" and not isinstance(profile.points({"mlx": "cpu"})[0], EvaluationPoint)
    with pytest.raises(GridError, match=r"grid.toml:4: 'windows' is for evaluation grids; add 'contexts'"):
        _grid(folder, 'models = ["tiny-llama"]\nprompts = ["hi"]\nstrategies = ["concat"]\nwindows = 2\n')


@pytest.mark.parametrize(
    ("change", "line", "message"),
    [
        (("score_tokens = 8", "max_tokens = 8"), 6, "'max_tokens' is for profile grids"),
        (("contexts = [64, 128]", "contexts = [64, 0]"), 5, "'contexts' must be >= 1, got 0"),
        (("contexts = [64, 128]", "contexts = []"), 5, "'contexts' is an empty list"),
        (("windows = 2", "windows = 0"), 7, "'windows' must be >= 1"),
        (('devices = ["cpu"]', 'devices = ["cpu"]\nbaseline = "quantized:bits=4"'), 3, "not a full cache"),
        (('"quantized:bits=8"', '"static:max_len=100"'), 3, "static:max_len=100 holds at most 100 tokens"),
    ],
)
def test_bad_evaluation_grids_are_refused_with_the_line(folder, change, line, message):
    with pytest.raises(GridError) as info:
        _grid(folder, EVAL.replace(*change))
    assert info.value.line == line and message in info.value.reason


def test_a_point_runs_evaluate_and_its_file_is_skipped_on_a_rerun(folder):
    g = _grid(folder, EVAL.replace("contexts = [64, 128]", "contexts = [64]"))
    point = g.points()[0]
    res = run_point(point)
    assert res["status"] == "complete" and res["reason"] == ""
    out = folder / "sweep"
    out.mkdir()
    (out / point.file).write_bytes(res["csv"])
    got = load_evaluation(out / point.file)
    same = evaluate(
        "tiny-llama",
        [str(s) for s in point.strategies],
        texts=[("t", TEXT)],
        context=64,
        score_tokens=8,
        windows=2,
        prefill_chunk=32,
        device="cpu",
    )
    cols = ["strategy", "window_start", "mean_kl", "top1_agreement", "nll", "tokens_held", "bytes_allocated"]
    pd.testing.assert_frame_equal(got.samples[cols], same.samples[cols])
    plan = plan_sweep(g, out)
    assert point.id not in {p.id for p in plan.todo}  # adopted: the file is there, though the index is not
    assert plan.rows[point.id]["status"] == "done" and plan.rows[point.id]["mode"] == "evaluation"


@pytest.mark.slow
def test_an_evaluation_sweep_on_a_local_cluster_writes_one_evaluation_per_point_and_resumes(folder):
    g = _grid(folder, EVAL.replace("contexts = [64, 128]", "contexts = [64]"))
    out = folder / "sweep"
    first = run_sweep(g, out, workers=1)
    assert first.ok and first.count("done") == 2
    for row in first.rows:
        ev = load_evaluation(out / row["file"])
        assert ev.complete and set(ev.samples["context"]) == {64} and len(ev.samples) == 3 * 2
    events = []
    second = run_sweep(g, out, workers=1, on_event=events.append)
    assert second.ok and not [e for e in events if e.kind == "started"]  # nothing ran again
