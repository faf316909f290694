"""The quality probe (issue #34): a step's rows computed together, inline, once the step's
forwards are done (:class:`~cachelib.profile.divergence.StepQuality`). Its KL is the textbook
``sum p*(log p - log q)`` rearranged, and its target log-prob the textbook's arithmetic with torch's
float64 ``exp`` and sums: both within 1e-12 of the textbook float64 form (NumPy's); top-1 agreement
is the textbook's own; a row with the baseline's very logits gives exactly 0.0, and a row's numbers
do not depend on the rows computed with it (a batched ``torch.mv`` of every row broke that). A run
that fails mid-way still records every step it finished."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from decode_helpers import textbook_quality

from cachelib.profile import Probes, load_profile, run_profile
from cachelib.profile import run as run_module
from cachelib.profile.divergence import StepQuality

BACKENDS = ["mlx", "torch"]
PROMPT = "Explain what a KV cache is, and why it matters for serving language models."
# a quantized, a ring and an importance strategy beside the baseline
STRATEGIES = ["standard", "quantized:bits=4,group_size=32", "rotating:max_size=12,keep=2", "tova:budget=10"]
QUALITY = ["kl", "top1_agree", "logprob_target"]
KL_TOLERANCE = 1e-12  # nats, absolute
LOGPROB_TOLERANCE = 1e-12  # nats, absolute (the exp and the sums are torch's, the textbook's NumPy's)


_textbook = textbook_quality


def _assert_textbook(numbers, rows, target):
    for row, (kl, agree, logprob) in zip(rows, numbers):
        want_kl, want_agree, want_logprob = _textbook(rows[0], row, target)
        assert abs(kl - want_kl) <= KL_TOLERANCE, (kl, want_kl)
        assert agree == want_agree
        assert (logprob is None) == (want_logprob is None)
        if logprob is not None:
            assert abs(logprob - want_logprob) <= LOGPROB_TOLERANCE, (logprob, want_logprob)


@pytest.mark.parametrize("target", [7, None])
def test_a_steps_numbers_are_the_textbooks(target):
    rng = np.random.default_rng(34)
    base = (rng.standard_normal(4096) * 4).astype(np.float32)
    rows = [base] + [
        base + (rng.standard_normal(4096) * scale).astype(np.float32) for scale in (1e-6, 1e-3, 0.05, 0.5, 2.0, 8.0)
    ]
    rows += [base * 1.5, base + 60.0, -base]  # sharper, shifted (the same distribution), reversed
    quality = StepQuality()
    numbers = quality(rows, target)
    _assert_textbook(numbers, rows, target)
    assert numbers[0][:2] == (0.0, True)
    assert numbers[-2][0] < KL_TOLERANCE and numbers[-1][0] > 1  # a shift leaves the distribution as it is
    wider = [np.concatenate([r, r[:100]]) for r in rows]  # another vocabulary: the buffers follow it
    _assert_textbook(quality(wider, target), wider, target)
    assert quality(rows, target) == numbers  # the same numbers from a reused StepQuality


def test_a_row_with_the_baselines_logits_gives_exactly_zero():
    rng = np.random.default_rng(5)
    base = (rng.standard_normal(49152) * 6).astype(np.float32)
    near = base.copy()
    near[123] = np.nextafter(near[123], np.float32(np.inf))  # one logit one float apart
    numbers = StepQuality()([base, base.copy(), near, base], 11)
    assert numbers[1] == numbers[3] == numbers[0] == (0.0, True, numbers[0][2])
    assert numbers[2][0] >= 0.0 and numbers[2][0] < 1e-9


@pytest.mark.parametrize("one_by_one", [False, True], ids=["strategy batch", "one by one"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_runs_quality_numbers_are_the_textbooks_on_its_logits(backend, one_by_one, load_model, monkeypatch):
    loaded = load_model("tiny-llama", backend)
    seen: list[tuple[list[np.ndarray], int]] = []  # each step's rows (row order) and its target
    results = run_module._StepQuality.results

    def recorded(self):
        seen.append(([np.array(self.logits[r]) for r in range(len(STRATEGIES))], self.target))
        return results(self)

    monkeypatch.setattr(run_module._StepQuality, "results", recorded)
    profile = run_profile(loaded, STRATEGIES, prompt=PROMPT, max_tokens=10, one_by_one=one_by_one)
    steps = profile.frame("steps")
    assert steps[QUALITY].notna().all().all() and len(seen) == 10
    for step, (rows, target) in enumerate(seen):
        got = steps[steps["step"] == step].set_index("strategy").loc[STRATEGIES]
        _assert_textbook(zip(got["kl"], got["top1_agree"], got["logprob_target"]), rows, target)
        assert target == int(np.argmax(rows[0]))  # teacher-forced from a prompt: the baseline's greedy token
    assert (steps["kl"] > 0).any()  # the strategies do differ from the baseline here


def test_rows_that_come_before_the_baseline_are_compared_once_it_comes():
    rng = np.random.default_rng(34)
    rows = (rng.standard_normal((4, 4096)) * 4).astype(np.float32)
    rows[3] = rows[0]  # a row with the baseline's very logits
    quality = run_module._StepQuality(StepQuality())
    for row in (2, 3, 0, 1):  # the baseline third, as when it runs by its own forward after a batch
        quality.add(row, rows[row], 7 if row == 0 else None)
    assert quality.results() == dict(enumerate(StepQuality()(list(rows), 7)))


def test_a_rows_numbers_do_not_depend_on_the_rows_computed_with_it():
    """Alone, or among others in any order: the same numbers, bit for bit, at the bundled model's
    vocabulary (large enough for torch to split a row's sums between threads)."""
    rng = np.random.default_rng(7)
    base = (rng.standard_normal(49152) * 5).astype(np.float32)
    others = [base + (rng.standard_normal(49152) * s).astype(np.float32) for s in np.linspace(0.01, 3, 20)]
    quality = StepQuality()
    alone = [quality([base, x], 3)[1] for x in others]
    assert quality([base, *others], 3)[1:] == alone
    order = rng.permutation(len(others))
    assert quality([base, *(others[i] for i in order)], 3)[1:] == [alone[i] for i in order]
    assert quality([base, others[4], base.copy(), others[9]], 3)[1::2] == [alone[4], alone[9]]


def test_read_only_logits_give_the_same_numbers_and_no_warning():
    """In a fresh process: torch warns about a read-only array once a process, then never again."""
    code = (
        "import numpy as np\n"
        "from cachelib.profile.divergence import StepQuality\n"
        "rng = np.random.default_rng(3)\n"
        "rows = [(rng.standard_normal(4096) * 4).astype(np.float32) for _ in range(3)]\n"
        "frozen = [r.copy() for r in rows]\n"
        "for r in frozen:\n"
        "    r.setflags(write=False)\n"
        "assert StepQuality()(frozen, 5) == StepQuality()(rows, 5)\n"
    )
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_step_whose_baseline_never_came_is_refused():
    quality = run_module._StepQuality(StepQuality())
    quality.add(1, np.zeros(8, dtype=np.float32), None)
    with pytest.raises(RuntimeError, match="baseline"):
        quality.results()


@pytest.mark.parametrize("where", ["quality probe", "forward"])
@pytest.mark.parametrize("one_by_one", [False, True], ids=["strategy batch", "one by one"])
def test_an_error_mid_run_still_records_the_finished_steps(where, one_by_one, load_model, monkeypatch, tmp_path):
    loaded = load_model("tiny-llama", "mlx")
    failing_step = 3
    if where == "quality probe":
        calls = {"n": 0}
        compute = StepQuality.__call__

        def failing(self, rows, target, tops=None):
            calls["n"] += 1  # once a step
            if calls["n"] == failing_step + 1:
                raise FloatingPointError("the probe failed")
            return compute(self, rows, target, tops)

        monkeypatch.setattr(StepQuality, "__call__", failing)
    else:
        before_step = run_module.before_step

        def failing_before(at, st, n):
            if at.step == failing_step and st.label == STRATEGIES[-1]:
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
    (path,) = tmp_path.glob("*.csv")
    profile = load_profile(path)
    assert profile.meta["status"] == "incomplete" and int(profile.meta["steps_completed"]) == failing_step
    assert f"error during step {failing_step}: FloatingPointError" in profile.meta["reason"]
    steps = profile.frame("steps")
    assert sorted(set(steps["step"])) == list(range(failing_step))
    assert len(steps) == failing_step * len(STRATEGIES) and steps[QUALITY].notna().all().all()
    assert set(profile.frame("layers")["step"]) == set(range(failing_step))
