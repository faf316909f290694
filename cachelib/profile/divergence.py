"""How far a strategy's next-token distribution is from the baseline's (KL, top-1 agreement, the
target's log-prob), from raw logits.

:class:`StepQuality` gives a profile step's numbers for all its rows at once (row 0 is the
baseline): the baseline's distribution once, then each other row in a few float64 torch passes
over one reused buffer. KL is ``sum p*(z_p - z_q) - log s_p + log s_q`` with ``z = logits - max``
and ``s = sum exp(z)``: the textbook ``sum p*(log p - log q)`` rearranged. The target's log-prob is
``z[target] - log s``, the textbook's arithmetic. Both are within a few units in the last place of
the textbook float64 form in NumPy (``tests/profile/test_quality.py`` checks them to 1e-12); a row
with the baseline's very logits gives exactly 0.0, and a row's numbers do not depend on the rows
computed with it.

:func:`compare` (one row against a baseline row, the evaluation's steps) keeps the textbook form.
"""

from __future__ import annotations

import math
import warnings
from typing import Sequence

import numpy as np

Numbers = tuple[float, bool, float | None]  # (KL in nats, top-1 agreement, the target's log-prob)


class StepQuality:
    """The quality numbers of one step's rows, row 0 the baseline, in torch's float64 (torch is a
    dependency of every install): its ``exp`` is vectorized where NumPy's float64 one is not on
    AVX2 CPUs. One row at a time through one reused buffer of the vocabulary's size, which stays
    in the core's cache from row to row (and one more for the baseline's probabilities); a
    buffer of every row, one op per pass, was slower in a run, where the forward leaves the
    caches cold (bench/README.md)."""

    def __init__(self):
        self._z = None  # (vocab,) float64: a row's logits - its max, then their exp
        self._p = None  # (vocab,) float64: the baseline's probabilities

    def __call__(
        self, rows: Sequence[np.ndarray], target: int | None, tops: Sequence[int | None] | None = None
    ) -> list[Numbers]:
        """One (KL(baseline || row), top-1 agreement, log-prob of ``target`` under the row) per
        row of ``rows`` (1-D logits, row 0 the baseline's: its KL is 0.0 and it agrees).
        ``tops``: each row's ``np.argmax`` where the caller has it already (None: taken here)."""
        import torch  # the profile layer's only torch: its float64 arithmetic

        rows = [_floats(x) for x in rows]
        base = rows[0]
        if self._z is None or self._z.shape[0] != base.shape[0]:
            self._z, self._p = (torch.empty(base.shape[0], dtype=torch.float64) for _ in range(2))
        z, p = self._z, self._p
        top1, m1 = _top(base, tops[0] if tops is not None else None)
        # the baseline: z = logits - max (float32 -> float64 and the subtraction are exact),
        # p = exp(z) / s, and sum p * log p = p . z - log s
        z.copy_(_tensor(torch, base)).sub_(m1)
        base_zt = float(z[target]) if target is not None else None
        torch.exp(z, out=p)
        total = float(p.sum())
        log_s = math.log(total)
        p /= total
        entropy_term = float(torch.dot(p, z)) - log_s
        base_lp = base_zt - log_s if target is not None else None
        out: list[Numbers] = [(0.0, True, base_lp)]
        for i, x in enumerate(rows[1:], 1):
            top, m = _top(x, tops[i] if tops is not None else None)
            # the same logits (their top and max first: a pass over both rows only where those agree):
            # the arithmetic below gives exactly these
            if top == top1 and m == m1 and np.array_equal(base, x):
                out.append((0.0, True, base_lp))
                continue
            z.copy_(_tensor(torch, x)).sub_(m)
            zt = float(z[target]) if target is not None else None
            cross = float(torch.dot(p, z))  # sum p * z_q
            log_s = math.log(float(z.exp_().sum()))
            kl = entropy_term - (cross - log_s)  # sum p * (log p - log q)
            out.append((max(kl, 0.0), top == top1, zt - log_s if target is not None else None))
        return out


def _floats(logits) -> np.ndarray:
    """A row of logits as a 1-D float array (float32 stays float32: the passes cast it)."""
    x = np.asarray(logits).ravel()
    return x if x.dtype in (np.float32, np.float64) else x.astype(np.float64)


def _tensor(torch, x: np.ndarray):
    """``x`` as a torch tensor sharing its memory, only ever read (copied from). A read-only array
    (``np.asarray`` of another framework's array, a memory map) makes ``torch.from_numpy`` warn
    that writing to it would be undefined; nothing writes to it here, so that warning is not the
    caller's."""
    if x.flags.writeable:
        return torch.from_numpy(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(x)


def _top(x: np.ndarray, top: int | None = None) -> tuple[int, float]:
    """(index, value) of a row's largest logit (the first NaN, where there is one: as max does);
    ``top``: that index, where it is known already."""
    if top is None:
        top = int(np.argmax(x))
    return top, float(x[top])


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax of one row of logits (vocab,)."""
    x = np.array(logits, dtype=np.float64)  # our own copy: the steps below work in place
    x -= x.max()
    x -= np.log(np.exp(x).sum())
    return x


class Baseline:
    """The baseline's next-token distribution at one step: float64 log-probabilities, probabilities
    and top token, computed once and shared by every :func:`compare` against it."""

    __slots__ = ("logits", "log_probs", "probs", "top1")

    def __init__(self, logits: np.ndarray):
        self.logits = np.asarray(logits)  # a row with these very logits compares without arithmetic
        self.log_probs = log_softmax(logits)
        self.probs = np.exp(self.log_probs)
        self.top1 = int(np.argmax(logits))

    def logprob(self, target: int) -> float:
        """Log-probability of token ``target`` under the baseline."""
        return float(self.log_probs[target])


def compare(baseline: Baseline | np.ndarray, logits: np.ndarray, target: int | None) -> Numbers:
    """(KL(baseline || strategy) in nats, top-1 agreement, log-prob of ``target`` under the strategy),
    in the textbook form. ``baseline`` is a :class:`Baseline` (shared by several calls) or raw logits."""
    base = baseline if isinstance(baseline, Baseline) else Baseline(baseline)
    if np.array_equal(base.logits, logits):  # the same logits: the arithmetic below gives exactly these
        return 0.0, True, (base.logprob(target) if target is not None else None)
    lq = log_softmax(logits)
    diff = base.log_probs - lq
    diff *= base.probs  # p * (log p - log q), elementwise
    kl = float(np.sum(diff))
    agree = bool(base.top1 == int(np.argmax(logits)))
    return max(kl, 0.0), agree, (float(lq[target]) if target is not None else None)
