"""Retrieval: does a cache still find a fact planted far back in a long context?

The needle-in-a-haystack measurement of the StreamingLLM, SnapKV and RULER papers, for any model
and cache strategy. A trial plants a short random key at a chosen depth (0 = the start of the
filler text, 1 = just before the question) of a long filler text (by default the evaluation
corpus, ``assets/corpus/``) and asks for it at the end:

- ``task="passkey"``: "The pass key is 48213. Remember it. 48213 is the pass key." and, at the
  end, "What is the pass key? The pass key is" -> the 5 digits are scored;
- ``task="copy"``: a list of 12 random words, and at the end a cue that repeats its first 4
  words -> the other 8 are scored.

The prompt goes through the chat template when the tokenizer has one (the bundled model is an
instruct model). Each strategy gets a fresh cache per trial. With ``question="prompt"`` (the
default, what a served request does) the whole prompt, question included, is prefilled through it
in chunks of ``prefill_chunk`` tokens (as mlx-lm's ``generate`` does), and then the key is
teacher-forced one token at a time; a cache that compresses once after the prompt (SnapKV) has
seen the question when it chooses. With ``question="decode"`` the prompt up to the question is
prefilled and the question is teacher-forced too, one token at a time, before the key (the cache
chooses before it sees the question). A trial is an exact match when every key token is the
model's argmax given the true prefix, which is exactly when greedy decoding would reproduce the
key.

The strategies of a trial that can share a strategy batch are its rows (one forward per prefill
chunk or forced token for all, :func:`~cachelib.profile.evaluate.teacher_forced_logits_rows`);
the others, and every strategy with ``one_by_one=True``, run on their own. Each row's
``seconds`` is then the batch's time.

``retrieval(...)`` returns an :class:`~cachelib.profile.evaluation_file.Evaluation` whose
``retrieval`` table has one row per strategy x context x depth x trial (``kind`` =
``retrieval`` in the evaluation file). This module knows the task and its scoring; caches come
from the backend probe, the chunked prefill and the forced steps from
:func:`~cachelib.profile.evaluate.teacher_forced_logits`.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from ..decode import Runner
from ..models import LoadedModel, load
from ..spec import Spec, parse_spec
from .backends import probe_for
from .evaluate import (
    DEFAULT_PREFILL_CHUNK,
    EvaluationInterrupted,
    check_limit,
    encode_text,
    resolve_texts,
    teacher_forced_logits,
    teacher_forced_logits_rows,
)
from .evaluation_file import COLUMNS, Evaluation, typed_frame
from .evaluation_writer import EvaluationWriter, row_key
from .guard import RunWatch, check_fits, planned_arch
from .run import check_distinct, strategy_labels

KIND = "retrieval"
TASKS = ("passkey", "copy")
QUESTION_MODES = ("prompt", "decode")  # the question prefilled with the prompt, or teacher-forced
# Beyond the evaluation file's columns (cachelib.profile.evaluation_file.COLUMNS), a retrieval row has:
EXTRA_COLUMNS = (
    "trial",  # 0..trials-1: a new key and filler window each
    "question",  # prompt: prefilled with the prompt; decode: teacher-forced after the prefill
    "key_token_accuracy",  # fraction of the key's tokens that were the argmax
    "needle_position",  # absolute position of the needle's first token
    "answer",  # the key, as text
    "predicted",  # the argmax tokens at the key's positions, as text
)

PREAMBLE = {
    "passkey": "There is an important pass key hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the pass key.\n\n",
    "copy": "There is a list of words hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will ask you to repeat the list.\n\n",
}
QUESTION = {
    "passkey": ("What is the pass key?", "The pass key is"),
    "copy": ("What is the list of words?", "The list is:"),
}
COPY_WORDS = 12  # words in the planted list
COPY_CUE = 4  # of which the cue repeats the first 4; the other 8 are scored
WORDS = (
    "apple river candle garden window silver hammer pencil rabbit forest bottle carpet engine island "
    "ladder mirror needle orange pepper rocket saddle tiger violin wagon anchor basket cotton dragon "
    "feather glove honey jacket kettle lemon marble nickel onion parrot pillow quartz ribbon spider "
    "tomato turtle velvet walnut yellow zebra blanket castle donkey eagle falcon ginger helmet insect "
    "jungle lantern mango oyster pirate"
).split()


@dataclass(frozen=True)
class Trial:
    """One trial's prompt as token ids: ``prefill + cue + key`` is the whole sequence."""

    prefill: list[int]  # head, then the filler with the needle inside: prefilled in chunks
    cue: list[int]  # the question: teacher-forced one token at a time
    key: list[int]  # the scored tokens
    needle_start: int  # absolute position of the needle's first token
    needle_length: int
    haystack_start: int  # first position after the head; the haystack ends where the cue starts
    answer: str  # the key as text
    text: str  # name of the filler text

    @property
    def context(self) -> int:
        return len(self.prefill) + len(self.cue) + len(self.key)

    @property
    def ids(self) -> list[int]:
        return self.prefill + self.cue + self.key


