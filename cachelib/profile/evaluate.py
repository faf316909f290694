"""Long-context evaluation: how far each cache strategy's next-token distribution drifts from the
full cache's at a given context length, on real text.

For each text, each of ``windows`` evenly spaced windows of ``context + score_tokens`` tokens,
and each strategy: a fresh cache, the window's first ``context`` tokens prefilled through the
real model the way the runtime does it (mlx-lm's ``generate_step``: all but the last token in
chunks of ``prefill_chunk`` = 2048, then the last token alone; on torch the same chunks through
``model(..., cache=c)``), then the next ``score_tokens`` tokens teacher-forced one step at a
time. Each step's logits are compared with the reference's (the first strategy, a full cache,
computed once per window): KL(reference || strategy), top-1 agreement and the log-likelihood of
the text's true token, giving per window the mean KL, agreement, NLL, perplexity and
delta-perplexity as llama.cpp's ``llama-perplexity --kl-divergence`` reports them.

Only one strategy's cache is alive at a time. :func:`teacher_forced_logits` is the primitive
(chunked prefill, then forced steps); the retrieval task builds on it too.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..core.reader import read_text
from ..core.units import clip_input
from ..decode import Runner
from ..models import LoadedModel, load
from ..spec import Spec, parse_spec
from .backends import probe_for
from .divergence import compare
from .evaluation_file import SAMPLE_COLUMNS, Evaluation, typed_frame
from .evaluation_writer import EvaluationWriter, row_key
from .guard import RunWatch, check_fits, planned_arch

CORPUS = Path(__file__).resolve().parents[2] / "assets" / "corpus"
DEFAULT_PREFILL_CHUNK = 2048  # mlx-lm generate_step's prefill_step_size
DEFAULT_SCORE_TOKENS = 128
DEFAULT_WINDOWS = 4


@dataclass(frozen=True)
class EvaluationStep:
    """What ``on_progress`` receives after each strategy x window."""

    done: int  # strategy x window measurements finished, this one included
    total: int
    row: dict  # the sample row just measured


class EvaluationInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`evaluate`; ``evaluation`` holds what was measured (and, with ``out``,
    where it was written: ``evaluation.path``)."""

    def __init__(self, evaluation: Evaluation):
        super().__init__(evaluation.reason)
        self.evaluation = evaluation


# --- the primitive -------------------------------------------------------------------------------


def prefill(loaded: LoadedModel, cache, ids: Sequence[int], chunk: int = DEFAULT_PREFILL_CHUNK) -> None:
    """Feed ``ids`` through ``cache`` in forward passes of at most ``chunk`` tokens, computing
    no logits (as mlx-lm's prefill: the cache state is evaluated, the logits never are)."""
    model = loaded.model
    if loaded.backend == "mlx":
        import mlx.core as mx

        for s in range(0, len(ids), chunk):
            model(mx.array([list(ids[s : s + chunk])]), cache=cache)
            mx.eval([c.state for c in cache])
            mx.clear_cache()
        return
    import torch

    device = loaded.info.device
    with torch.inference_mode():
        for s in range(0, len(ids), chunk):
            x = torch.tensor([list(ids[s : s + chunk])], dtype=torch.long, device=device)
            model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1)


def teacher_forced_logits(
    loaded: LoadedModel,
    cache,
    prefix: Sequence[int],
    continuation: Sequence[int],
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
) -> np.ndarray:
    """Prefill ``prefix`` through ``cache`` (all but its last token in chunks of
    ``prefill_chunk``, then the last token alone), then feed ``continuation[:-1]`` one token per
    step. Returns float32 logits of shape (len(continuation), vocab): row i is the model's
    prediction of ``continuation[i]`` given ``prefix + continuation[:i]``."""
    if not prefix or not continuation:
        raise ValueError("teacher_forced_logits needs a non-empty prefix and continuation")
    runner = Runner(loaded)
    prefill(loaded, cache, prefix[:-1], prefill_chunk)
    rows = [runner.step(cache, [int(prefix[-1])])]
    for token in continuation[:-1]:
        rows.append(runner.step(cache, [int(token)]))
    return np.stack(rows).astype(np.float32, copy=False)


