"""The quality price of each strategy, judged from measured evidence, and a recommendation.

:class:`Evidence` is one measured point: a strategy on one model and backend at one context,
with the share of that context its attention could still see (the kept fraction), how many
samples it averages and their 95% confidence intervals. :mod:`cachelib.profile.evidence` reads
it from evaluation files and profiles; this module reads nothing.

:func:`judge` decides what the evidence says about a strategy at a target context, and only as
far as it reaches:

- a lossless strategy is exact by construction, and so is a bounded one whose bound holds the
  whole target context;
- a bounded strategy (ring, sliding window, chunk) is judged by a point of the same family (the
  same strategy and knobs except its bound) measured at a kept fraction no larger than the
  target's (the closest one below it), so a window is never judged by runs that kept more of
  their context than it will;
- a lossy unbounded strategy (quantized, KIVI) by the same spec measured at a context at least
  as long as the target (the shortest such), else by its longest measured context, with an
  extrapolation note;
- a runtime's lossy KV format (``--kv-format fp8|q8_0|q4_0``) by the strategy of the same name,
  which stores it bit for bit (:func:`judge_kv_format`), never as exact;
- evidence of the planned model beats that of another model, and the planned backend beats the
  other backend, whose use is said; a bounded strategy uses its own backend's evidence only,
  because the backends' rings prefill differently.

Where nothing covers the target there is no quality: :func:`measure_command` prints the
evaluation that would measure it. :func:`choose` picks the strategy to deploy by conservative
rules (the 95% interval's bound decides a threshold; lossless first unless it does not serve the
request; only what the runtime runs natively; ties to the simplest flag set), and says each step.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence

from ..spec import Spec, make_spec, parse_spec
from .arch import Arch
from .runtimes import own_loop
from .solver import Fit, Quality

EVIDENCE_MODEL = "smollm2"  # the bundled model: what the default evidence was measured on
EVIDENCE_MAX_CONTEXT = 8192  # its context limit (positions)
EVIDENCE_SCORE_TOKENS = 64  # tokens the committed evidence scores after each context
# the longest context the evidence measures: context + score_tokens - 1 positions must fit the
# limit; the evidence grid (assets/sweeps/evidence.toml) uses this 8,128
EVIDENCE_LONGEST = EVIDENCE_MAX_CONTEXT - EVIDENCE_SCORE_TOKENS


@dataclass(frozen=True)
class Evidence:
    """One measured point: ``spec`` on ``model`` / ``backend`` at ``context`` tokens."""

    spec: str
    model: str
    backend: str
    context: int  # the context the quality was measured at
    kept_fraction: float  # share of the context attention could see at the end (1.0: everything)
    samples: int  # windows x texts of an evaluation, or runs of profiles
    mean_kl: float  # mean KL(full || strategy), nats
    top1_agreement: float
    mean_kl_ci95: float | None = None  # 95% CI half-widths (None: a single sample)
    top1_ci95: float | None = None
    delta_ppl: float | None = None  # perplexity minus the full cache's
    delta_ppl_ci95: float | None = None
    retrieval: float | None = None  # exact-match accuracy of the retrieval task, where measured
    kind: str = "evaluation"  # evaluation (long-context, chunked prefill) | profile (a decode run)
    files: tuple[str, ...] = ()

    def quality(self, note: str = "") -> Quality:
        where = f"{self.kind}, {self.samples} sample(s), {self.backend}: " + ", ".join(self.files)
        return Quality(
            self.mean_kl,
            self.top1_agreement,
            self.model,
            where,
            self.context,
            backend=self.backend,
            kept_fraction=self.kept_fraction,
            samples=self.samples,
            mean_kl_ci95=self.mean_kl_ci95,
            top1_ci95=self.top1_ci95,
            delta_ppl=self.delta_ppl,
            delta_ppl_ci95=self.delta_ppl_ci95,
            retrieval=self.retrieval,
            note=note,
        )


def bound_of(spec: str | Spec) -> int | None:
    """The token bound of an evicting strategy (ring size, window, chunk), else None: quality
    measured before the bound was reached says nothing about eviction."""
    return parse_spec(spec).window


def kept_fraction(spec: str | Spec, context: int) -> float:
    """The share of ``context`` tokens that ``spec``'s attention still sees at the end."""
    bound = bound_of(spec)
    return 1.0 if bound is None else min(1.0, bound / context)