class TaskPrompt:
    """A task's prompt for one tokenizer: the fixed parts tokenized once, and a fresh needle,
    question and key per trial (:meth:`needle`)."""

    def __init__(self, tokenizer, task: str):
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; allowed: {', '.join(TASKS)}")
        self.tokenizer, self.task = tokenizer, task
        ask, reply = QUESTION[task]
        wrapped = _chat_parts(tokenizer)
        if wrapped is not None:
            before, after = wrapped
            self.head = self.encode(before + PREAMBLE[task], special=True)
            self.question = "\n\n" + ask + after + reply
        else:
            self.head = self.encode(PREAMBLE[task], special=True)
            self.question = "\n\n" + ask + " " + reply

    def encode(self, text: str, special: bool = False) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=special)]

    def needle(self, rng: random.Random) -> tuple[list[int], list[int], list[int], str]:
        """(needle ids, cue ids, key ids, answer text) of one random key."""
        if self.task == "passkey":
            key = str(rng.randrange(10_000, 100_000))
            needle = f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
            cue, answer = self.question, key
        else:
            words = rng.sample(WORDS, COPY_WORDS)
            needle = "\nThe list of words: " + " ".join(words) + ".\n"
            cue, answer = self.question + " " + " ".join(words[:COPY_CUE]), " ".join(words[COPY_CUE:])
        cue_ids, key_ids = self.encode(cue), self.encode(" " + answer)
        while key_ids and not self.tokenizer.decode(key_ids[:1]).strip():  # a bare space leads: part of the cue
            cue_ids, key_ids = cue_ids + key_ids[:1], key_ids[1:]
        return self.encode(needle), cue_ids, key_ids, answer

    def fixed_length(self, rng: random.Random) -> int:
        """Tokens of a trial that are not filler (for the shortest context check)."""
        needle, cue, key, _ = self.needle(rng)
        return len(self.head) + len(needle) + len(cue) + len(key)


def _chat_parts(tokenizer) -> tuple[str, str] | None:
    """The chat template's text before and after a user message (None: no template)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "\u2063MESSAGE\u2063"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False
    )
    if text.count(marker) != 1:
        return None
    before, after = text.split(marker)
    bos = getattr(tokenizer, "bos_token", None)
    if (
        bos
        and before.startswith(bos)
        and tokenizer.encode("x", add_special_tokens=True)[:1] == [tokenizer.bos_token_id]
    ):
        before = before[len(bos) :]  # encode(special=True) adds it again
    return before, after


def make_trial(
    prompt: TaskPrompt, filler: Sequence[int], context: int, depth: float, rng: random.Random, text: str = ""
) -> Trial:
    """Plant a new needle at ``depth`` of a window of the token ids ``filler`` (named ``text``)
    so that the whole sequence is ``context`` tokens long; the key and the window's start are
    drawn from ``rng``. The needle goes after ``round(depth * filler tokens)`` filler tokens."""
    needle, cue, key, answer = prompt.needle(rng)
    head = prompt.head
    n_fill = context - len(head) - len(needle) - len(cue) - len(key)
    if n_fill < 1:
        raise ValueError(
            f"context {context} is too short for the {prompt.task} task: it needs at least "
            f"{context - n_fill + 1} tokens to hold the needle and the question"
        )
    source = list(filler)
    if len(source) < n_fill:  # a short text repeats
        source = source * math.ceil(n_fill / max(len(source), 1))
    start = rng.randrange(0, len(source) - n_fill + 1)
    window = source[start : start + n_fill]
    at = round(depth * n_fill)
    prefill = head + window[:at] + needle + window[at:]
    return Trial(prefill, cue, key, len(head) + at, len(needle), len(head), answer, text)


def score_key(predicted: Sequence[int], key: Sequence[int]) -> tuple[int, float]:
    """(exact match 0/1, fraction of key tokens right) of the argmax tokens at the key's positions."""
    if len(predicted) != len(key) or not key:
        raise ValueError(f"score_key: {len(predicted)} predictions for {len(key)} key tokens")
    right = [int(p) == int(k) for p, k in zip(predicted, key)]
    return int(all(right)), sum(right) / len(right)


