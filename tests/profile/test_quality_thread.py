"""The quality probe off the step's critical path (issue #34): its arithmetic runs in one background
thread while the step goes on, and what a profile records is what computing it inline records, bit
for bit; a run that fails mid-way still records every step it finished, quality numbers included."""

from __future__ import annotations

import threading
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import numpy as np
import pytest

from cachelib.profile import Probes, load_profile, run_profile
from cachelib.profile import run as run_module
from cachelib.profile.divergence import Baseline, compare

BACKENDS = ["mlx", "torch"]
PROMPT = "Explain what a KV cache is, and why it matters for serving language models."
# a quantized, a ring and an importance strategy beside the baseline
STRATEGIES = ["standard", "quantized:bits=4,group_size=32", "rotating:max_size=12,keep=2", "tova:budget=10"]
QUALITY = ["kl", "top1_agree", "logprob_target"]


class _Inline(Executor):
    """Runs each task as it is submitted, in the caller's thread: the quality probe computed inline."""

    def submit(self, fn, /, *args, **kwargs):
        future = Future()
        future.set_result(fn(*args, **kwargs))
        return future


class _AllInTheThread(ThreadPoolExecutor):
    """The run's pool, but each task has started in the thread before ``submit`` returns: none is
    left for the step to take back, so every number is computed off the main thread."""

    def __init__(self):
        super().__init__(max_workers=1, thread_name_prefix="cachelib-quality")

    def submit(self, fn, /, *args, **kwargs):
        started = threading.Event()

        def task():
            started.set()
            return fn(*args, **kwargs)

        future = super().submit(task)
        started.wait()
        return future


def _quality_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("cachelib-quality")]


@pytest.mark.parametrize("one_by_one", [False, True], ids=["strategy batch", "one by one"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_threaded_quality_probe_records_the_numbers_computed_inline(
    backend, one_by_one, load_model, monkeypatch, tmp_path
):
    loaded = load_model("tiny-llama", backend)
    where: set[str] = set()

    class Traced(Baseline):
        __slots__ = ()

        def __init__(self, logits):
            where.add(threading.current_thread().name)
            super().__init__(logits)

    monkeypatch.setattr(run_module, "Baseline", Traced)

    def profile(out: str):
        return run_profile(loaded, STRATEGIES, prompt=PROMPT, max_tokens=10, one_by_one=one_by_one, out=tmp_path / out)

    threaded = profile("threaded.csv")
    assert not _quality_threads()  # the run gave its thread back
    where.clear()
    monkeypatch.setattr(run_module, "_quality_pool", _AllInTheThread)
    in_thread = profile("in_thread.csv")
    assert where and all(name.startswith("cachelib-quality") for name in where)
    where.clear()
    monkeypatch.setattr(run_module, "_quality_pool", _Inline)
    inline = profile("inline.csv")
    assert where == {threading.current_thread().name}

    for got in (threaded, load_profile(threaded.path), in_thread):
        a, b = got.frame("steps"), inline.frame("steps")
        assert a[QUALITY].notna().all().all() and len(a) == 10 * len(STRATEGIES)
        for column in QUALITY:  # the same numbers, bit for bit (NaN never appears: checked above)
            assert a[column].tolist() == b[column].tolist(), column
    assert (inline.frame("steps")["kl"] > 0).any()  # the strategies do differ from the baseline here


def test_rows_that_come_before_the_baseline_are_compared_once_it_comes():
    rng = np.random.default_rng(34)
    rows = (rng.standard_normal((4, 4096)) * 4).astype(np.float32)
    rows[3] = rows[0]  # a row with the baseline's very logits
    pool = run_module._quality_pool()
    try:
        quality = run_module._StepQuality(pool)
        for row in (2, 3, 0, 1):  # the baseline third, as when it runs by its own forward after a batch
            quality.add(row, rows[row], 7 if row == 0 else None)
        numbers = quality.results()
    finally:
        pool.shutdown()
    base = Baseline(rows[0])
    assert numbers == {0: (0.0, True, base.logprob(7)), **{r: compare(base, rows[r], 7) for r in (1, 2, 3)}}


def test_what_a_busy_thread_has_not_started_is_computed_by_the_step_itself():
    """On a loaded machine the thread may get no core before the step needs its numbers: the step
    takes back the tasks not started and computes them itself (same numbers) instead of waiting."""
    rng = np.random.default_rng(7)
    rows = (rng.standard_normal((3, 4096)) * 4).astype(np.float32)
    pool = run_module._quality_pool()
    busy = threading.Event()
    try:
        pool.submit(busy.wait, 60)  # the thread's one core is taken: nothing of the step starts
        quality = run_module._StepQuality(pool)
        for row in range(3):
            quality.add(row, rows[row], 5 if row == 0 else None)
        numbers = quality.results()  # returns without the thread (a wait would last 60 s)
        assert all(future.cancelled() for _, future, _, _ in quality.tasks)
    finally:
        busy.set()
        pool.shutdown()
    base = Baseline(rows[0])
    assert numbers == {0: (0.0, True, base.logprob(5)), 1: compare(base, rows[1], 5), 2: compare(base, rows[2], 5)}


def test_a_step_whose_baseline_never_came_is_refused():
    pool = run_module._quality_pool()
    try:
        quality = run_module._StepQuality(pool)
        quality.add(1, np.zeros(8, dtype=np.float32), None)
        with pytest.raises(RuntimeError, match="baseline"):
            quality.results()
    finally:
        pool.shutdown()


@pytest.mark.parametrize("where", ["quality thread", "forward"])
@pytest.mark.parametrize("one_by_one", [False, True], ids=["strategy batch", "one by one"])
def test_an_error_mid_run_still_records_the_finished_steps(where, one_by_one, load_model, monkeypatch, tmp_path):
    loaded = load_model("tiny-llama", "mlx")
    failing_step = 3
    if where == "quality thread":
        calls = {"n": 0}

        def failing_compare(baseline, logits, target):
            calls["n"] += 1  # (len(STRATEGIES) - 1) comparisons a step: this is step 3's last
            if calls["n"] == (failing_step + 1) * (len(STRATEGIES) - 1):
                raise FloatingPointError("the probe failed")
            return compare(baseline, logits, target)

        monkeypatch.setattr(run_module, "compare", failing_compare)
    else:
        before_step = run_module.before_step

        def failing_before(at, st, n):
            if at.step == failing_step and st.label == STRATEGIES[-1]:  # one by one: the others' quality is in flight
                raise FloatingPointError("the forward failed")
            return before_step(at, st, n)

        monkeypatch.setattr(run_module, "before_step", failing_before)

    with pytest.raises(FloatingPointError):
        run_profile(
            loaded,
            STRATEGIES,
            prompt=PROMPT,
            max_tokens=8,
            probes=Probes(),
            one_by_one=one_by_one,
            out=tmp_path / "run.csv",
        )
    assert not _quality_threads()
    (path,) = tmp_path.glob("*.csv")
    profile = load_profile(path)
    assert profile.meta["status"] == "incomplete" and int(profile.meta["steps_completed"]) == failing_step
    assert f"error during step {failing_step}: FloatingPointError" in profile.meta["reason"]
    steps = profile.frame("steps")
    assert sorted(set(steps["step"])) == list(range(failing_step))
    assert len(steps) == failing_step * len(STRATEGIES) and steps[QUALITY].notna().all().all()
    assert set(profile.frame("layers")["step"]) == set(range(failing_step))
