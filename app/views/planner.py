"""Planner: the answer first (the strategy to deploy in the runtime's own flags, the sessions it
serves, one device's memory, its quality), then the cache each strategy needs at a context, what
fits in a memory budget and the evidence; the numbers and the answer block of
``python -m cachelib plan``."""

from __future__ import annotations

import shlex
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import pandas as pd
import streamlit as st

from app import plan_charts, profile_folder
from app.keys import Keys
from app.panels import PLOTLY_CONFIG
from app.plain import md
from app.retrieval_charts import retrieval_heatmap, retrieval_heatmap_info
from app.speed_charts import speed_section, speed_values
from app.widgets import int_field
from cachelib.cli.plan import SESSIONS_TEXT
from cachelib.core.units import DTYPE_BYTES, human_gib
from cachelib.plan import (
    Arch,
    Fit,
    PlanRequest,
    PlanResult,
    chart_range,
    context_grid,
    frontier_curves,
    memory_bytes,
    memory_curves,
    plan_request,
    preset_names,
    resolve_model,
)
from cachelib.plan.answer import Answer, build_answer, default_strategies
from cachelib.plan.device import WEIGHT_FORMATS
from cachelib.plan.request import DEVICES, SOLVE, request_defaults
from cachelib.plan.runtimes import RUNTIMES, describe_layout, resolve_runtime, runtime_names
from cachelib.plan.speed import SpeedReport, speed_report
from cachelib.profile.evidence import DEFAULT_EVIDENCE, EvidenceSet, load_evidence
from cachelib.spec import STRATEGIES

CONFIG = "a config.json…"
COMMITTED = "committed evidence (assets/evidence)"
REQUEST = request_defaults()  # the CLI's defaults: one source (cachelib.plan.request.PlanRequest's fields)
GiB = 2**30
# the example the page opens with (the CLI has no default for these: it asks for them)
EXAMPLE: dict[str, Any] = {
    "plan_model": "llama-3.1-8b",
    "plan_context": 32768,
    "plan_budget": 24.0,
    "plan_runtime": "mlx-lm",
}
DEFAULTS: dict[str, Any] = {  # widget key -> first value
    **EXAMPLE,
    "plan_config": "",
    "plan_backend": REQUEST["backend"],
    "plan_dtype": REQUEST["dtype"],
    "plan_batch": REQUEST["batch"],
    "plan_prefill": REQUEST["prefill"],
    "plan_prefill_chunk": REQUEST["prefill_chunk"],
    "plan_strategies": "",
    "plan_tp": REQUEST["tp"],
    "plan_pp": REQUEST["pp"],
    "plan_kv_format": REQUEST["kv_format"] or "dtype",
    "plan_device": REQUEST["device"],
    "plan_weights": None,
    "plan_weights_dtype": REQUEST["weights_dtype"] or "published",
    "plan_reserve": REQUEST["reserve_bytes"] / GiB,
    "plan_sessions": REQUEST["sessions"],
    "plan_solve": REQUEST["solve"] or "nothing",
    "plan_max_kl": REQUEST["max_kl"],
    "plan_min_agreement": REQUEST["min_agreement"],
    "plan_suggest": REQUEST["suggest"],
    "plan_most_sessions": REQUEST["most_sessions"],
    "plan_range": None,
    "plan_log": False,
    "plan_measure": "max_batch",
    "plan_evidence": [COMMITTED],
    "plan_shown": None,
    "plan_show_evidence": False,
}
OPTIONAL = {
    "plan_prefill_chunk",
    "plan_budget",
    "plan_weights",
    "plan_max_kl",
    "plan_min_agreement",
    "plan_sessions",
}  # empty: none
# whole-number fields, read as typed (app.widgets.int_field) with the CLI's lower bounds:
# key -> (least value, what an empty field means; None: it must be given)
INTEGERS: dict[str, tuple[int, str | None]] = {
    "plan_context": (1, None),
    "plan_sessions": (1, "any"),
    "plan_batch": (1, None),
    "plan_tp": (1, None),
    "plan_pp": (1, None),
    "plan_prefill": (0, "the whole context"),
    "plan_prefill_chunk": (1, "the runtime's"),
    "plan_range": (1, "2 x context, at most the model's"),
}
SHOWN_AT_ONCE = 6  # from this many strategies on, the charts draw those picked in "strategies shown"