def retrieval(
    model: str | LoadedModel,
    strategies: Sequence[str | Spec],
    *,
    contexts: Sequence[int],
    depths: Sequence[float],
    trials: int = 4,
    seed: int = 0,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    backend: str = "mlx",
    device: str | None = None,
    task: str = "passkey",
    texts=None,
    on_sample: Callable[[dict], None] | None = None,
    question: str = "prompt",
    one_by_one: bool = False,
    out=None,
) -> Evaluation:
    """Retrieval accuracy of ``strategies`` over the grid ``contexts`` x ``depths``, ``trials``
    trials per cell (a new key and filler window each; the same prompts for every strategy).

    ``context`` counts every token of a trial: the prompt, the question and the key, so a model
    limited to 8,192 positions takes contexts up to 8,192. ``texts``: the filler, as for
    :func:`~cachelib.profile.evaluate.evaluate` (files or ``(name, text)`` pairs; default: the
    corpus in ``assets/corpus/``); trial ``t`` draws its window from text ``t mod len(texts)``.
    Returns an :class:`~cachelib.profile.evaluation_file.Evaluation` whose ``retrieval`` table has one
    row per strategy x context x depth x trial. ``on_sample(row)`` is called after every row.
    ``question``: ``prompt`` (prefilled with the prompt) or ``decode`` (teacher-forced after the
    prefill); see the module docstring. ``one_by_one=True`` runs one strategy's cache at a time.
    Bad input raises ValueError before the model runs. With ``out`` (a ``.csv`` path, checked
    before the model loads) every row is on disk as soon as it is measured, a finished run goes
    to ``out`` in one step and an unfinished one to ``NAME.incomplete.csv``, which the same call
    resumes (:mod:`cachelib.profile.evaluation_writer`); Ctrl-C raises
    :class:`~cachelib.profile.evaluate.EvaluationInterrupted` carrying what was measured.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; allowed: {', '.join(TASKS)}")
    if question not in QUESTION_MODES:
        raise ValueError(f"unknown question mode {question!r}; allowed: {', '.join(QUESTION_MODES)}")
    specs = [parse_spec(s) for s in strategies]
    if not specs:
        raise ValueError("give at least one strategy")
    if isinstance(model, LoadedModel):
        backend = model.info.backend
    for spec in specs:
        spec.check_backend(backend)
    check_distinct(specs)
    contexts = [_check_int("context", c, 2) for c in _listed("contexts", contexts)]
    depths = [_check_depth(d) for d in _listed("depths", depths)]
    trials = _check_int("trials", trials, 1)
    prefill_chunk = _check_int("prefill_chunk", prefill_chunk, 1)
    for spec in specs:
        if spec.max_context is not None and spec.max_context < max(contexts):
            raise ValueError(
                f"strategy {spec} holds at most {spec.max_context} tokens; context {max(contexts)} needs more"
            )
    sources = resolve_texts(texts)

    arch, where, dtype = planned_arch(model, backend, device)
    if arch is not None:  # refused before the model loads: positions past its limit, caches that cannot fit
        check_limit(arch, contexts, 1)
        check_fits(
            arch,
            specs,
            backend=backend,
            dtype=dtype,
            device=where,
            prompt_tokens=max(contexts),
            steps=1,
            prefill_chunk=prefill_chunk,
            rows=1 if one_by_one else len(specs),
            what="retrieval",
            hint="",
            loaded=isinstance(model, LoadedModel),  # a loaded model's weights are in memory already
        )
    # The output is checked and claimed (a partial file of this run's own) before the model loads.
    writer = EvaluationWriter(out, KIND, (*COLUMNS, *EXTRA_COLUMNS)) if out is not None else None
    try:
        loaded = model if isinstance(model, LoadedModel) else load(model, backend, device)
        info = loaded.info
        check_limit(info, contexts, 1)
        prompt = TaskPrompt(loaded.tokenizer, task)
        shortest = prompt.fixed_length(random.Random(0)) + 1
        for c in contexts:
            if c < shortest:
                raise ValueError(
                    f"context {c} is too short for the {task} task: it needs at least "
                    f"{shortest} tokens to hold the needle and the question"
                )
        fillers: dict[int, list[int]] = {}  # tokenized on first use: a short run reads one text
        plan = []  # (context, depth, trial number, trial): every prompt is drawn before any is measured
        for context in contexts:
            for depth in depths:
                for t in range(trials):
                    i = t % len(sources)
                    if i not in fillers:
                        # prompt.encode's ids, remembered across runs of the same text
                        fillers[i] = list(encode_text(prompt.tokenizer, sources[i][1], add_special_tokens=False))
                    rng = random.Random(f"{seed}:{task}:{context}:{depth!r}:{t}")
                    plan.append((context, depth, t, make_trial(prompt, fillers[i], context, depth, rng, sources[i][0])))
        labels = strategy_labels(specs)

        def head(label: str, context: int, depth: float, t: int, trial: Trial) -> dict:
            return {
                "model": info.name,
                "backend": info.backend,
                "device": info.device,
                "dtype": info.dtype,
                "strategy": label,
                "context": context,
                "prefill_chunk": prefill_chunk,
                "task": task,
                "depth": depth,
                "trial": t,
                "question": question,
                "text": trial.text,
                "needle_position": trial.needle_start,
                "answer": trial.answer,
            }

        guard = RunWatch(
            loaded,
            specs,
            prompt_tokens=max(contexts),
            steps=1,
            prefill_chunk=prefill_chunk,
            rows=1 if one_by_one else len(specs),
            what="retrieval",
        )
        measured: set[tuple] = set()
        if writer is not None:  # an unfinished run of this same command is resumed: its trials are not run again
            measured = writer.resume({row_key(head(lb, *item), KIND) for item in plan for lb in labels})
    except BaseException:
        if writer is not None:
            writer.fail()  # rows resumed already are kept (NAME.incomplete.csv); else no file
        raise

    probe = probe_for(loaded)
    rows, notes = [], {}
    done, total = len(measured), len(plan) * len(specs)
    status, reason = "complete", ""
    try:
        for context, depth, t, trial in plan:
            todo = [
                (lb, s)
                for lb, s in zip(labels, specs)
                if row_key(head(lb, context, depth, t, trial), KIND) not in measured
            ]
            if not todo:
                continue
            verdict = guard.check()
            if verdict:
                status, reason = "incomplete", f"{verdict} after {done} of {total} trial rows"
                break
            batch = [s for _, s in todo]
            batched = {} if one_by_one else _run_batch(loaded, probe, batch, trial, prefill_chunk, question, notes)
            for label, spec in todo:
                measured_row = batched.pop(label, None) or _run_trial(
                    loaded, probe, spec, trial, prefill_chunk, question
                )
                keys = head(label, context, depth, t, trial)  # in the file's order: the measured columns last
                row = {**{k: v for k, v in keys.items() if k not in measured_row}, **measured_row}
                if writer is not None:
                    writer.add(row)  # on disk before the next trial starts
                rows.append(row)
                done += 1
                if on_sample is not None:
                    on_sample(row)
    except KeyboardInterrupt as e:
        how = str(e) or "Ctrl-C"  # the CLI raises KeyboardInterrupt("SIGTERM") on a SIGTERM
        found = _closed(writer, rows, notes, "incomplete", f"interrupted ({how}) after {done} of {total} trial rows")
        raise EvaluationInterrupted(found) from None
    except OSError as e:
        if writer is not None and e.filename == str(writer.path):  # the disk refused a row: keep what is flushed
            kept = writer.fail()
            if kept is not None:
                e.strerror = f"{e.strerror}; the {writer.rows} row(s) measured so far are in {kept}"
            raise
        _closed(writer, rows, notes, "incomplete", f"error after {done} of {total} trial rows: {type(e).__name__}: {e}")
        raise
    except BaseException as e:
        _closed(writer, rows, notes, "incomplete", f"error after {done} of {total} trial rows: {type(e).__name__}: {e}")
        raise
    return _closed(writer, rows, notes, status, reason)


def _closed(writer: EvaluationWriter | None, rows: list[dict], notes: dict, status: str, reason: str) -> Evaluation:
    """The run's result; with an output, its file closed and read back (resumed rows included)."""
    found = Evaluation(typed_frame([], "sample"), typed_frame(rows, KIND), status=status, reason=reason, notes=notes)
    if writer is not None:
        written = writer.close(status == "complete")
        if written is not None:
            written.status, written.reason, written.notes = status, reason, dict(notes)
            return written
    return found