def teacher_forced_logits_rows(
    loaded: LoadedModel,
    caches: Sequence,
    prefix: Sequence[int],
    continuation: Sequence[int],
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
) -> np.ndarray:
    """:func:`teacher_forced_logits` for several whole-model caches at once, as the rows of one
    strategy batch (one forward per chunk or step for all). Returns float32 logits of shape
    (len(caches), len(continuation), vocab)."""
    if not prefix or not continuation:
        raise ValueError("teacher_forced_logits_rows needs a non-empty prefix and continuation")
    runner = Runner(loaded)
    rows = runner.rows_cache(list(caches))
    k, body = len(caches), list(prefix[:-1])
    for s in range(0, len(body), prefill_chunk):
        chunk = [body[s : s + prefill_chunk]] * k
        # rows that take a first chunk alike are forwarded once (torch: RowsCache.advance_once, bit-equal)
        if s or loaded.backend != "torch" or not rows.advance_once(loaded.model, chunk):
            runner.advance_rows(rows, chunk)
    out = [runner.step_rows(rows, [[int(prefix[-1])]] * k)]
    for token in continuation[:-1]:
        out.append(runner.step_rows(rows, [[int(token)]] * k))
    return np.stack(out, axis=1).astype(np.float32, copy=False)


# --- inputs --------------------------------------------------------------------------------------

_ENCODED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {(digest, special): ids}
_ENCODED_PER_TOKENIZER = 8  # texts kept per tokenizer (a corpus text is ~200k ids)


def encode_text(tokenizer, text: str, add_special_tokens: bool | None = None) -> tuple[int, ...]:
    """``tokenizer.encode(text)`` (with ``add_special_tokens`` when given) as ints, remembered per
    tokenizer: a whole corpus text takes ~1 s to encode on this CPU, more than a short evaluation's
    forwards, and every run of the same text (a benchmark's repeats, a test module's) gets the same ids."""
    key = (hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest(), add_special_tokens)
    try:
        known = _ENCODED.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that takes no weak reference: encoded every time
        known = {}
    if key not in known:
        if len(known) >= _ENCODED_PER_TOKENIZER:
            known.pop(next(iter(known)))
        extra = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        known[key] = tuple(int(i) for i in tokenizer.encode(text, **extra))
    return known[key]


def corpus_texts(folder: str | os.PathLike = CORPUS) -> list[tuple[str, str]]:
    """(name, text) of every ``*.txt`` of the evaluation corpus, by name."""
    return [(p.stem, p.read_text(encoding="utf-8")) for p in sorted(Path(folder).glob("*.txt"))]


def resolve_texts(texts: Sequence[str | os.PathLike | tuple[str, str]] | None) -> list[tuple[str, str]]:
    """``texts`` as (name, text) pairs: file paths are read (named by their stem); None means the
    corpus in ``assets/corpus/``."""
    if texts is None:
        found = corpus_texts() if CORPUS.is_dir() else []
        if not found:
            raise ValueError(
                f"no evaluation corpus at {CORPUS} (no *.txt there); pass texts= (files or (name, text) pairs)"
            )
        return found
    if isinstance(texts, (str, os.PathLike)):
        texts = [texts]
    out: list[tuple[str, str]] = []
    for item in texts:
        if isinstance(item, tuple):
            if len(item) != 2 or not all(isinstance(x, str) for x in item):
                raise ValueError(f"a text pair must be (name, text), got {item!r:.80}")
            name, text = item
        else:
            path = Path(item).expanduser()
            try:
                text = read_text(path, "evaluation text")  # bounded: no device, pipe or socket
            except FileNotFoundError:
                raise ValueError(f"evaluation text {clip_input(str(path))!r} not found") from None
            except OSError as e:
                raise ValueError(e.strerror or str(e)) from None
            name = path.stem
        if not text.strip():
            raise ValueError(f"evaluation text {name!r} is empty")
        if name in [n for n, _ in out]:
            raise ValueError(f"two evaluation texts are named {name!r}; give them distinct names")
        out.append((name, text))
    if not out:
        raise ValueError("texts is an empty list; give at least one evaluation text")
    return out


def reference_first(strategies: Sequence[str | Spec], backend: str) -> list[Spec]:
    """The strategies with the full-cache reference first: the first one when it is lossless,
    else ``standard`` put in front (moved there if the list holds it)."""
    specs = [parse_spec(s) for s in strategies]
    if not specs or not specs[0].lossless:
        standard = parse_spec("standard")
        specs = [standard] + [s for s in specs if s.key != standard.key]
    for i, spec in enumerate(specs):
        spec.check_backend(backend)
        if any(spec.key == other.key for other in specs[:i]):
            raise ValueError(f"strategy {spec} is listed twice")
    return specs