# --- pure and cached -----------------------------------------------------------------------------


@st.cache_data(show_spinner=False, max_entries=64)
def _plan_request(arch: Arch, request: PlanRequest, evidence_key: tuple, _points: tuple) -> PlanResult:
    """The plan; ``evidence_key`` (the evidence files and their versions) keys ``_points``, which
    Streamlit does not hash (hashing ~130 points cost ~30 ms a rerun)."""
    return plan_request(arch, request, _points)


@st.cache_data(show_spinner=False, max_entries=32)
def _memory_curves(arch: Arch, request: PlanRequest, grid: tuple[int, ...]) -> pd.DataFrame:
    return memory_curves(arch, request, grid)


@st.cache_data(show_spinner=False, max_entries=32)
def _frontier_curves(arch: Arch, request: PlanRequest, grid: tuple[int, ...]) -> pd.DataFrame:
    return frontier_curves(arch, request, grid)


@st.cache_resource(show_spinner=False, max_entries=8)
def _evidence(paths: tuple[str, ...], version: tuple) -> EvidenceSet:
    """The evidence in ``paths`` (``version``, the files' mtimes and sizes, keys the cache); one
    shared, frozen set, not a copy unpickled on every rerun."""
    return load_evidence([Path(p) for p in paths]) if paths else EvidenceSet((), ())


