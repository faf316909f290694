"""A strategy batch's first chunk forwarded once (torch ``RowsCache.advance_once``): rows whose
caches hand back what they are given take the chunk from one row's forward, and every logit,
cache and evaluation number is the batch's own, bit for bit; rows that hand back anything else
are put back and run as one batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cachelib.decode import Runner
from cachelib.profile import evaluate
from cachelib.profile.backends import probe_for
from cachelib.profile.evaluate import teacher_forced_logits_rows
from cachelib.spec import parse_spec
from cachelib.torch.rows import RowsCache

TEXT = " ".join(f"The cache holds the keys and values of token number {i}, and the ring evicts." for i in range(300))
IDS = list(range(5, 80))
PREFIX, CONTINUATION = IDS[:64], IDS[64:72]


@pytest.fixture(scope="module")
def tiny():
    from cachelib.models import load

    return load("tiny-llama", "torch")


@pytest.fixture
def spy(monkeypatch):
    """Every advance_once's answer, in order; ``spy.off()`` makes it decline (today's path)."""

    class Answers(list):
        def off(self) -> None:
            monkeypatch.setattr(RowsCache, "advance_once", lambda self, model, ids: False)

    answers, original = Answers(), RowsCache.advance_once

    def recorded(self, model, ids):
        answers.append(original(self, model, ids))
        return answers[-1]

    monkeypatch.setattr(RowsCache, "advance_once", recorded)
    return answers


def _rows_run(loaded, strategies, chunk=2048):
    probe = probe_for(loaded)
    caches = [probe.make_cache(parse_spec(s)) for s in strategies]
    logits = teacher_forced_logits_rows(loaded, caches, PREFIX, CONTINUATION, chunk)
    return logits, caches


def _states(cache) -> list:
    """Every tensor each layer holds (codes, scales, residuals...), by attribute name."""
    out = []
    for layer in cache.layers:
        for name, value in sorted(vars(layer).items()):
            parts = value if isinstance(value, (tuple, list)) else [value]
            out += [(name, t) for t in parts if isinstance(t, torch.Tensor)]
    return out


@pytest.mark.parametrize(
    "strategies, shared",
    [
        (["standard", "kivi:bits=4"], True),  # KIVI hands back its first update as given
        # a ring smaller than the chunk hands back the whole chunk (then keeps its last slots)
        (["standard", "rotating:max_size=32,keep=4", "sliding:window=32", "concat"], True),
        (["standard", "quantized:bits=4,group_size=32"], False),  # mlx-style: dequantized from the start
        (["standard", "kivi:bits=4", "fp8"], False),  # one row that differs: the whole batch as usual
    ],
)
def test_a_first_chunk_forwarded_once_gives_the_batch_logits_and_caches_bit_for_bit(tiny, spy, strategies, shared):
    once, once_caches = _rows_run(tiny, strategies)
    assert spy == [shared]
    spy.off()
    batch, batch_caches = _rows_run(tiny, strategies)
    assert once.dtype == batch.dtype and np.array_equal(once, batch)
    for a, b in zip(once_caches, batch_caches):
        assert a.get_seq_length() == b.get_seq_length() and a.nbytes == b.nbytes
        xs, ys = _states(a), _states(b)
        assert [n for n, _ in xs] == [n for n, _ in ys] and xs
        assert all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y) for (_, x), (_, y) in zip(xs, ys))


def test_only_a_first_chunk_every_row_takes_alike_is_forwarded_once(tiny, spy):
    _rows_run(tiny, ["standard", "kivi:bits=4"], chunk=16)  # 4 chunks: the first alone is shared
    assert spy == [True]
    runner, probe = Runner(tiny), probe_for(tiny)
    rows = runner.rows_cache([probe.make_cache(parse_spec(s)) for s in ("standard", "kivi:bits=4")])
    assert not rows.advance_once(tiny.model, [[1, 2, 3], [1, 2, 4]])  # different tokens
    assert rows.get_seq_length() == 0 and not rows._lengths
    assert rows.advance_once(tiny.model, [[1, 2, 3], [1, 2, 3]])
    assert rows.get_seq_length() == 3
    assert not rows.advance_once(tiny.model, [[4], [4]])  # not a first chunk


def test_a_declined_first_chunk_leaves_every_row_as_it_was(tiny, monkeypatch):
    # past the check before the forward (as a row whose later layers differ would be): the check after it declines
    monkeypatch.setattr(RowsCache, "_first_layer_alike", lambda self, model, n: True)
    runner, probe = Runner(tiny), probe_for(tiny)
    caches = [probe.make_cache(parse_spec(s)) for s in ("standard", "quantized:bits=4,group_size=32")]
    rows = runner.rows_cache(caches)
    assert not rows.advance_once(tiny.model, [PREFIX[:-1]] * 2)
    assert rows.rows[0] is caches[0] and all(c.get_seq_length() == 0 and c.nbytes == 0 for c in caches)
    runner.advance_rows(rows, [PREFIX[:-1]] * 2)  # the batch as usual, from the restored rows
    assert all(c.get_seq_length() == len(PREFIX) - 1 for c in caches)


@pytest.mark.parametrize(
    "strategies, shared",
    [(["standard", "kivi:bits=4", "rotating:max_size=32,keep=4"], True), (["standard", "quantized:bits=4"], False)],
)
def test_an_evaluation_with_a_shared_first_chunk_has_the_same_numbers(tiny, spy, strategies, shared):
    args = dict(texts=[("t", TEXT)], context=64, score_tokens=8, windows=2, prefill_chunk=2048)
    shared_run = evaluate(tiny, strategies, **args).samples
    assert spy == [shared, shared]
    spy.off()
    today = evaluate(tiny, strategies, **args).samples
    assert shared_run.drop(columns="seconds").equals(today.drop(columns="seconds"))


def test_a_row_that_hands_its_chunk_back_otherwise_is_found_before_any_forward(tiny, monkeypatch):
    runner, probe = Runner(tiny), probe_for(tiny)
    forwards, forward = [], tiny.model.forward

    def counted(*args, **kwargs):
        forwards.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(tiny.model, "forward", counted)
    mixed = runner.rows_cache([probe.make_cache(parse_spec(s)) for s in ("standard", "quantized:bits=4")])
    assert not mixed.advance_once(tiny.model, [PREFIX[:-1]] * 2)
    assert forwards == [] and mixed.get_seq_length() == 0
    alike = runner.rows_cache([probe.make_cache(parse_spec(s)) for s in ("standard", "kivi:bits=4")])
    assert alike.advance_once(tiny.model, [PREFIX[:-1]] * 2)
    assert forwards == [1] and alike.get_seq_length() == len(PREFIX) - 1