def _split(trial: Trial, question: str) -> tuple[list[int], list[int], int]:
    """(prefilled ids, teacher-forced ids, index of the first key token among the forced)."""
    if question == "prompt":
        return trial.prefill + trial.cue, trial.key, 0
    return trial.prefill, trial.cue + trial.key, len(trial.cue)


def _run_trial(
    loaded: LoadedModel, probe, spec: Spec, trial: Trial, prefill_chunk: int, question: str = "prompt"
) -> dict:
    """One strategy on one trial, with a fresh cache: the prompt prefilled in chunks, then the
    rest teacher-forced one token at a time (see :func:`_split`)."""
    start = time.perf_counter()
    cache = probe.make_cache(spec)
    prefix, forced, first = _split(trial, question)
    with probe.capture(cache):  # importance caches get each step's queries (a no-op otherwise)
        logits = teacher_forced_logits(loaded, cache, prefix, forced, prefill_chunk)
    views = probe.views(cache)
    del cache
    return _scored(loaded, spec, trial, logits[first:], views, time.perf_counter() - start)


def _run_batch(
    loaded: LoadedModel,
    probe,
    specs: Sequence[Spec],
    trial: Trial,
    prefill_chunk: int,
    question: str,
    notes: dict[str, str],
) -> dict[str, dict]:
    """The trial's strategies that can share one strategy batch, measured together: label ->
    the row's measured columns. Empty when fewer than two can (a batch of one is the run alone);
    ``notes`` gets, per strategy that cannot join, why."""
    runner = Runner(loaded)
    caches, joined = [], []
    for label, spec in zip(strategy_labels(list(specs)), specs):
        cache = probe.make_cache(spec)
        problem = runner.batch_problem(cache)
        if problem is None:
            caches.append(cache)
            joined.append((label, spec))
        else:
            notes[label] = problem
    if len(joined) < 2:
        return {}
    start = time.perf_counter()
    prefix, forced, first = _split(trial, question)
    logits = teacher_forced_logits_rows(loaded, caches, prefix, forced, prefill_chunk)
    seconds = time.perf_counter() - start  # the batch's time, shared by its rows
    return {
        label: _scored(loaded, spec, trial, logits[i, first:], probe.views(c), seconds)
        for i, ((label, spec), c) in enumerate(zip(joined, caches))
    }