def _version(paths: Sequence[Path]) -> tuple:
    files = []
    for root in paths:
        found = [root] if root.is_file() else sorted(root.rglob("*.csv")) if root.is_dir() else []
        files += [(str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in found]
    return tuple(files)


def evidence_choices() -> list[str]:
    """What the evidence picker offers: the committed set, then the folders and CSV files directly
    under the profiles folder (a team's own evaluations, sweeps and profiles)."""
    folder = profile_folder.profiles_dir()
    found = sorted(p for p in folder.iterdir() if p.is_dir() or p.suffix == ".csv") if folder.is_dir() else []
    return [COMMITTED, *(str(p) for p in found)]


def _evidence_paths(chosen: Sequence[str]) -> list[Path]:
    return [DEFAULT_EVIDENCE if c == COMMITTED else Path(c) for c in chosen]


class Planned(NamedTuple):
    result: PlanResult  # the fits (asked, a solve's, then suggested), weights, budget, the answer's pick
    values: dict[str, Any]  # the inputs it was planned from
    evidence: EvidenceSet
    command: str  # the python -m cachelib plan command that prints the same plan
    answer: Answer  # the block the CLI opens with
    model: str
    speed: SpeedReport | None = None  # with a device picked (and its figures for the dtype): the speed side

    @property
    def arch(self) -> Arch:
        return self.result.arch

    @property
    def fits(self) -> list[Fit]:
        return self.result.fits


def request_of(v: dict[str, Any]) -> tuple[str, Arch, PlanRequest]:
    """The model, its architecture and the request the page's fields make, read as the CLI reads
    its flags; ValueError (or OSError) on bad input."""
    model = v["plan_config"].strip() if v["plan_model"] == CONFIG else v["plan_model"]
    if not model:
        raise ValueError("give the path of a config.json (or of the folder holding it)")
    arch = resolve_model(model)
    runtime, backend = resolve_runtime(v["plan_runtime"], v["plan_backend"])
    listed = plan_charts.parse_strategies(v["plan_strategies"]) or list(default_strategies(runtime, arch, backend))
    request = PlanRequest(  # GiB read into bytes here, at the edge, as the CLI reads its flags
        listed,
        context=int(v["plan_context"]),
        batch=int(v["plan_batch"]),
        backend=backend,
        dtype=v["plan_dtype"],
        prefill=v["plan_prefill"],
        prefill_chunk=v["plan_prefill_chunk"],
        weights_bytes=memory_bytes("weights (GiB)", v["plan_weights"]),
        budget_bytes=memory_bytes("budget (GiB)", v["plan_budget"]),
        reserve_bytes=memory_bytes("reserve (GiB)", v["plan_reserve"]) or 0,
        weights_dtype=None if v["plan_weights_dtype"] == "published" else v["plan_weights_dtype"],
        runtime=runtime,
        tp=int(v["plan_tp"]),
        pp=int(v["plan_pp"]),
        kv_format=None if v["plan_kv_format"] == "dtype" else v["plan_kv_format"],
        device=v["plan_device"],
        sessions=v["plan_sessions"],
        solve=None if v["plan_solve"] == "nothing" else v["plan_solve"],
        max_kl=v["plan_max_kl"],
        min_agreement=v["plan_min_agreement"],
        suggest=bool(v["plan_suggest"]),
        most_sessions=bool(v["plan_most_sessions"]),
        hardware=v.get("plan_hardware"),
        min_tokens_per_s=v.get("plan_min_tokens_per_s") if v.get("plan_hardware") else None,
    )
    return model, arch, request


def compute(v: dict[str, Any]) -> Planned:
    """The whole plan and its answer from the inputs; ValueError (or OSError) on bad input."""
    model, arch, request = request_of(v)
    chosen = list(v["plan_evidence"])
    paths = _evidence_paths(chosen)
    key = (tuple(map(str, paths)), _version(paths))
    evidence = _evidence(*key)
    result = _plan_request(arch, request, key, evidence.points)
    extra = [_shown(p) for c, p in zip(chosen, paths) if c != COMMITTED]
    command = shlex.join(request.to_argv(model, extra, default_evidence=COMMITTED in chosen))
    speed = None
    if request.hardware is not None:
        try:
            speed = speed_report(arch, request, result.fits, flash_attn=request.flash_attn != "off")
        except ValueError:  # the speed section says why, under its own fields
            speed = None
    return Planned(result, dict(v), evidence, command, build_answer(result, model, speed), model, speed)


def _shown(path: Path) -> str:
    return str(path.relative_to(profile_folder.ROOT)) if path.is_relative_to(profile_folder.ROOT) else str(path)


# --- inputs ----------------------------------------------------------------------------------------


def _integer(label: str, key: str, help: str, found: dict[str, Any], problems: list[str], where: Any = st) -> None:
    """A whole-number field read as typed: its value goes into ``found``, or its problem (shown under
    the field) into ``problems``, and then nothing is planned with the value the field showed before."""
    lo, empty = INTEGERS[key]
    with nullcontext() if where is st else where:
        value, problem = int_field(label, key, lo=lo, hi=None, default=DEFAULTS[key], empty=empty, help=help)
    found[key] = value
    problems += [problem] if problem else []


def _number(label: str, key: str, help: str, where: Any = st, **options: Any) -> None:
    """A number input whose value lives in session state; an optional one reads None when cleared."""
    if DEFAULTS[key] is None or key in OPTIONAL:
        options["value"] = None  # the start value comes from session state; None is what a cleared field gives
    where.number_input(label, key=key, help=help, **options)


def inputs() -> tuple[dict[str, Any], list[str]]:
    """The fields' values (whole numbers parsed) and what does not parse, one line per field."""
    found: dict[str, Any] = {}
    problems: list[str] = []
    saved = st.session_state.setdefault(Keys.PLANNER_INPUTS, dict(DEFAULTS))
    for key, value in saved.items():
        st.session_state.setdefault(key, value)
    with st.sidebar:
        st.subheader("Model and runtime")
        presets = "published architectures, the bundled smollm2 and the tiny-* presets, or any config.json"
        st.selectbox("Model", [*preset_names(), CONFIG], key="plan_model", help=presets)
        if st.session_state["plan_model"] == CONFIG:
            st.text_input("config.json", key="plan_config", placeholder="/path/to/config.json or its folder")
        if st.session_state["plan_runtime"] not in RUNTIMES:  # "none" from before cachelib's loop had a name
            st.session_state["plan_runtime"] = "cachelib"
        st.selectbox(
            "Runtime",
            runtime_names(),
            key="plan_runtime",
            help="the runtime you deploy on: the answer is written in its own flags; cachelib: cachelib's "
            "caches in your own code (its profiler loop), on the backend picked below",
        )
        runtime = RUNTIMES[st.session_state["plan_runtime"]]
        if len(runtime.backends) > 1:  # cachelib's loop runs on both; any other runtime implies its backend
            rules = "the cache library whose allocation rules apply (they differ)"
            st.radio("Backend", list(runtime.backends), key="plan_backend", horizontal=True, help=rules)
        else:
            st.session_state["plan_backend"] = runtime.backend if runtime.backend in ("mlx", "torch") else "torch"
        split = [
            ("plan_tp", "Tensor parallel", "devices the heads are split over", runtime.tensor_parallel),
            ("plan_pp", "Pipeline stages", "stages the layers are split over", runtime.pipeline_parallel),
        ]
        shown = [x for x in split if x[3]]
        for (key, label, what, _), where in zip(shown, st.columns(len(shown)) if shown else []):
            _integer(label, key, what, found, problems, where=where)
        for key, label, _, allowed in split:
            if not allowed:
                st.session_state[key] = "1"  # not a choice on this runtime
                found[key] = 1
        formats = ["dtype", *runtime.kv_formats]
        if st.session_state.get("plan_kv_format") not in formats:  # another runtime's format (fp8 -> llama.cpp)
            st.session_state["plan_kv_format"] = "dtype"
        if len(formats) > 1:
            st.selectbox(
                "KV format",
                formats,
                key="plan_kv_format",
                help="the runtime's KV storage (vllm --kv-cache-dtype, llama.cpp -ctk/-ctv); dtype: the K/V dtype",
            )
        st.selectbox("K/V dtype", list(DTYPE_BYTES), key="plan_dtype")

        st.subheader("Workload")
        _integer("Context (tokens)", "plan_context", "tokens the cache holds at the end of a run", found, problems)
        left, right = st.columns(2)
        _integer(
            "Sessions",
            "plan_sessions",
            "concurrent sessions of the context the answer must serve; empty: as many as fit",
            found,
            problems,
            where=left,
        )
        _integer("Batch", "plan_batch", "sequences per run", found, problems, where=right)
        st.radio(
            "Solve for",
            ["nothing", *SOLVE],
            key="plan_solve",
            horizontal=True,
            help="the largest max_kv_size (mlx-lm's --max-kv-size ring) or the most KV bits that fit the sessions "
            "in the budget; both are shown side by side with their quality",
        )
        with st.expander("Prompt feeding"):
            rest = "the rest of the context is decoded one token at a time"
            _integer("Prompt tokens", "plan_prefill", rest, found, problems)
            chunks = "tokens per prompt update; empty: the runtime's own (mlx-lm and vllm 2048), else one update"
            _integer("Prefill chunk", "plan_prefill_chunk", chunks, found, problems)

        st.subheader("Strategies")
        grammar = (
            f"name[:knob=value,...], e.g. rotating:max_size=4096,keep=4. Strategies: {', '.join(STRATEGIES)}. "
            "Empty: the runtime's standard set. The first is the reference savings are counted against."
        )
        listed = ", ".join(default_strategies(runtime.name))
        st.text_area(
            "One spec per line",
            key="plan_strategies",
            height=110,
            help=grammar,
            placeholder=f"the runtime's standard set: {listed}",
        )
        st.checkbox(
            "Suggest from the evidence",
            key="plan_suggest",
            help="also plan what the evidence measured, its rings and windows scaled to this context "
            "(rounded up to sizes you would type)",
        )
        st.checkbox(
            "Most sessions first",
            key="plan_most_sessions",
            help="recommend the strategy serving the most sessions that meets the thresholds, lossy or not; "
            "otherwise a lossless one whenever it serves the request",
        )

        st.subheader("Memory")
        budget = (
            "one device's memory for weights + cache + activations + runtime overhead + reserve, in GiB "
            '(2^30 bytes: a "24 GB" GPU holds 24 GiB)'
        )
        _number("Budget (GiB)", "plan_budget", budget, min_value=0.0, step=1.0, placeholder="none")
        weights = "the weights one device holds, as measured, in GiB; empty: counted from the parameters"
        _number("Weights (GiB)", "plan_weights", weights, min_value=0.0, step=0.5, placeholder="params x precision")
        st.selectbox(
            "Weights dtype",
            ["published", *WEIGHT_FORMATS],
            key="plan_weights_dtype",
            help="precision the weights are counted at; published: the checkpoint's config.json dtype",
        )
        _number(
            "Reserve (GiB)", "plan_reserve", "kept free on each device beyond what is counted", min_value=0.0, step=0.5
        )
        st.radio(
            "Forward runs on",
            list(DEVICES),
            key="plan_device",
            horizontal=True,
            help="on the cpu MLX materialises the attention scores, which the activations then count",
        )

        st.subheader("Quality")
        kl = "the upper bound of the measured KL(full cache ‖ strategy)'s 95% interval must be at most this"
        _number("Max mean KL (nats)", "plan_max_kl", kl, min_value=0.0, step=0.01, format="%.4f", placeholder="none")
        agree = "the lower bound of the top-1 agreement's 95% interval must be at least this (0..1)"
        _number(
            "Min top-1 agreement",
            "plan_min_agreement",
            agree,
            min_value=0.0,
            max_value=1.0,
            step=0.01,
            placeholder="none",
        )
        picked = (
            "what judges each strategy: the committed evaluations of the bundled model, and any evaluation, "
            "sweep or profile under the profiles folder you add; nothing counts unless picked"
        )
        st.multiselect("Evidence", evidence_choices(), key="plan_evidence", help=picked)
    values = {k: st.session_state[k] for k in DEFAULTS if k in st.session_state}
    return {**values, **found}, problems


def remember() -> None:
    st.session_state[Keys.PLANNER_INPUTS] = {k: st.session_state.get(k, DEFAULTS[k]) for k in DEFAULTS}


# --- output ----------------------------------------------------------------------------------------


def answer_block(p: Planned) -> None:
    """The answer, first: the same lines the CLI opens with."""
    a = p.answer
    with st.container(border=True, key="plan_answer"):
        st.markdown(f"**{md(a.title)}**")
        if a.command:
            st.code(a.command, language="bash", wrap_lines=True)
        st.markdown("  \n".join(md(line) for line in a.facts))
        if a.side_by_side:
            st.markdown("side by side, the same sessions:  \n" + "  \n".join(md(line) for line in a.side_by_side))
        if a.in_code:
            st.markdown(
                "with cachelib's caches in your code (not options of the runtime):  \n"
                + "  \n".join(md(line) for line in a.in_code)
            )
    with st.expander("How the answer was reached"):
        st.text("\n".join(a.steps))
    for warning in p.evidence.warnings:
        st.warning(md(warning))  # names a file
    if not p.evidence.points:
        st.caption(
            "No evidence picked: only lossless strategies can be judged. Pick evidence in the sidebar, or "
            "measure with `python -m cachelib evaluate`."
        )
    if p.result.added:
        st.caption(f"Also planned, suggested by the evidence: {len(p.result.added)} strategies.")
    if p.result.skipped:
        with st.expander(f"Measured but not plannable here ({len(p.result.skipped)})"):
            st.text("\n".join(f"{spec}: {why}" for spec, why in p.result.skipped.items()))
    if a.commands:
        with st.expander(f"Not covered by evidence: {len(a.commands)} evaluation(s) would measure it"):
            st.code("\n".join(a.commands), language="bash")


def header(p: Planned) -> None:
    v, arch = p.values, p.arch
    too_long = arch.context_warning(v["plan_context"])
    if too_long:
        st.warning(too_long)
    r = p.result
    request = r.request
    prompt = v["plan_context"] if v["plan_prefill"] is None else min(v["plan_prefill"], v["plan_context"])
    feed = f"in chunks of {request.chunk:,}" if request.chunk else "in one update"
    d = request.deployment
    lines = [
        f"**{md(describe_layout(arch, d, request.backend))}**",  # the model's name may come from a folder name
        f"{d.describe() if d else request.backend}, K/V {v['plan_dtype']}, batch {v['plan_batch']}, "
        f"context {v['plan_context']:,} (prompt {prompt:,} {feed}, then {v['plan_context'] - prompt:,} decode steps)",
    ]
    if r.weights_bytes is not None:
        lines.append(f"weights {human_gib(r.weights_bytes)} per device ({r.fits[0].device.weights_note})")
    if r.cache_budget is not None:
        lines.append(
            f"budget {human_gib(request.budget_bytes)} − reserve {human_gib(request.reserve_bytes)}"
            f" − overhead {human_gib(r.fits[0].overhead_bytes)} − weights = "
            f"**{human_gib(r.cache_budget)} for the cache and activations**"
        )
    st.markdown(" · ".join(lines))
    st.caption("Memory in GiB (2^30 bytes), per device. " + SESSIONS_TEXT[0].upper() + SESSIONS_TEXT[1:] + ".")
    with st.expander("The same plan from the command line"):
        st.code(p.command, language="bash", wrap_lines=True)


def counted(p: Planned) -> None:
    """What "fits" counts on one device, term by term, for the first strategy."""
    first = p.result.fits[0]
    with st.expander(f'What "fits" counts, per device, for {first.spec}'):
        st.dataframe(
            pd.DataFrame(
                [{"term": name, "bytes": human_gib(n), "from": note} for name, n, note in first.device.terms()]
            ),
            hide_index=True,
            width="stretch",
            key="plan_terms",
        )


def shown_strategies(p: Planned) -> list[str]:
    """The strategies the charts draw: all of them up to :data:`SHOWN_AT_ONCE`, else those picked
    (first: the ones asked for, a solve's, and the answer's pick)."""
    names = [f.spec for f in p.fits]
    if len(names) <= SHOWN_AT_ONCE:
        return names
    pick = p.result.choice.fit.spec if p.result.choice and p.result.choice.fit else None
    first = [s for s in names if s not in p.result.added or s == pick][:SHOWN_AT_ONCE]
    saved = st.session_state.get("plan_shown")
    if not saved or not set(saved) <= set(names):
        st.session_state["plan_shown"] = first
    return st.multiselect(
        "Strategies shown",
        names,
        key="plan_shown",
        help="the charts draw these; the table lists every strategy planned",
    )


def charts(p: Planned) -> None:
    names = shown_strategies(p)
    a, b, c = st.columns([2, 1, 3], vertical_alignment="bottom")
    found: dict[str, Any] = {}
    problems: list[str] = []
    _integer("Charts up to (tokens)", "plan_range", "the end of both charts' context axis", found, problems, where=a)
    b.checkbox("Log scales", key="plan_log", help="contexts from 1 token on a log axis; bytes on a log axis too")
    c.radio(
        "Frontier of",
        list(plan_charts.FRONTIER_MEASURES),
        key="plan_measure",
        horizontal=True,
        format_func=lambda m: plan_charts.FRONTIER_MEASURES[m],
    )
    if problems:
        return  # the field says why; no chart is drawn to a range it does not show
    v = p.values
    log, measure = st.session_state["plan_log"], st.session_state["plan_measure"]
    request = p.result.request
    # the curves draw only the strategies shown, and never depend on the thresholds
    charted = replace(
        request,
        strategies=tuple(names) or request.strategies[:1],
        max_kl=None,
        min_agreement=None,
        sessions=None,
        solve=None,
        suggest=False,
    )
    context = request.context
    grid = tuple(
        context_grid(context, found["plan_range"] or chart_range(context, p.arch.max_position_embeddings), log=log)
    )
    shown = [f for f in p.fits if f.spec in names]
    bytes_only = replace(charted, budget_bytes=None, reserve_bytes=0, weights_bytes=None)  # a budget change keeps them
    left, right = st.columns(2)
    with left:
        fig = plan_charts.plan_memory_figure(
            _memory_curves(p.arch, bytes_only, grid),
            names,
            cache_budget=p.result.cache_budget,
            context=context,
            fits=shown,
            log=log,
        )
        st.plotly_chart(fig, key="plan_memory", config=PLOTLY_CONFIG)
    with right:
        frontier = pd.DataFrame() if p.result.cache_budget is None else _frontier_curves(p.arch, charted, grid)
        workload = (context, v["plan_batch"] if measure == "max_batch" else 1)
        fig = plan_charts.plan_frontier_figure(frontier, names, measure=measure, workload=workload, log=log)
        st.plotly_chart(fig, key="plan_frontier", config=PLOTLY_CONFIG)


def evidence(p: Planned) -> None:
    """The evidence's figures and table, built only when asked for (they cost most of a rerun)."""
    sources = ", ".join(p.values["plan_evidence"]) or "none picked"
    label = f"Show the evidence: {len(p.evidence.points)} measured point(s) from {sources}"
    if not st.toggle(label, key="plan_show_evidence"):
        return
    with st.container(border=True):
        if p.evidence.retrieval is not None:
            found = retrieval_heatmap_info(p.evidence.retrieval)
            st.plotly_chart(retrieval_heatmap(found), key="plan_retrieval", config=PLOTLY_CONFIG)
        if not p.evidence.points:
            st.caption("No measured KL or agreement in the evidence picked.")
            return
        info = plan_charts.quality_info(p.evidence.points, p.fits, p.values["plan_context"], p.result.request.backend)
        st.plotly_chart(plan_charts.quality_figure(info), key="plan_quality", config=PLOTLY_CONFIG)
        shares = {c: st.column_config.NumberColumn(format="percent") for c in plan_charts.EVIDENCE_SHARES}
        st.dataframe(
            plan_charts.evidence_table(p.evidence.points),
            hide_index=True,
            width="stretch",
            key="plan_evidence_table",
            column_config=shares,
        )


st.title("Planner")
values, problems = inputs()
values.update(speed_values())  # the speed section's fields (below) join the answer and the command
planned = None
if problems:  # each shows under its field: one line, and nothing is planned with what the field showed before
    planned = st.session_state.get(Keys.PLANNER_LAST)
    if planned is not None:
        st.caption("Showing the last valid plan: a field in the sidebar is not a valid number.")
else:
    try:
        planned = compute(values)
    except (ValueError, OSError) as e:
        st.error(str(e))
        planned = st.session_state.get(Keys.PLANNER_LAST)
        if planned is not None:
            st.caption("Showing the last valid plan.")
    else:
        st.session_state[Keys.PLANNER_LAST] = planned
remember()
if planned is None:
    st.stop()
answer_block(planned)
header(planned)
table = plan_charts.plan_table(planned.fits)
st.dataframe(
    plan_charts.styled_plan_table(table, [f.spec for f in planned.fits]),
    hide_index=True,
    width="stretch",
    column_order=plan_charts.page_column_order(table),
    column_config={"strategy": st.column_config.Column(pinned=True)},
)
counted(planned)
charts(planned)
evidence(planned)
speed_section(planned)
