"""The planner's answer, in the runtime's own terms: the strategy to deploy written as the
runtime's command line, the sessions it serves, one device's memory and its quality, one line
each. The CLI (``python -m cachelib plan``) and the app's Planner page both render
:func:`build_answer`'s :class:`Answer`, so they print the same block.

:func:`runtime_flags` is the one place a strategy becomes a runtime's flags (None: the runtime
cannot run it natively; it then goes to "with cachelib's caches in your code"):

- ``mlx-lm`` (``mlx_lm/generate.py`` 0.32.2, its argparse flags): ``standard`` is no flag,
  ``rotating:max_size=N,keep=4`` is ``--max-kv-size N`` (``make_prompt_cache``), and
  ``quantized:bits=B,group_size=G,start=S`` is ``--kv-bits B`` with ``--kv-group-size G`` (default
  64) and ``--quantized-kv-start S`` (default 5000) where they differ from mlx-lm's defaults;
- ``transformers`` (``transformers/cache_utils.py`` 5.24): ``DynamicCache(config=...)``,
  ``StaticCache(config=..., max_cache_len=N)``, ``DynamicCache(..., offloading=True)``;
- ``vllm`` and ``llama.cpp`` allocate their own cache: only ``standard``, with the KV format as
  ``--kv-cache-dtype fp8`` (vLLM ``EngineArgs``) or ``-ctk/-ctv q8_0`` (llama.cpp ``common/arg.cpp``,
  whose quantized V cache needs flash attention, ``-fa on``).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.units import human_gib
from ..spec import Spec, mlx_flags, parse_spec
from .layouts import MLX_OWN_MAKE_CACHE, mlx_module
from .quality import is_exact, meets
from .runtimes import MLX_LM_QUANTIZED_KV_START, own_loop

if TYPE_CHECKING:  # types only; PlanRequest and PlanResult (cachelib.plan.request, which imports this module)
    from .solver import Fit  # are named in annotations, not imported: no cycle

MLX_LM_GROUP_SIZE = 64  # mlx_lm/generate.py: --kv-group-size default
RUNTIME_SET = {  # the strategies planned when none is given: what each runtime offers natively
    "mlx-lm": ("standard", "quantized:bits=8", "quantized:bits=4"),
    "transformers": ("standard", "offloaded"),
    "vllm": ("standard",),
    "llama.cpp": ("standard",),
    "cachelib": ("standard", "rotating:max_size=4096", "quantized:bits=8", "quantized:bits=4", "kivi"),
}


def default_strategies(runtime: str | None, arch=None, backend: str = "mlx") -> tuple[str, ...]:
    """The runtime's standard set: what is planned when the user lists no strategy; with
    ``arch``, less what that model refuses (a quantization group its head dims do not divide)."""
    specs = RUNTIME_SET.get(runtime or "cachelib", RUNTIME_SET["cachelib"])
    if arch is None:
        return specs
    from .accounting import account  # accounting imports nothing of this module's callers

    kept = []
    for spec in specs:
        try:
            account(arch, spec, backend if backend in ("mlx", "torch") else "torch", context=16)
        except ValueError:
            continue
        kept.append(spec)
    return tuple(kept) or ("standard",)


def runtime_flags(spec: str | Spec, runtime: str | None, model_type: str | None = None) -> list[str] | None:
    """The cache flags (or constructor arguments) ``runtime`` takes for ``spec``; None when the
    runtime cannot run it natively. In cachelib's own loop every strategy is cachelib's own: [].
    ``model_type``: the model's; mlx-lm ignores ``--max-kv-size`` for a class with its own
    ``make_cache`` (llama among them), so a ring is no mlx-lm option there."""
    s = parse_spec(spec)
    if own_loop(runtime):
        return []
    if runtime == "mlx-lm":
        flags = mlx_flags(s)
        if flags is None:
            return None
        if "max_kv_size" in flags and model_type and mlx_module(model_type) in MLX_OWN_MAKE_CACHE:
            return None
        defaults = {"kv_group_size": MLX_LM_GROUP_SIZE, "quantized_kv_start": MLX_LM_QUANTIZED_KV_START}
        out = []
        for flag, value in flags.items():  # a flag left at mlx-lm's default is not written
            if value != defaults.get(flag):
                out += ["--" + flag.replace("_", "-"), str(value)]
        return out
    if runtime == "transformers":
        return None if s.transformers_cache is None else [s.transformers_cache]
    return [] if s.reference else None  # vllm, llama.cpp: their own cache


def model_ref(arch, model: str | None = None) -> str:
    """The model as a runtime's command names it: the Hugging Face repo of a preset, else the
    path given, else ``MODEL``."""
    found = re.match(r"https://huggingface\.co/(.+?)/blob/", getattr(arch, "source", "") or "")
    if found:
        return found.group(1)
    return model or "MODEL"


# The keyword ``generate`` takes a cache object by: ``cache`` from transformers 5.24.0 on, where
# ``past_key_values`` became a deprecated alias (generation/utils.py:
# ``deprecate_kwarg("past_key_values", "6.0.0", new_name="cache")``; absent in 5.23.0's wheel).
GENERATE_CACHE_KEYWORD = ("5.24", "cache", "past_key_values")


def runtime_command(
    request: PlanRequest,  # noqa: F821 (a string annotation: see TYPE_CHECKING above)
    spec: str | Spec,
    model: str,
    sessions: int | None = None,
    model_type: str | None = None,
) -> str | None:
    """``spec`` deployed as ``request``'s runtime runs it, as one command line (or, for
    transformers, the cache to pass to ``generate``); None when the runtime cannot run it.
    ``sessions``: the concurrent sessions the command should serve (llama.cpp's ``-np``)."""
    runtime = request.runtime
    flags = runtime_flags(spec, runtime, model_type)
    if flags is None:
        return None
    d = request.deployment
    if own_loop(runtime):
        lib = "cachelib.mlx" if request.backend == "mlx" else "cachelib.torch"
        return f'{lib}.make_cache(model, "{parse_spec(spec)}")  # cachelib\'s cache in your code'
    if runtime == "mlx-lm":
        return shlex.join(["mlx_lm.generate", "--model", model, *flags])
    if runtime == "transformers":
        since, name, before = GENERATE_CACHE_KEYWORD
        return f"model.generate(**inputs, {name}={flags[0]})  # transformers >= {since}; {before}= before"
    if runtime == "vllm":
        length = getattr(request, "max_model_len", None) or request.context  # a later --max-model-len wins
        argv = ["vllm", "serve", model, "--max-model-len", str(length)]
        if request.kv_format:
            argv += ["--kv-cache-dtype", request.kv_format]
        argv += ["--gpu-memory-utilization", f"{d.gpu_memory_utilization:g}"]
        if request.tp > 1:
            argv += ["-tp", str(request.tp)]
        if request.pp > 1:
            argv += ["-pp", str(request.pp)]
        if request.max_num_seqs is not None:
            argv += ["--max-num-seqs", str(request.max_num_seqs)]
        return shlex.join(argv)
    if runtime == "llama.cpp":  # -c is shared by the -np slots: each slot holds -c / -np tokens
        slots = max(1, sessions or request.slots or request.sessions or 1)
        argv = [
            "llama-server",
            "-m",
            model if model.endswith(".gguf") else f"{model}.gguf",
            "-c",
            str(request.context * slots),
            "-np",
            str(slots),
        ]
        if request.kv_format:
            argv += ["-ctk", request.kv_format, "-ctv", request.kv_format, "-fa", "on"]
        for flag, on in (("--kv-unified", request.kv_unified), ("--swa-full", request.swa_full)):
            if on:
                argv.append(flag)
        if request.ubatch is not None:
            argv += ["-ub", str(request.ubatch)]
        return shlex.join(argv)
    return None


def code_line(spec: str | Spec, backend: str) -> str:
    """``spec`` as cachelib's cache built in your own code."""
    lib = "cachelib.mlx" if backend == "mlx" else "cachelib.torch"
    return f'{lib}.make_cache(model, "{parse_spec(spec)}")'


def quality_line(fit: Fit, max_kl: float | None, min_agreement: float | None, verdict: str | None = None) -> str:
    """The quality of ``fit`` with its evidence, and what the thresholds' bounds say, in one line."""
    q = fit.quality
    if q is None:
        return "not covered by evidence (no measured point keeps as little of its context)"
    if is_exact(q):
        return "exact: " + q.source.removeprefix("exact: ")
    if verdict is None:
        ok, why = meets(q, max_kl, min_agreement)
        verdict = ("meets: " if ok else "misses: ") + why
    ci = f" ± {q.mean_kl_ci95:.2g}" if q.mean_kl_ci95 is not None else ""
    ci1 = f" ± {q.top1_ci95:.1%}" if q.top1_ci95 is not None else ""
    where = f"{q.model} ({q.backend}) at {q.context:,} tokens" if q.context else q.model
    if q.kept_fraction is not None and q.kept_fraction < 1:
        where += f", kept {q.kept_fraction:.1%}"
    if "extrapolated" in q.note:
        where += ", extrapolated"
    n = f"{q.samples} samples, 95% CI" if q.mean_kl_ci95 is not None else "one sample"
    return f"mean KL {q.mean_kl:.3g}{ci} nats, top-1 {q.top1_agreement:.1%}{ci1} ({n}; {where}) -> {verdict}"


@dataclass(frozen=True)
class Answer:
    """The block both the CLI and the page open with (each field one line of text)."""

    title: str
    command: str  # the runtime's command line ("" when nothing is recommended)
    facts: tuple[str, ...]  # sessions, memory per device, quality, why
    side_by_side: tuple[str, ...] = ()  # a solve's ring and the KV bits that fit the same sessions
    in_code: tuple[str, ...] = ()  # qualified strategies the runtime cannot run natively
    steps: tuple[str, ...] = ()  # the rules that led to it (--explain)
    commands: tuple[str, ...] = ()  # evaluations that would measure what the evidence does not cover

    def lines(self) -> list[str]:
        """The block as text lines (no steps, no commands: those are --explain / --commands)."""
        out = [self.title]
        if self.command:
            out.append(f"  {self.command}")
        out += [f"  {line}" for line in self.facts]
        if self.side_by_side:
            out.append("  side by side, the same sessions:")
            out += [f"    {line}" for line in self.side_by_side]
        if self.in_code:
            out.append("  with cachelib's caches in your code (not options of the runtime):")
            out += [f"    {line}" for line in self.in_code]
        return out

    def text(self) -> str:
        return "\n".join(self.lines())


def _sessions_line(fit: Fit, request: PlanRequest) -> str:  # noqa: F821
    if fit.budget_bytes is None:
        return "sessions: no budget given (--budget), so none are counted"
    where = f"{request.context:,} tokens in {human_gib(fit.budget_bytes)} per device"
    if fit.fits is False:
        return f"sessions: none: one run of {where} needs {human_gib(fit.budget_needed)}"
    asked = ""
    if request.sessions:
        asked = f" ({request.sessions} asked: {'served' if (fit.sessions or 0) >= request.sessions else 'NOT served'})"
    return f"sessions: {fit.sessions} concurrent sessions of {where}{asked}; max batch {fit.max_batch}"


def _memory_line(fit: Fit) -> str:
    m = fit.device
    terms = ", ".join(f"{name} {human_gib(n)}" for name, n, _ in m.terms())
    budget = f" of {human_gib(fit.budget_bytes)}" if fit.budget_bytes is not None else ""
    return f"memory per device: {human_gib(m.total)}{budget} for one session ({terms})"


def _speed_line(spec: str, report, request) -> str | None:
    """``spec``'s decode speed from ``report`` (a :class:`~cachelib.plan.speed.SpeedReport`) in one
    line: tokens/s per session with the interval, all sessions', the time to first token and, with
    a speed threshold, the most sessions whose interval's low end meets it."""
    s = next((s for s in report.speeds if s.spec == spec), None)
    if s is None:
        return None
    tps = s.tokens_per_s
    line = (
        f"speed on {s.hardware}: {tps.value:.1f} tokens/s per session ({tps.low:.1f}-{tps.high:.1f}) at "
        f"{s.sessions} session{'s' if s.sessions != 1 else ''}, {s.aggregate_tokens_per_s.value:,.0f} in all"
    )
    if s.ttft_s is not None:
        line += f"; time to first token {s.ttft_s.value:.2f} s ({s.ttft_s.low:.2f}-{s.ttft_s.high:.2f})"
    if spec in report.most_sessions:
        n = report.most_sessions[spec][0]
        line += f"; at >= {request.min_tokens_per_s:g} tokens/s each (the interval's low end): {n} sessions"
    return line


def build_answer(result: PlanResult, model: str | None = None, speed=None) -> Answer:  # noqa: F821
    """The answer block of ``result``: the recommended strategy as its runtime's command, the
    sessions it serves, its speed (with ``speed``, the plan's
    :class:`~cachelib.plan.speed.SpeedReport`), one device's memory and its quality; a solve's
    alternatives side by side; what qualifies only as cachelib's caches in your code; the steps
    and uncovered commands."""
    r = result.request
    rec = result.choice
    ref = model_ref(result.arch, model)
    runtime = f"cachelib on {r.backend}" if own_loop(r.runtime) else r.runtime
    mt = result.arch.model_type or None
    fits = {f.spec: f for f in result.fits}
    side = []
    for solved in result.solved:
        whole = solved.spec is not None and solved.spec.window is not None and solved.spec.window >= r.context
        if solved.spec is None or whole:  # nothing fits, or no ring is needed: the solve's own sentence
            side.append(solved.text)
            continue
        f = fits.get(str(solved.spec))
        flags = runtime_flags(solved.spec, r.runtime, mt)
        how = shlex.join(flags) if flags else (str(solved.spec) if flags is None else "no flag")
        label = f"{solved.spec} ({how})" if flags else f"{solved.spec}"
        if flags is None:
            label += f" (no {runtime} option for {result.arch.name}: cachelib's cache in your code)"
        quality = quality_line(f, r.max_kl, r.min_agreement, rec.verdicts.get(f.spec)) if f else "not planned"
        side.append(f"{label}: {solved.sessions} sessions; {quality}")
    in_code = []
    for spec in rec.elsewhere:
        f = fits[spec]
        in_code.append(
            f"{code_line(spec, r.backend)}: {f.sessions if f.sessions is not None else '-'} sessions; "
            + quality_line(f, r.max_kl, r.min_agreement, rec.verdicts.get(spec))
        )
    f = rec.fit
    if f is None:  # nothing meets the rules: the runtime's own closest command, said to be unrecommended
        native = [g for g in result.fits if runtime_flags(g.spec, r.runtime, mt) is not None and g.fits is not False]
        if not native:
            title = f"answer: nothing to deploy on {runtime} for {result.arch.name} at {r.context:,} tokens"
            return Answer(
                title, "", (f"why: {rec.steps[-1][3:]}",), tuple(side), tuple(in_code), rec.steps, rec.commands
            )
        f = min(native, key=lambda g: (len(runtime_flags(g.spec, r.runtime, mt)), g.cache.peak_bytes))
        title = (
            f"answer: NOT RECOMMENDED, nothing meets the rules on {runtime} for {result.arch.name} at "
            f"{r.context:,} tokens; the closest, {f.spec}:"
        )
        why = "why not: " + rec.steps[-1][3:]
    else:
        flags = runtime_flags(f.spec, r.runtime, mt)
        what = f.spec + (" (no cache flag)" if flags == [] and r.runtime in ("mlx-lm", "vllm", "llama.cpp") else "")
        title = f"answer: {what} on {runtime} for {result.arch.name} at {r.context:,} tokens"
        why = "why: " + rec.steps[-1][3:]
    command = runtime_command(r, f.spec, ref, sessions=r.sessions or f.sessions, model_type=mt) or code_line(
        f.spec, r.backend
    )
    quality = quality_line(f, r.max_kl, r.min_agreement, rec.verdicts.get(f.spec))
    if r.kv_format and f.quality is None:
        quality = f"KV format {r.kv_format}: not measured (no evidence of it covers this context)"
    fast = _speed_line(f.spec, speed, r) if speed is not None else None
    facts = (_sessions_line(f, r), *([fast] if fast else []), _memory_line(f), "quality: " + quality, why)
    return Answer(title, command, facts, tuple(side), tuple(in_code), rec.steps, rec.commands)