def family(spec: str | Spec) -> tuple:
    """What a spec means apart from its bound: rings of different sizes with the same ``keep``
    are one family, judged against each other by kept fraction."""
    spec = parse_spec(spec)
    knob = spec.strategy.window
    return (spec.name, tuple(sorted((k, v) for k, v in spec.values.items() if k != knob)))


# strategies that keep every token at full precision: their predictions are the full cache's
EXACT = Quality(0.0, 1.0, "any model", "exact: keeps every token at full precision")  # by construction
WHOLE = Quality(0.0, 1.0, "any model", "exact: its bound holds the whole context, so nothing is evicted")


@dataclass(frozen=True)
class Judgement:
    """What the evidence says about one strategy at one target context."""

    spec: str
    quality: Quality | None  # None: not covered by the evidence
    reason: str  # why it is covered (or not), in one sentence
    command: str = ""  # the evaluation that would measure it, where not covered or extrapolated


def _names(planned: Arch | str | None) -> set[str]:
    if isinstance(planned, Arch):
        return set(planned.names)
    return {planned} if planned else set()


def judge(
    evidence: Sequence[Evidence],
    spec: str | Spec,
    *,
    backend: str,
    context: int,
    planned: Arch | str | None = None,
) -> Judgement:
    """What ``evidence`` says about ``spec`` at ``context`` tokens on ``backend`` (see the module
    docstring for the rules)."""
    spec = parse_spec(spec)
    text = str(spec)
    if spec.lossless:
        return Judgement(text, EXACT, "lossless: exact by construction")
    target_kept = kept_fraction(spec, context)
    bounded = spec.window is not None
    if bounded and target_kept >= 1.0 and spec.smallest_window >= context:
        return Judgement(text, WHOLE, f"its bound ({spec.window:,}) holds the whole {context:,}-token context")
    names = _names(planned)

    def preference(e: Evidence) -> tuple:
        return (e.model in names, e.backend == backend)

    if bounded:
        mine = family(spec)
        # Only the planned backend: rings prefill differently (mlx-lm windows each query of an
        # overflowing chunk; transformers' mask does not), so their quality does not carry over.
        # A point that evicted (kept < 1) and kept no more of its context than the target will.
        same = [e for e in evidence if family(e.spec) == mine and e.backend == backend]
        pool = [e for e in same if e.kept_fraction < 1.0 and e.kept_fraction <= target_kept * (1 + 1e-9)]
        if not pool:
            measured = sorted({e.kept_fraction for e in same})
            seen = (
                f"; measured kept fractions on {backend}: {', '.join(f'{k:.1%}' for k in measured)}" if measured else ""
            )
            others = sorted({e.backend for e in evidence if family(e.spec) == mine and e.backend != backend})
            if others:
                seen += f" (measured on {', '.join(others)} too, whose rings prefill differently: not used)"
            reason = (
                f"not covered by evidence: no run of this strategy kept {target_kept:.2%} of its context or less{seen}"
            )
            return Judgement(text, None, reason, measure_command(spec, context, backend))
        best = max(pool, key=lambda e: (preference(e), e.kept_fraction, e.context, e.samples))
        how = (
            f"judged at kept fraction {best.kept_fraction:.2%} ({best.spec} at {best.context:,} tokens) "
            f"for a target of {target_kept:.2%}"
        )
        note = _other(best, backend)
        return Judgement(text, best.quality(note=_join(how, note)), how)
    pool = [e for e in evidence if parse_spec(e.spec).key == spec.key]
    if not pool:
        reason = "not covered by evidence: this strategy was never measured"
        return Judgement(text, None, reason, measure_command(spec, context, backend))
    longer = [e for e in pool if e.context >= context]
    if longer:
        best = max(longer, key=lambda e: (preference(e), -e.context, e.samples))
        how = f"measured at {best.context:,} tokens, at least the target {context:,}"
        return Judgement(text, best.quality(note=_join(how, _other(best, backend))), how)
    best = max(pool, key=lambda e: (preference(e), e.context, e.samples))
    how = (
        f"extrapolated: measured up to {best.context:,} tokens, planned at {context:,}; quantization error "
        "accumulates over more tokens, so the quality there may be worse"
    )
    # the point judged is the preferred backend's; where the other backend measured the strategy
    # at a longer context, say what it found there (a reader weighs it; it is not judged)
    further = [e for e in pool if e.backend != best.backend and e.context > best.context and e.model == best.model]
    if further:
        f = max(further, key=lambda e: (e.context, e.samples))
        ci = f" ± {f.mean_kl_ci95:.2g}" if f.mean_kl_ci95 is not None else ""
        how += (
            f"; {f.backend} measured it up to {f.context:,} tokens: mean KL {f.mean_kl:.4g}{ci} nats, "
            f"top-1 agreement {f.top1_agreement:.1%}"
        )
    note = _join(how, _other(best, backend))
    return Judgement(text, best.quality(note=note), how, measure_command(spec, context, backend))