def _scored(loaded: LoadedModel, spec: Spec, trial: Trial, key_logits: np.ndarray, views, seconds: float) -> dict:
    """The measured columns of one strategy on one trial, from its logits at the key's positions."""
    predicted = [int(i) for i in np.argmax(key_logits, axis=-1)]
    exact, accuracy = score_key(predicted, trial.key)
    window = spec.window
    context = trial.context
    return {
        "score_tokens": len(trial.key),
        "text": trial.text,
        "exact_match": float(exact),
        "key_token_accuracy": accuracy,
        "kept_fraction": 1.0 if window is None else min(1.0, window / context),
        "tokens_held": max((v.tokens_held for v in views), default=0),
        "bytes_allocated": sum(v.bytes_allocated for v in views),
        "seconds": seconds,
        "needle_position": trial.needle_start,
        "answer": trial.answer,
        "predicted": loaded.tokenizer.decode(predicted).strip(),
    }


def _listed(name: str, values) -> list:
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name} must be a list of values, got {values!r}")
    values = list(values)
    if not values:
        raise ValueError(f"give at least one value for {name}")
    return values


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} {value} must be >= {minimum}")
    return int(value)


def _check_depth(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"depth must be a number in 0..1, got {value!r}")
    if not 0.0 <= float(value) <= 1.0:  # NaN fails too
        raise ValueError(f"depth {value} is outside 0..1 (0 = start of the filler, 1 = just before the question)")
    return float(value)
