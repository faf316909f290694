"""A profiling run: one model, one backend, one prompt or text, several cache strategies.

The first strategy is the baseline. In the default teacher-forced mode the baseline decodes
greedily and every other strategy is fed the baseline's tokens, so step t means the same token
for all and their numbers compare; with an evaluation text, every strategy is fed the text. In
free-running mode each strategy feeds its own greedy tokens and the profile records where its
stream first departs from the baseline's.

Each step advances every strategy by one forward pass (baseline first) and records rows through
the probes. The run reads caches only through their introspection. It stops cleanly — leaving a
readable profile marked incomplete with the reason — on an exception, Ctrl-C, a stop request or
the memory guard (given a limit, or by default a share of the memory available at the start).
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Sequence

import numpy as np

from .. import __version__
from ..core.memory import address_space_limit
from ..decode import Runner, encode_prompt
from ..models import LoadedModel, load
from ..models.devices import resolve_device
from ..plan import arch_from_model_info
from ..plan.accounting import Replay, replay
from ..spec import Spec, parse_spec
from .backends import probe_for
from .divergence import Numbers, StepQuality
from .guard import (
    DEFAULT_SHARE,
    MemoryGuard,
    check_fits,
    check_memory_limit,
    parse_memory_limit,
    planned_arch,
    warn_past_positions,
)
from .probes import Probes
from .recording import Forward, StepAt, StrategyState, before_step, process_rss, step_rows
from .store import Profile, ProfileWriter

DEFAULT_TEXT_PROMPT_TOKENS = 32


@dataclass
class StepEvent:
    """What ``on_step`` receives after every strategy has taken step ``step``."""

    step: int
    total_steps: int
    profile: Profile
    rows: dict[str, dict] = field(default_factory=dict)  # strategy label -> its steps row
    caches: dict[str, Any] = field(default_factory=dict)  # strategy label -> its live cache (read-only use)


def check_distinct(specs: Sequence[Spec | None]) -> None:
    """Refuse a strategy given twice (the same name and effective knobs, :attr:`Spec.key`), with
    one line naming both places (numbered from 1; None stands for a place not filled in yet): a
    profile names each strategy once, so what is written can be read back. Every entry point
    (library, CLI, app) applies this before anything runs."""
    first: dict[tuple, int] = {}
    for i, spec in enumerate(specs):
        if spec is None:
            continue
        j = first.setdefault(spec.key, i)
        if j != i:
            where = "the baseline" if j == 0 else f"strategy {j + 1}"
            same = "" if str(specs[j]) == str(spec) else f" ({specs[j]})"
            raise ValueError(
                f"strategy {i + 1} ({spec}) repeats {where}{same}: a run compares each strategy once; "
                "change a knob or remove the copy"
            )


def strategy_labels(specs: Sequence[Spec]) -> list[str]:
    """Canonical spec text per strategy; repeats get ``#2``, ``#3`` so every label is unique
    (:func:`run_profile` refuses repeats, :func:`check_distinct`; other callers may label them)."""
    seen: dict[str, int] = {}
    out = []
    for spec in specs:
        text = str(spec)
        seen[text] = seen.get(text, 0) + 1
        out.append(text if seen[text] == 1 else f"{text}#{seen[text]}")
    return out


def run_profile(
    model: str | LoadedModel = "smollm2",
    strategies: Sequence[str | Spec] = ("standard",),
    *,
    backend: str = "mlx",
    device: str | None = None,
    prompt: str | None = None,
    text: str | None = None,
    max_tokens: int = 64,
    free_running: bool = False,
    probes: Probes | None = None,
    memory_limit: int | float | str | None = None,
    out: str | os.PathLike | None = None,
    name: str | None = None,
    chat: bool = True,
    prompt_tokens: int = DEFAULT_TEXT_PROMPT_TOKENS,
    on_step: Callable[[StepEvent], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    one_by_one: bool = False,
) -> Profile:
    """Profile ``strategies`` on ``model`` and return the :class:`Profile` (also streamed to
    ``out`` as CSV when given; ``profile.path`` says where it went, see
    :meth:`~cachelib.profile.store.ProfileWriter.close`). Everything is validated before the
    model runs: the arguments and the output path before it loads, and, without a
    ``memory_limit``, whether the caches the planner predicts fit in the memory available
    (a ``ValueError`` with the figures when they do not) before any cache exists. Ctrl-C raises
    :class:`RunInterrupted` (a ``KeyboardInterrupt``) carrying the closed, incomplete profile.

    By default the strategies are the rows of one batch, advanced by one forward pass per step
    (a strategy batch, ``docs/profiler.md``); a strategy that cannot share it runs on its own and
    the metadata says why (``batch_notes``). ``one_by_one=True`` runs every strategy by its own
    forward pass. The recorded rows are the same either way."""
    specs = [parse_spec(s) for s in strategies]
    if not specs:
        raise ValueError("give at least one strategy (the first is the baseline)")
    check_distinct(specs)
    if isinstance(model, LoadedModel):
        backend = model.info.backend
    for spec in specs:
        spec.check_backend(backend)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if (prompt is None) == (text is None):
        raise ValueError("give exactly one of prompt= (chat prompt) or text= (evaluation text)")
    if not (prompt if prompt is not None else text).strip():
        raise ValueError(
            "the prompt is empty; give some text to decode from"
            if prompt is not None
            else "the evaluation text is empty"
        )
    if text is not None and free_running:
        raise ValueError("free-running mode decodes from a prompt; an evaluation text is teacher-forced")
    probes = probes or Probes()
    limit = parse_memory_limit(memory_limit)
    if limit is not None:  # a limit past the machine's memory guards nothing: refused before the model loads
        on = model.info.device if isinstance(model, LoadedModel) else resolve_device(backend, device)
        check_memory_limit(limit, on)
    # What cannot fit even for one token is refused before the model loads; under a memory limit too
    # when the address space is capped (ulimit -v), where a refused allocation crashes MLX as it loads.
    if not isinstance(model, LoadedModel) and (limit is None or address_space_limit() is not None):
        arch, on, dtype = planned_arch(model, backend, device)
        if arch is not None:
            check_fits(
                arch,
                specs,
                backend=backend,
                dtype=dtype,
                device=on,
                prompt_tokens=1,
                steps=1,
                rows=1 if one_by_one else len(specs),
            )
    run_id = uuid.uuid4().hex[:12]
    # Claims a partial file of this run's own: a path that cannot be written fails here, before any work.
    writer = ProfileWriter(out, run_id) if out is not None else None
    try:
        loaded = model if isinstance(model, LoadedModel) else load(model, backend, device)
        runner = Runner(loaded)
        probe = probe_for(loaded)
        tok = loaded.tokenizer

        if text is not None:
            ids = [int(i) for i in tok.encode(text)]
            if len(ids) < 2:
                raise ValueError("the evaluation text is too short: it needs at least 2 tokens")
            n_prompt = max(1, min(prompt_tokens, len(ids) - 1))
            prompt_ids, continuation = ids[:n_prompt], ids[n_prompt:]
            max_tokens = min(max_tokens, len(continuation))
        else:
            prompt_ids, continuation = encode_prompt(tok, prompt, chat), None

        warn_past_positions(loaded.info, len(prompt_ids) + max_tokens - 1)
        # refuses what cannot fit, before any cache exists
        guard = _guard(loaded, specs, limit, len(prompt_ids), max_tokens, one_by_one)
        labels = strategy_labels(specs)
        states = [StrategyState(label, spec, probe.make_cache(spec)) for label, spec in zip(labels, specs)]
        batch = _StrategyBatch.of(runner, states, one_by_one)
    except BaseException:
        if writer:
            writer.discard()
        raise

    meta = _meta(loaded, specs, labels, probes, limit, prompt, text, prompt_ids, max_tokens, free_running, name, run_id)
    meta.update(batch.meta())
    profile = Profile(meta)
    if writer:
        writer.write_meta(meta)
        writer.flush()

    status, reason, completed = "complete", "", 0
    # The quality probe's float64 arithmetic runs inline, once a step's rows are all out: a thread
    # of its own would contend with the step's host work for the interpreter (and, on a 2-core
    # machine, with the forward for a core) for less time than it saves (bench/README.md).
    step_quality = StepQuality() if probes.quality else None
    index = {st.label: i for i, st in enumerate(states)}
    try:
        feed = prompt_ids
        for step in range(max_tokens):
            if should_stop is not None and should_stop():
                status, reason = "incomplete", f"stopped by request before step {step}"
                break
            if guard is not None:
                verdict = guard.check(len(feed), [s.views_now(probe) for s in states])
                if verdict:
                    status, reason = "incomplete", verdict
                    break
            last = step == max_tokens - 1
            event = StepEvent(step, max_tokens, profile)
            quality = _StepQuality(step_quality) if probes.on("quality", step, last) else None
            target = continuation[step] if continuation is not None else None

            def arrived(st: StrategyState, logits: np.ndarray) -> int:
                """A row's logits, as soon as its forward gives them (the baseline's first or
                later); returns its greedy token (the logits' argmax, taken once a row)."""
                nonlocal target
                i = index[st.label]
                top = int(np.argmax(logits))
                if i == 0 and target is None:
                    target = top
                if quality is not None:
                    quality.add(i, logits, target, top)
                return top

            at = StepAt(probe, probes, step, last)
            batched = batch.step(at, lambda st: feed if not free_running or step == 0 else [st.last_token], arrived)
            taken = []
            for st in states:
                if st.label in batched:
                    rows = batched[st.label]
                else:
                    ids = feed if not free_running or step == 0 else [st.last_token]
                    rows = _take_step(runner, at, st, ids, arrived)
                taken.append((st, rows))
            numbers = quality.results() if quality is not None else None
            for i, (st, rows) in enumerate(taken):
                step_row = rows["steps"]
                if numbers is not None:
                    kl, agree, lp = numbers[i]
                    step_row.update(kl=kl, top1_agree=agree, logprob_target=lp)
                if free_running:
                    st.departed = st.departed or st.tokens != states[0].tokens[: len(st.tokens)]
                    step_row["departed"] = st.departed
                for table, table_rows in rows.items():
                    table_rows = [table_rows] if isinstance(table_rows, dict) else table_rows
                    profile.add(table, table_rows)
                    if writer:
                        writer.write(table, table_rows)
                event.rows[st.label] = step_row
                event.caches[st.label] = st.cache
            feed = [target]
            completed = step + 1
            if writer:
                writer.flush()
            if on_step is not None:
                on_step(event)
    except KeyboardInterrupt as e:
        how = str(e) or "Ctrl-C"  # the CLI raises KeyboardInterrupt("SIGTERM") on a SIGTERM
        status, reason = "incomplete", f"interrupted ({how}) during step {completed}"
        _close(profile, writer, status, reason, completed)
        raise RunInterrupted(profile, how) from None
    except BaseException as e:
        status, reason = "incomplete", f"error during step {completed}: {type(e).__name__}: {e}"
        _close(profile, writer, status, reason, completed)
        raise
    finally:
        for st in states:  # a run that stopped early leaves no cache measuring its error
            if st.tracking:
                probe.set_track_error(st.cache, False)
                st.tracking = False
    _close(profile, writer, status, reason, completed)
    return profile


class _StepQuality:
    """One step's quality numbers: each row's logits as its forward gives them (the baseline's
    with the step's target), then every row's numbers at once (:class:`StepQuality`)."""

    def __init__(self, compute: StepQuality):
        self.compute = compute
        self.logits: dict[int, np.ndarray] = {}  # row -> its logits, in the order they came
        self.tops: dict[int, int | None] = {}  # row -> its logits' argmax, where the caller gave it
        self.target: int | None = None

    def add(self, row: int, logits: np.ndarray, target: int | None, top: int | None = None) -> None:
        """Row ``row``'s logits (and their argmax ``top``, where known); the baseline's (row 0)
        come with the step's ``target``."""
        if row == 0:
            self.target = target
        self.logits[row] = logits
        self.tops[row] = top

    def results(self) -> dict[int, Numbers]:
        """Row -> (KL, top-1 agreement, the target's log-prob), for every row that came."""
        if 0 not in self.logits:
            raise RuntimeError("the baseline's logits never came: its rows cannot be compared")
        rows = [0] + [r for r in self.logits if r != 0]
        logits, tops = [self.logits[r] for r in rows], [self.tops[r] for r in rows]
        return dict(zip(rows, self.compute(logits, self.target, tops)))


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (or, in the CLI, SIGTERM) stopped a run. ``profile`` is what it recorded, closed
    and marked incomplete (``profile.path``: where its file went, when it streamed to one)."""

    def __init__(self, profile: Profile, how: str = "Ctrl-C"):
        super().__init__(how)
        self.profile = profile
        self.how = how


def _predictors(loaded: LoadedModel, specs: Sequence[Spec]) -> list[Replay]:
    """The memory guard's predictors: the planner's exact replay of each strategy's caches."""
    arch = arch_from_model_info(loaded.info)
    return [replay(arch, spec, loaded.info.backend, dtype=loaded.info.dtype) for spec in specs]


def _guard(
    loaded: LoadedModel,
    specs: Sequence[Spec],
    limit: int | None,
    prompt_tokens: int,
    max_tokens: int,
    one_by_one: bool = False,
) -> MemoryGuard | None:
    """The run's memory guard. Given a ``limit``, it stops the run before the caches pass it.
    Without one, a run the planner predicts not to fit in the memory this process may use is
    refused (:func:`~cachelib.profile.guard.check_fits`: ValueError with the figures) and the
    guard stops the run at a default limit, a share of that memory, should the caches grow past
    the prediction."""
    if limit is not None:
        return MemoryGuard(limit, _predictors(loaded, specs))
    info = loaded.info
    try:
        arch = arch_from_model_info(info)
        predictors = _predictors(loaded, specs)
    except ValueError:  # an architecture the planner cannot account: no default guard
        return None
    need = check_fits(
        arch,
        specs,
        backend=info.backend,
        dtype=info.dtype,
        device=info.device,
        prompt_tokens=prompt_tokens,
        steps=max_tokens,
        rows=1 if one_by_one else len(specs),
        loaded=True,  # the model's weights are in memory already
    )
    if need is None:
        return None
    return MemoryGuard(
        need.default_limit, predictors, source=f"the default: {DEFAULT_SHARE:.0%} of the memory available at the start"
    )


def _close(profile: Profile, writer: ProfileWriter | None, status: str, reason: str, completed: int) -> None:
    profile.meta.update(status=status, reason=reason, steps_completed=completed, finished=_now())
    if writer:
        profile.path = writer.close(profile.meta)


class _StrategyBatch:
    """The strategies that advance as the rows of one forward pass, and why the others do not."""

    def __init__(self, runner, states: list[StrategyState], notes: dict[str, str]):
        self.runner = runner
        self.states = states
        self.notes = notes  # label -> why it runs on its own
        self.rows = runner.rows_cache([st.cache for st in states]) if states else None

    @classmethod
    def of(cls, runner, states: list[StrategyState], one_by_one: bool) -> "_StrategyBatch":
        if one_by_one:
            return cls(runner, [], {})
        joined, notes = [], {}
        for st in states:
            problem = runner.batch_problem(st.cache)
            if problem:
                notes[st.label] = problem
            else:
                joined.append(st)
        if len(joined) < 2:  # a batch of one row is the one-by-one run
            joined = []
        return cls(runner, joined, notes)

    def meta(self) -> dict:
        return {
            "batch": "strategy batch" if self.states else "one by one",
            "batched": json.dumps([st.label for st in self.states]),
            "batch_notes": json.dumps(self.notes) if self.notes else "",
        }

    def step(self, at: StepAt, ids_of, arrived) -> dict[str, dict]:
        """One forward for every batched strategy: label -> its rows, as :func:`_take_step`
        (``arrived(state, logits)`` is called with each row's logits as soon as the forward ends)."""
        if not self.states:
            return {}
        probe = at.probe
        ids = [ids_of(st) for st in self.states]
        before = [before_step(at, st, len(i)) for st, i in zip(self.states, ids)]
        if at.probes.system:
            probe.reset_peak()
        start = time.perf_counter()
        caches = [st.cache for st in self.states]
        # the probes' pending work (error terms) is computed in the forward's own evaluation
        logits = self.runner.step_rows(self.rows, ids, extra=lambda: probe.pending(caches))
        wall = time.perf_counter() - start  # the one forward every row took
        tokens = [arrived(st, logits[r]) for r, st in enumerate(self.states)]
        views = probe.views_of(caches)  # reads every row's error terms, computed by the forward
        # the process's memory after the one forward is every row's: read it once, not once a row
        system = (*probe.device_memory(), process_rss()) if at.on("system") else None
        return {
            st.label: step_rows(at, st, before[r], Forward(ids[r], logits[r], wall, views[r], system, tokens[r]))
            for r, st in enumerate(self.states)
        }


def _take_step(runner, at: StepAt, st: StrategyState, ids: list[int], arrived) -> dict:
    """One forward of ``st`` alone: its rows (``arrived(st, logits)`` as soon as it ends)."""
    probe = at.probe
    before = before_step(at, st, len(ids))
    if at.probes.system:
        probe.reset_peak()
    start = time.perf_counter()
    with probe.capture(st.cache):  # importance caches get the step's queries (a no-op otherwise)
        logits = runner.step(st.cache, ids, extra=lambda: probe.pending([st.cache]))
    wall = time.perf_counter() - start
    token = arrived(st, logits)
    return step_rows(at, st, before, Forward(ids, logits, wall, probe.views(st.cache), token=token))


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _meta(
    loaded, specs, labels, probes, limit, prompt, text, prompt_ids, max_tokens, free_running, name, run_id
) -> dict:
    info = loaded.info
    return {
        "schema_version": 1,
        "name": name or "",
        "run_id": run_id,
        "created": _now(),
        "cachelib_version": __version__,
        "model": info.name,
        "model_source": info.source,
        "architecture": info.architecture,
        "random_weights": info.random_weights,
        "backend": info.backend,
        "device": info.device,
        "dtype": info.dtype,
        "weight_format": info.weight_format,
        "num_layers": info.num_layers,
        "num_kv_heads": info.num_kv_heads,
        "head_dim": info.head_dim,
        "mode": "free-running" if free_running else "teacher-forced",
        "input": "text" if text is not None else "prompt",
        "prompt": prompt if prompt is not None else text,
        "prompt_tokens": len(prompt_ids),
        "max_tokens": max_tokens,
        "strategies": json.dumps(labels),
        "specs": json.dumps([str(s) for s in specs]),
        "baseline": labels[0],
        "probes": json.dumps(probes.to_dict()),
        "memory_limit": limit if limit is not None else "",
        "status": "running",
        "reason": "",
        "steps_completed": 0,
    }


def default_profile_name(model: str, strategies: Sequence[str | Spec]) -> str:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{model}-{len(strategies)}strat").strip("-")
    return f"{stamp}-{slug}"