def _other(e: Evidence, backend: str) -> str:
    """The backend the point comes from, where it is not the planned one (the model is said once,
    by the recommendation and the CLI's evidence line)."""
    return f"measured on {e.backend}, not {backend}" if e.backend != backend else ""


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def measure_command(spec: str | Spec, context: int, backend: str, model: str = EVIDENCE_MODEL) -> str:
    """The evaluation that would measure ``spec`` at ``context``, scoring as the committed evidence
    does: on the bundled model the context is capped at the longest it can score
    (:data:`EVIDENCE_LONGEST`), and a bounded strategy keeps the target's kept fraction."""
    spec = parse_spec(spec)
    measured_at = min(context, EVIDENCE_LONGEST) if model == EVIDENCE_MODEL else context
    probe = spec
    if spec.window is not None and measured_at < context:
        size = max(1, round(spec.window * measured_at / context))
        probe = _with_bound(spec, size) or spec
    argv = [
        "python",
        "-m",
        "cachelib",
        "evaluate",
        "--model",
        model,
        "--backend",
        backend,
        "--context",
        str(measured_at),
        "--score-tokens",
        str(EVIDENCE_SCORE_TOKENS),
        "--strategy",
        "standard",
        "--strategy",
        str(probe),
        "--out",
        f"profiles/evidence/{_slug(str(probe))}-{measured_at}.csv",
    ]
    return shlex.join(argv)


def _with_bound(spec: Spec, size: int) -> Spec | None:
    """``spec`` with its bound set to ``size`` tokens; None where the knobs refuse it (e.g. a
    ring smaller than its sinks)."""
    knob = spec.strategy.window
    given = dict(spec.params) | {knob: size}
    try:
        return make_spec(spec.name, given)
    except ValueError:
        return None


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text).strip("-")


def scaled_candidates(evidence: Iterable[Evidence], context: int) -> list[Spec]:
    """For every measured bounded point, the same strategy at the target ``context`` with the
    same kept fraction: the sizes the evidence speaks for (``rotating:max_size=1024`` measured
    at 8,192 tokens -> ``rotating:max_size=4096`` at 32,768)."""
    out: dict[tuple, Spec] = {}
    for e in evidence:
        spec = parse_spec(e.spec)
        if spec.window is None or e.kept_fraction >= 1.0:
            continue
        size = max(1, math.ceil(e.kept_fraction * context))
        scaled = _with_bound(spec, size)
        if scaled is not None:
            out.setdefault(scaled.key, scaled)
    return list(out.values())


def judge_kv_format(
    evidence: Sequence[Evidence], kv_format: str, *, backend: str, context: int, planned: Arch | str | None = None
) -> Judgement:
    """What ``evidence`` says about a runtime's KV format (vLLM's ``fp8``, llama.cpp's ``q8_0`` /
    ``q4_0``): the strategy of the same name stores it bit for bit, so its measured points judge
    the format; unmeasured, the format is "not covered" (never exact: every one is lossy). The
    runtimes' own kernels do not run here; llama.cpp's (``ggml``) plans use the torch evidence."""
    on = backend if backend in ("mlx", "torch") else "torch"
    j = judge(evidence, kv_format, backend=on, context=context, planned=planned)
    how = f"--kv-format {kv_format} judged by strategy {kv_format}, which stores it bit for bit"
    quality = None if j.quality is None else replace(j.quality, note=_join(how, j.quality.note))
    reason = f"{how}; {j.reason}" if quality is not None else f"quality not measured: {how}; {j.reason}"
    return replace(j, quality=quality, reason=reason)