def window_starts(n_tokens: int, length: int, windows: int, name: str = "text") -> list[int]:
    """``windows`` distinct, evenly spaced start offsets of ``length``-token windows in a text of
    ``n_tokens`` tokens (the first at 0, the last ending at the text's end)."""
    need = length + windows - 1
    if n_tokens < need:
        also = f" ({length} per window, plus {windows - 1} for {windows} distinct windows)" if windows > 1 else ""
        raise ValueError(f"evaluation text {name!r} is too short: it has {n_tokens} tokens and needs {need}{also}")
    if windows == 1:
        return [0]
    span = n_tokens - length
    return [round(i * span / (windows - 1)) for i in range(windows)]


def _check_count(name: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _contexts(context) -> list[int]:
    values = list(context) if isinstance(context, (list, tuple)) else [context]
    if not values:
        raise ValueError("give at least one context")
    out = [_check_count("context", c) for c in values]
    if len(set(out)) != len(out):
        raise ValueError(f"context {next(c for c in out if out.count(c) > 1)} is listed twice")
    return out


def check_limit(info, contexts: Sequence[int], score_tokens: int) -> None:
    """Every position fed must be within the model's limit (``max_position_embeddings``)."""
    limit = info.max_position_embeddings
    if not limit:
        return
    for c in contexts:
        if c > limit:
            raise ValueError(f"context {c} is beyond {info.name}'s limit of {limit} positions (allowed: 1..{limit})")
        if c + score_tokens - 1 > limit:
            raise ValueError(
                f"context {c} + score_tokens {score_tokens} feeds positions up to {c + score_tokens - 2}, beyond "
                f"{info.name}'s limit of {limit} positions; use context <= {limit - score_tokens + 1}"
            )


# --- the run -------------------------------------------------------------------------------------


def evaluate(
    model: str | LoadedModel,
    strategies: Sequence[str | Spec] = ("standard",),
    *,
    texts: Sequence[str | os.PathLike | tuple[str, str]] | None = None,
    context: int | Sequence[int],
    score_tokens: int = DEFAULT_SCORE_TOKENS,
    windows: int = DEFAULT_WINDOWS,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    backend: str = "mlx",
    device: str | None = None,
    out: str | os.PathLike | None = None,
    on_progress: Callable[[EvaluationStep], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    one_by_one: bool = False,
) -> Evaluation:
    """Evaluate ``strategies`` on ``model`` at ``context`` tokens (one int, or several: one
    evaluation each, in one result). The first strategy is the full-cache reference (``standard``
    is put in front when the first is not lossless). With ``out`` the path is checked before the
    model loads, every measurement is on disk as soon as it is taken, and the result goes to
    ``out`` in one step; a run that does not finish writes ``NAME.incomplete.csv`` instead and
    never touches ``out``, and the same call later resumes it, measuring only what it lacks
    (:mod:`cachelib.profile.evaluation_writer`). Bad input raises ValueError, checked before the
    model loads where possible; the memory guard (:class:`~cachelib.profile.guard.RunWatch`)
    stops the run cleanly between windows.

    By default the strategies of a window are the rows of one strategy batch (one forward per
    prefill chunk or scored token for all; their caches are alive together, and each row's
    ``seconds`` is the batch's time); a strategy that cannot share it runs on its own
    (``Evaluation.notes`` says why). ``one_by_one=True`` runs one strategy's cache at a time."""
    if isinstance(model, LoadedModel):
        backend = model.info.backend
    contexts = _contexts(context)
    score_tokens = _check_count("score_tokens", score_tokens)
    windows = _check_count("windows", windows)
    prefill_chunk = _check_count("prefill_chunk", prefill_chunk)
    specs = reference_first(strategies, backend)
    for spec in specs:
        bound = spec.max_context
        need = max(contexts) + score_tokens - 1
        if bound is not None and bound < need:
            raise ValueError(
                f"strategy {spec} holds at most {bound} tokens; context + score_tokens - 1 = {need} needs more"
            )
    sources = resolve_texts(texts)

    arch, where, dtype = planned_arch(model, backend, device)
    if arch is not None:  # refused before the model loads: positions past its limit, caches that cannot fit
        check_limit(arch, contexts, score_tokens)
        check_fits(
            arch,
            specs,
            backend=backend,
            dtype=dtype,
            device=where,
            prompt_tokens=max(contexts),
            steps=score_tokens,
            prefill_chunk=prefill_chunk,
            rows=1 if one_by_one else len(specs),
            what="evaluation",
            hint="",
            loaded=isinstance(model, LoadedModel),  # a loaded model's weights are in memory already
        )
    # The output is checked and claimed (a partial file of this run's own) before the model loads.
    writer = EvaluationWriter(out, "sample", SAMPLE_COLUMNS) if out is not None else None
    try:
        loaded = model if isinstance(model, LoadedModel) else load(model, backend, device)
        check_limit(loaded.info, contexts, score_tokens)
        tokenized = [(name, list(encode_text(loaded.tokenizer, text))) for name, text in sources]
        plan = []  # (context, text name, ids, start)
        for c in contexts:
            for name, ids in tokenized:
                plan += [(c, name, ids, s) for s in window_starts(len(ids), c + score_tokens, windows, name)]
        run = _Run(loaded, specs, score_tokens, prefill_chunk, len(plan) * len(specs), on_progress, one_by_one)
        run.writer = writer
        guard = RunWatch(
            loaded,
            specs,
            prompt_tokens=max(contexts),
            steps=score_tokens,
            prefill_chunk=prefill_chunk,
            rows=1 if one_by_one else len(specs),
            what="evaluation",
        )
        if writer is not None:  # an unfinished run of this same command is resumed: its rows are not measured again
            run.measured = writer.resume(
                {run.key(spec, c, name, start) for c, name, _, start in plan for spec in specs}
            )
            run.done = len(run.measured)
    except BaseException:
        if writer is not None:
            writer.fail()  # rows resumed already are kept (NAME.incomplete.csv); else no file
        raise

    status, reason = "complete", ""
    try:
        for c, name, ids, start in plan:
            if should_stop is not None and should_stop():
                status, reason = "incomplete", f"stopped by request {run.progress()}"
                break
            verdict = guard.check()
            if verdict:
                status, reason = "incomplete", f"{verdict} {run.progress()}"
                break
            run.window(c, name, ids[start : start + c + score_tokens], start, should_stop)
            if run.stopped:
                status, reason = "incomplete", f"stopped by request {run.progress()}"
                break
    except KeyboardInterrupt as e:
        how = str(e) or "Ctrl-C"  # the CLI raises KeyboardInterrupt("SIGTERM") on a SIGTERM
        evaluation = _finish(run, "incomplete", f"interrupted ({how}) {run.progress()}", writer)
        raise EvaluationInterrupted(evaluation) from None
    except OSError as e:
        if writer is not None and e.filename == str(writer.path):  # the disk refused a row: keep what is flushed
            kept = writer.fail()
            if kept is not None:
                e.strerror = f"{e.strerror}; the {writer.rows} row(s) measured so far are in {kept}"
            raise
        _finish(run, "incomplete", f"error {run.progress()}: {type(e).__name__}: {e}", writer)
        raise
    except BaseException as e:
        _finish(run, "incomplete", f"error {run.progress()}: {type(e).__name__}: {e}", writer)
        raise
    return _finish(run, status, reason, writer)


def _finish(run: _Run, status: str, reason: str, writer: EvaluationWriter | None) -> Evaluation:
    evaluation = Evaluation(typed_frame(run.rows, "sample"), status=status, reason=reason, notes=dict(run.notes))
    if writer is not None:
        written = writer.close(status == "complete")
        if written is not None:  # what the file holds: the resumed rows and this run's
            written.status, written.reason, written.notes = status, reason, dict(run.notes)
            return written
    return evaluation


class _Run:
    """The measuring loop's state: the model, the strategies and the rows so far."""

    def __init__(
        self,
        loaded: LoadedModel,
        specs: list[Spec],
        score_tokens: int,
        prefill_chunk: int,
        total: int,
        on_progress: Callable[[EvaluationStep], None] | None,
        one_by_one: bool = False,
    ):
        self.loaded = loaded
        self.probe = probe_for(loaded)
        self.one_by_one = one_by_one
        self.notes: dict[str, str] = {}
        self.specs = specs
        self.score_tokens = score_tokens
        self.prefill_chunk = prefill_chunk
        self.total = total
        self.on_progress = on_progress
        self.rows: list[dict] = []
        self.done = 0
        self.stopped = False
        self.writer: EvaluationWriter | None = None
        self.measured: set[tuple] = set()  # keys of measurements an earlier run of this command took

    def identity(self, spec: Spec, context: int, text: str, start: int) -> dict:
        """What makes one strategy x window one measurement: the columns a sample row starts with."""
        info = self.loaded.info
        return {
            "model": info.name,
            "backend": info.backend,
            "device": info.device,
            "dtype": info.dtype,
            "strategy": str(spec),
            "reference": str(self.specs[0]),
            "context": context,
            "score_tokens": self.score_tokens,
            "prefill_chunk": self.prefill_chunk,
            "text": text,
            "window_start": start,
        }

    def key(self, spec: Spec, context: int, text: str, start: int) -> tuple:
        """The measurement key (:func:`~cachelib.profile.evaluation_writer.row_key`) of one strategy x window."""
        return row_key(self.identity(spec, context, text, start), "sample")

    def progress(self) -> str:
        return f"after {self.done} of {self.total} measurements"

    def window(self, context: int, text: str, window: list[int], start: int, should_stop) -> None:
        prefix, targets = window[:context], window[context:]
        todo = [spec for spec in self.specs if self.key(spec, context, text, start) not in self.measured]
        if not todo:
            return  # measured by an earlier run of this command
        # the reference's logits are what the others are compared with: computed again when it was measured
        needed = [self.specs[0]] + [spec for spec in todo if spec is not self.specs[0]]
        reference = None  # (float32 logits (score_tokens, vocab), per-step log-prob of the true token)
        batched = self._batch(prefix, targets, needed)  # str(spec) -> (logits, views, seconds)
        for spec in needed:
            if reference is not None and should_stop is not None and should_stop():
                self.stopped = True
                return
            if str(spec) in batched:
                logits, views, seconds = batched.pop(str(spec))
            else:
                t0 = time.perf_counter()
                cache = self.probe.make_cache(spec)
                with self.probe.capture(cache):  # importance caches get each step's queries
                    logits = teacher_forced_logits(self.loaded, cache, prefix, targets, self.prefill_chunk)
                views = self.probe.views(cache)
                del cache  # one strategy's cache alive at a time
                seconds = time.perf_counter() - t0
            if reference is None:
                reference = (logits, np.array([compare(row, row, t)[2] for row, t in zip(logits, targets)]))
                kl, agree, logprob = np.zeros(len(targets)), np.ones(len(targets)), reference[1]
            else:
                steps = [compare(ref, row, t) for ref, row, t in zip(reference[0], logits, targets)]
                kl, agree, logprob = (np.array(x, dtype=np.float64) for x in zip(*steps))
            del logits
            if spec in todo:
                self._add(spec, context, text, start, kl, agree, logprob, reference[1], views, seconds)

    def _batch(self, prefix: list[int], targets: list[int], specs: list[Spec]) -> dict[str, tuple]:
        """The window's strategies that share one strategy batch, measured together."""
        if self.one_by_one:
            return {}
        runner = Runner(self.loaded)
        caches, joined = [], []
        for spec in specs:
            cache = self.probe.make_cache(spec)
            problem = runner.batch_problem(cache)
            if problem:
                self.notes[str(spec)] = problem
            else:
                caches.append(cache)
                joined.append(spec)
        if len(joined) < 2:  # a batch of one row is the one-by-one run
            return {}
        t0 = time.perf_counter()
        logits = teacher_forced_logits_rows(self.loaded, caches, prefix, targets, self.prefill_chunk)
        seconds = time.perf_counter() - t0  # the batch's time, shared by its rows
        return {str(spec): (logits[i], self.probe.views(c), seconds) for i, (spec, c) in enumerate(zip(joined, caches))}

    def _add(self, spec, context, text, start, kl, agree, logprob, logprob_ref, views, seconds) -> None:
        nll, nll_ref = float(-np.mean(logprob)), float(-np.mean(logprob_ref))
        window = spec.window
        row = {
            **self.identity(spec, context, text, start),
            "mean_kl": float(np.mean(kl)),
            "top1_agreement": float(np.mean(agree)),
            "nll": nll,
            "nll_reference": nll_ref,
            "ppl": math.exp(nll),
            "ppl_reference": math.exp(nll_ref),
            "delta_ppl": math.exp(nll) - math.exp(nll_ref),
            "kept_fraction": 1.0 if window is None else min(1.0, window / context),
            "tokens_held": max((v.tokens_held for v in views), default=0),
            "bytes_allocated": sum(v.bytes_allocated for v in views),
            "seconds": seconds,
        }
        if self.writer is not None:
            self.writer.add(row)  # on disk before the next measurement starts
        self.rows.append(row)
        self.done += 1
        if self.on_progress is not None:
            self.on_progress(EvaluationStep(self.done, self.total, row))