def judge_fits(
    fits: Iterable[Fit],
    evidence: Sequence[Evidence],
    *,
    backend: str,
    planned: Arch | str | None = None,
    kv_format: str | None = None,
) -> tuple[list[Fit], dict[str, Judgement]]:
    """``fits`` with the quality the evidence gives each at its planned context, and the
    judgement behind each (keyed by spec text). Under a runtime's ``kv_format`` the cache holds
    that format, whatever the strategy: :func:`judge_kv_format` judges it."""
    out, judgements = [], {}
    for f in fits:
        if kv_format is not None:
            j = judge_kv_format(evidence, kv_format, backend=backend, context=f.cache.context, planned=planned)
        else:
            j = judge(evidence, f.spec, backend=backend, context=f.cache.context, planned=planned)
        judgements[f.spec] = j
        out.append(replace(f, quality=j.quality))
    return out, judgements


def _exact(fit: Fit) -> Fit:
    """A lossless strategy's fit, with its quality known by construction when none was given."""
    if fit.quality is not None or not parse_spec(fit.spec).lossless:
        return fit
    return replace(fit, quality=EXACT)


def _ci(value: float | None, fmt: str) -> str:
    return "" if value is None or value != value else f" ± {format(value, fmt)}"


def describe(q: Quality) -> str:
    """One phrase: the figures, their confidence interval, and where they come from."""
    if q in (EXACT, WHOLE):
        return q.source
    ci_note = "95% CI" if q.mean_kl_ci95 is not None else "one sample, no CI"
    parts = [
        f"mean KL {q.mean_kl:.4g}{_ci(q.mean_kl_ci95, '.2g')} nats",
        f"top-1 agreement {q.top1_agreement:.1%}{_ci(q.top1_ci95, '.1%')}",
    ]
    if q.delta_ppl is not None:
        parts.append(f"Δppl {q.delta_ppl:+.3g}{_ci(q.delta_ppl_ci95, '.2g')}")
    if q.retrieval is not None:
        parts.append(f"retrieval {q.retrieval:.0%}")
    where = f"measured on {q.model}"
    if q.backend:
        where += f" ({q.backend})"
    if q.context:
        where += f" at {q.context:,} tokens"
    if q.kept_fraction is not None and q.kept_fraction < 1:
        where += f", kept fraction {q.kept_fraction:.2%}"
    text = f"{', '.join(parts)} ({ci_note}), {where}"
    return text + (f" [{q.note}]" if q.note else "")


# --- the recommendation: conservative rules, each written once, each step said ---------------------


def is_exact(q: Quality | None) -> bool:
    """Quality known by construction (a lossless strategy, or a bound holding the whole context)."""
    return q is not None and (q in (EXACT, WHOLE) or (not q.samples and q.mean_kl == 0 and q.top1_agreement == 1))


def meets(q: Quality | None, max_kl: float | None = None, min_agreement: float | None = None) -> tuple[bool, str]:
    """Whether ``q`` meets the thresholds by its 95% interval, not its mean: the KL's upper bound
    at most ``max_kl`` and the top-1 agreement's lower bound at least ``min_agreement``; one
    sample (no interval) settles nothing. The text says which bound decided."""
    if q is None:
        return False, "not covered by evidence"
    if is_exact(q):
        return True, "exact"
    if max_kl is None and min_agreement is None:
        return False, "lossy, and no threshold (--max-kl / --min-agreement) says how much loss is acceptable"
    ok, parts = True, []
    if max_kl is not None:
        if q.mean_kl_ci95 is None or q.mean_kl_ci95 != q.mean_kl_ci95:
            ok = False
            parts.append(f"mean KL {q.mean_kl:.3g} from one sample: no 95% interval to bound it")
        else:
            hi = q.mean_kl + q.mean_kl_ci95
            ok &= hi <= max_kl
            parts.append(f"mean KL's upper 95% bound {hi:.3g} {'<=' if hi <= max_kl else '>'} {max_kl:g} nats")
    if min_agreement is not None:
        if q.top1_ci95 is None or q.top1_ci95 != q.top1_ci95:
            ok = False
            parts.append(f"top-1 agreement {q.top1_agreement:.1%} from one sample: no 95% interval to bound it")
        else:
            lo = q.top1_agreement - q.top1_ci95
            ok &= lo >= min_agreement
            parts.append(
                f"top-1 agreement's lower 95% bound {lo:.1%} {'>=' if lo >= min_agreement else '<'} {min_agreement:.0%}"
            )
    return ok, "; ".join(parts)


@dataclass(frozen=True)
class Recommendation:
    fit: Fit | None  # the pick, or None when nothing deployable and covered meets the rules
    text: str  # the pick and the evidence it rests on (or why there is none), in a few sentences
    qualified: tuple[str, ...]  # specs that meet the thresholds by their 95% bounds (with evidence)
    unmeasured: tuple[str, ...]  # planned specs the evidence does not cover
    commands: tuple[str, ...] = ()  # what would measure the uncovered ones, one command each
    steps: tuple[str, ...] = ()  # the rules applied, in order: what --explain prints
    verdicts: dict[str, str] = field(default_factory=dict)  # spec -> which bound decided (or why not judged)
    elsewhere: tuple[str, ...] = ()  # qualified and serving, but not runnable natively by the runtime


def _exact(fit: Fit) -> Fit:
    """A lossless strategy's fit, with its quality known by construction when none was given."""
    if fit.quality is not None or not parse_spec(fit.spec).lossless:
        return fit
    return replace(fit, quality=EXACT)


def _wanted(max_kl: float | None, min_agreement: float | None) -> str:
    parts = [
        f"mean KL <= {max_kl:g} nats" if max_kl is not None else "",
        f"top-1 agreement >= {min_agreement:.0%}" if min_agreement is not None else "",
    ]
    return " and ".join(p for p in parts if p) or "no loss (no threshold given)"


def _check_thresholds(max_kl: float | None, min_agreement: float | None) -> None:
    if max_kl is not None and not (max_kl >= 0 and math.isfinite(max_kl)):
        raise ValueError(f"max_kl must be a finite number >= 0, got {max_kl}")
    if min_agreement is not None and not 0 <= min_agreement <= 1:
        raise ValueError(f"min_agreement must be between 0 and 1, got {min_agreement}")


def recommend(
    fits: Iterable[Fit],
    *,
    max_kl: float | None = None,
    min_agreement: float | None = None,
    planned_model: str | Arch | None = None,
    judgements: dict[str, Judgement] | None = None,
    **rules,
) -> Recommendation:
    """:func:`choose` with at least one quality threshold (else a ValueError naming them)."""
    if max_kl is None and min_agreement is None:
        raise ValueError("give a quality threshold: max_kl (mean KL, nats) and/or min_agreement (0..1)")
    return choose(
        fits, max_kl=max_kl, min_agreement=min_agreement, planned_model=planned_model, judgements=judgements, **rules
    )


def choose(
    fits: Iterable[Fit],
    *,
    max_kl: float | None = None,
    min_agreement: float | None = None,
    planned_model: str | Arch | None = None,
    judgements: dict[str, Judgement] | None = None,
    sessions: int | None = None,
    most_sessions: bool = False,
    runtime: str | None = None,
    flags: Callable[[str], Sequence[str] | None] | None = None,
    kv_format: str | None = None,
) -> Recommendation:
    """The strategy to deploy, by these rules, in this order (each one a step of the answer):

    1. only what the runtime runs natively (``flags(spec)`` is not None) can be its answer; the
       others that qualify are listed in ``elsewhere`` (cachelib's caches in your own code);
    2. a strategy meets the thresholds only when its 95% interval does (:func:`meets`); one the
       evidence does not cover is never recommended; without a threshold only lossless ones meet;
    3. it must serve the request: fit the budget, and hold ``sessions`` sessions when given;
    4. a lossless strategy that serves wins over any lossy one, unless ``most_sessions``;
    5. among the rest: the most sessions when ``most_sessions``, else the smallest loss (the KL's
       upper bound); ties go to the simplest flag set (fewest flags), then the smaller cache peak.

    With a lossy ``kv_format`` (vLLM fp8, llama.cpp q8_0) no fit is exact by construction: each
    carries the quality its format's evidence gives (None: not measured)."""
    _check_thresholds(max_kl, min_agreement)
    judgements = judgements or {}
    fits = list(fits) if kv_format else [_exact(f) for f in fits]
    unmeasured = tuple(f.spec for f in fits if f.quality is None)
    commands = tuple(judgements[s].command for s in unmeasured if s in judgements and judgements[s].command)
    wanted = _wanted(max_kl, min_agreement)
    where = "cachelib's caches" if own_loop(runtime) else runtime

    def n_flags(spec: str) -> tuple[int, int]:
        """(flags, their characters): DynamicCache(config=...) is simpler than its offloading=True form."""
        got = flags(spec) if flags is not None else ()
        return (len(got), len(" ".join(got))) if got is not None else (99, 0)

    steps = [f"planned {len(fits)} strateg{'y' if len(fits) == 1 else 'ies'}: {', '.join(f.spec for f in fits)}"]
    native = [f for f in fits if flags is None or flags(f.spec) is not None]
    foreign = [f for f in fits if f not in native]
    if foreign:
        steps.append(
            f"1. {runtime} runs natively {', '.join(f.spec for f in native) or 'none of them'}; not its "
            f"options (cachelib's caches in your code): {', '.join(f.spec for f in foreign)}"
        )
    verdicts = {}
    for f in fits:
        ok, why = meets(f.quality, max_kl, min_agreement)
        verdicts[f.spec] = ("meets: " if ok else "misses: ") + why
    ok_all = [f for f in fits if verdicts[f.spec].startswith("meets")]
    steps.append(
        f"2. meet {wanted} by the 95% interval's bound: {', '.join(f.spec for f in ok_all) or 'none'}"
        + "".join(f"; {f.spec} {verdicts[f.spec]}" for f in fits if f.quality is not None and not is_exact(f.quality))
    )

    def serves(f: Fit) -> bool:
        return f.fits is not False and (sessions is None or f.sessions is None or f.sessions >= sessions)

    need = "fit the budget" + (f" with {sessions} sessions" if sessions else "")
    served = [f for f in ok_all if serves(f)]
    shown = [f"{f.spec} ({f.sessions} session(s))" if f.sessions is not None else f.spec for f in served]
    steps.append(f"3. of those, {need}: {', '.join(shown) or 'none'}")
    elsewhere = tuple(f.spec for f in served if f in foreign)
    pool = [f for f in served if f in native]
    exact = [f for f in pool if is_exact(f.quality)]

    def loss(f: Fit) -> float:
        q = f.quality
        return 0.0 if is_exact(q) else q.mean_kl + (q.mean_kl_ci95 or 0.0)

    def simple(f: Fit) -> tuple:
        return (*n_flags(f.spec), f.cache.peak_bytes)

    if exact and not most_sessions:
        pick = min(exact, key=simple)
        steps.append(
            f"4. {pick.spec} is lossless and serves the request: lossy strategies are not needed"
            + (f" (simplest of {', '.join(f.spec for f in exact)})" if len(exact) > 1 else "")
        )
    elif pool:
        if most_sessions:
            pick = min(pool, key=lambda f: (-(f.sessions or 0), *simple(f)))
            steps.append(f"4. the most sessions asked: {pick.spec} serves {pick.sessions} (ties: the simplest flags)")
        else:
            pick = min(pool, key=lambda f: (loss(f), *simple(f)))
            steps.append(
                f"4. no lossless strategy serves the request; {pick.spec} has the smallest loss "
                "(KL's upper 95% bound) of those that do (ties: the simplest flags)"
            )
    else:
        pick = None
        steps.append(f"4. nothing {where} runs natively meets {wanted} and serves the request")
    caveat = f" Not covered by evidence, so not recommended: {', '.join(unmeasured)}." if unmeasured else ""
    qualified = tuple(f.spec for f in ok_all)
    if pick is None:
        text = f"No planned strategy {where} runs natively meets {wanted} by its 95% interval and {need}."
        if elsewhere:
            text += f" With cachelib's caches in your code: {', '.join(elsewhere)}."
        return Recommendation(None, text + caveat, qualified, unmeasured, commands, tuple(steps), verdicts, elsewhere)
    q = pick.quality
    text = f"{pick.spec}: {steps[-1][3:]}. Evidence: {describe(q)}."
    names = _names(planned_model)
    if names and not is_exact(q) and q.model not in names:
        shown = planned_model.name if isinstance(planned_model, Arch) else planned_model
        text += (
            f" Measured on {q.model}, not on {shown}: treat it as an estimate for {shown}, or evaluate "
            f"{shown} itself (cachelib evaluate --model PATH on a local folder of it)."
        )
    if pick.sessions is not None:
        text += f" {pick.sessions} concurrent session(s) fit the budget."
    return Recommendation(pick, text + caveat, qualified, unmeasured, commands, tuple(steps), verdicts, elsewhere)
