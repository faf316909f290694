"""Planner: the cache each strategy needs at a context, what fits in a memory budget, and which
strategy the measured quality recommends; the numbers of ``python -m cachelib plan``."""

from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import pandas as pd
import streamlit as st

from app import plan_charts, state
from app.retrieval_charts import retrieval_heatmap, retrieval_heatmap_info
from app.keys import Keys
from app.panels import PLOTLY_CONFIG
from app.plain import md
from cachelib.core.units import DTYPE_BYTES, human_gib as human_bytes
from cachelib.plan import (
    Arch, Fit, PlanRequest, PlanResult, Quality, chart_range, context_grid, frontier_curves, memory_bytes,
    memory_curves, plan_request, preset_names, resolve_model,
)  # fmt: skip
from cachelib.plan.device import WEIGHT_FORMATS
from cachelib.plan.request import DEVICES
from cachelib.plan.runtimes import describe_layout, runtime_names
from cachelib.cli.plan import SESSIONS_TEXT
from cachelib.profile.evidence import DEFAULT_EVIDENCE, EvidenceSet, load_evidence
from cachelib.spec import STRATEGIES

CONFIG = "a config.json…"
COMMITTED = "committed evidence (assets/evidence)"
DEFAULTS: dict[str, Any] = {  # widget key -> first value
    "plan_model": "llama-3.1-8b", "plan_config": "", "plan_backend": "mlx", "plan_dtype": "float16",
    "plan_context": 32768, "plan_batch": 1, "plan_prefill": None, "plan_prefill_chunk": 2048,
    "plan_strategies": "standard\nrotating:max_size=4096\nquantized:bits=8\nquantized:bits=4\nkivi",
    "plan_runtime": "none", "plan_tp": 1, "plan_pp": 1, "plan_kv_format": "dtype", "plan_device": "gpu",
    "plan_budget": 24.0, "plan_weights": None, "plan_weights_dtype": "published", "plan_reserve": 1.0,
    "plan_max_kl": 0.1, "plan_min_agreement": 0.9, "plan_range": None, "plan_log": False, "plan_measure": "max_batch",
    "plan_evidence": [COMMITTED],
}  # fmt: skip
OPTIONAL = {"plan_prefill_chunk", "plan_budget", "plan_weights", "plan_max_kl", "plan_min_agreement"}  # empty: none


# --- pure and cached -----------------------------------------------------------------------------


@st.cache_data(show_spinner=False, max_entries=64)
def _plan_request(arch: Arch, request: PlanRequest, evidence: tuple) -> PlanResult:
    return plan_request(arch, request, evidence)


@st.cache_data(show_spinner=False, max_entries=32)
def _memory_curves(arch: Arch, request: PlanRequest, grid: tuple[int, ...]) -> pd.DataFrame:
    return memory_curves(arch, request, grid)


@st.cache_data(show_spinner=False, max_entries=32)
def _frontier_curves(arch: Arch, request: PlanRequest, grid: tuple[int, ...]) -> pd.DataFrame:
    return frontier_curves(arch, request, grid)


@st.cache_data(show_spinner=False, max_entries=8)
def _evidence(paths: tuple[str, ...], version: tuple) -> EvidenceSet:
    """The evidence in ``paths`` (``version``, the files' mtimes and sizes, keys the cache)."""
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
    folder = state.profiles_dir()
    found = sorted(p for p in folder.iterdir() if p.is_dir() or p.suffix == ".csv") if folder.is_dir() else []
    return [COMMITTED, *(str(p) for p in found)]


def _evidence_paths(chosen: Sequence[str]) -> list[Path]:
    return [DEFAULT_EVIDENCE if c == COMMITTED else Path(c) for c in chosen]


class Planned(NamedTuple):
    result: PlanResult  # the fits (asked, then measured candidates), weights, budget, recommendation
    values: dict[str, Any]  # the inputs it was planned from
    curves: pd.DataFrame
    frontier: pd.DataFrame
    evidence: EvidenceSet
    command: str

    @property
    def arch(self) -> Arch:
        return self.result.arch

    @property
    def fits(self) -> list[Fit]:
        return self.result.fits


def compute(v: dict[str, Any]) -> Planned:
    """The whole plan from the inputs; ValueError (or OSError) on bad input."""
    model = v["plan_config"].strip() if v["plan_model"] == CONFIG else v["plan_model"]
    if not model:
        raise ValueError("give the path of a config.json (or of the folder holding it)")
    arch = resolve_model(model)
    runtime = None if v["plan_runtime"] == "none" else v["plan_runtime"]
    request = PlanRequest(  # GiB read into bytes here, at the edge, as the CLI reads its flags
        plan_charts.parse_strategies(v["plan_strategies"]), context=int(v["plan_context"]),
        batch=int(v["plan_batch"]), backend=v["plan_backend"], dtype=v["plan_dtype"], prefill=v["plan_prefill"],
        prefill_chunk=v["plan_prefill_chunk"], weights_bytes=memory_bytes("weights (GiB)", v["plan_weights"]),
        budget_bytes=memory_bytes("budget (GiB)", v["plan_budget"]),
        reserve_bytes=memory_bytes("reserve (GiB)", v["plan_reserve"]) or 0,
        weights_dtype=None if v["plan_weights_dtype"] == "published" else v["plan_weights_dtype"],
        runtime=runtime, tp=int(v["plan_tp"]), pp=int(v["plan_pp"]),
        kv_format=None if v["plan_kv_format"] == "dtype" else v["plan_kv_format"], device=v["plan_device"],
        max_kl=v["plan_max_kl"], min_agreement=v["plan_min_agreement"],
    )  # fmt: skip
    chosen = list(v["plan_evidence"])
    paths = _evidence_paths(chosen)
    evidence = _evidence(tuple(map(str, paths)), _version(paths))
    result = _plan_request(arch, request, evidence.points)

    # the curves draw the measured candidates too; they never depend on the thresholds
    charted = replace(request, strategies=tuple(f.spec for f in result.fits), max_kl=None, min_agreement=None)
    context = request.context
    grid = tuple(context_grid(
        context, v["plan_range"] or chart_range(context, arch.max_position_embeddings), log=v["plan_log"]
    ))  # fmt: skip
    frontier = pd.DataFrame() if result.cache_budget is None else _frontier_curves(arch, charted, grid)
    extra = [_shown(p) for c, p in zip(chosen, paths) if c != COMMITTED]
    command = shlex.join(request.to_argv(model, extra, default_evidence=COMMITTED in chosen))
    return Planned(result, dict(v), _memory_curves(arch, charted, grid), frontier, evidence, command)


def _shown(path: Path) -> str:
    return str(path.relative_to(state.ROOT)) if path.is_relative_to(state.ROOT) else str(path)


# --- inputs ----------------------------------------------------------------------------------------


def _number(label: str, key: str, help: str, where: Any = st, **options: Any) -> None:
    """A number input whose value lives in session state; an optional one reads None when cleared."""
    if DEFAULTS[key] is None or key in OPTIONAL:
        options["value"] = None  # the start value comes from session state; None is what a cleared field gives
    where.number_input(label, key=key, help=help, **options)


def inputs() -> dict[str, Any]:
    saved = st.session_state.setdefault(Keys.PLANNER_INPUTS, dict(DEFAULTS))
    for key, value in saved.items():
        st.session_state.setdefault(key, value)
    with st.sidebar:
        st.subheader("Model")
        presets = "published architectures, the bundled smollm2 and the tiny-* presets, or any config.json"
        st.selectbox("Model", [*preset_names(), CONFIG], key="plan_model", help=presets)
        if st.session_state["plan_model"] == CONFIG:
            st.text_input("config.json", key="plan_config", placeholder="/path/to/config.json or its folder")
        rules = "the cache library whose allocation rules apply (they differ)"
        st.radio("Backend", ["mlx", "torch"], key="plan_backend", horizontal=True, help=rules)
        st.selectbox("K/V dtype", list(DTYPE_BYTES), key="plan_dtype")

        st.subheader("Deployment")
        st.selectbox("Runtime", ["none", *runtime_names()], key="plan_runtime",
                     help="none: cachelib's caches on the backend above; a runtime plans its own layouts, blocks, "
                     "prompt chunks and defaults (its backend replaces the one above)")  # fmt: skip
        left, right = st.columns(2)
        _number("Tensor parallel", "plan_tp", "devices the heads are split over (vllm, transformers)", where=left,
                min_value=1, step=1)  # fmt: skip
        _number("Pipeline stages", "plan_pp", "stages the layers are split over (vllm, llama.cpp)", where=right,
                min_value=1, step=1)  # fmt: skip
        st.selectbox("KV format", ["dtype", "fp8", "q8_0", "q4_0"], key="plan_kv_format",
                     help="the runtime's KV storage: fp8 (vllm), q8_0 / q4_0 (llama.cpp); dtype: the K/V dtype")  # fmt: skip
        st.radio("Forward runs on", list(DEVICES), key="plan_device", horizontal=True,
                 help="on the cpu MLX materialises the attention scores, which the activations then count")  # fmt: skip

        st.subheader("Workload")
        _number(
            "Context (tokens)", "plan_context", "tokens the cache holds at the end of a run", min_value=1, step=1024
        )
        _number("Batch", "plan_batch", "sequences per run", min_value=1, step=1)
        with st.expander("Prompt feeding"):
            rest = "the rest of the context is decoded one token at a time"
            _number("Prompt tokens", "plan_prefill", rest, min_value=1, step=256, placeholder="the whole context")
            chunks = "mlx-lm's generate feeds prompts in chunks of 2048 (the default here); empty: one update"
            _number("Prefill chunk", "plan_prefill_chunk", chunks, min_value=1, step=256, placeholder="one update")

        st.subheader("Strategies")
        grammar = (
            f"name[:knob=value,...], e.g. rotating:max_size=4096,keep=4. Strategies: {', '.join(STRATEGIES)}. "
            "The first is the reference the recommendation's savings are counted against."
        )
        st.text_area("One spec per line", key="plan_strategies", height=150, help=grammar)

        st.subheader("Memory")
        budget = ("one device's memory for weights + cache + activations + runtime overhead + reserve, in GiB "
                  "(2^30 bytes: a \"24 GB\" GPU holds 24 GiB)")
        _number("Budget (GiB)", "plan_budget", budget, min_value=0.0, step=1.0, placeholder="none")
        weights = "the weights one device holds, as measured, in GiB; empty: counted from the parameters"
        _number("Weights (GiB)", "plan_weights", weights, min_value=0.0, step=0.5, placeholder="params x precision")
        st.selectbox("Weights dtype", ["published", *WEIGHT_FORMATS], key="plan_weights_dtype",
                     help="precision the weights are counted at; published: the checkpoint's config.json dtype")  # fmt: skip
        _number("Reserve (GiB)", "plan_reserve", "kept free on each device beyond what is counted", min_value=0.0, step=0.5)

        st.subheader("Quality")
        kl = "measured KL(full cache ‖ strategy), mean over decode steps"
        _number("Max mean KL (nats)", "plan_max_kl", kl, min_value=0.0, step=0.01, format="%.4f", placeholder="none")
        agree = "share of steps whose top token equals the full cache's (0..1)"
        _number("Min top-1 agreement", "plan_min_agreement", agree, min_value=0.0, max_value=1.0, step=0.01,
                placeholder="none")  # fmt: skip
        picked = "what judges each strategy: the committed evaluations of the bundled model, and any evaluation, " \
            "sweep or profile under the profiles folder you add; nothing counts unless picked"
        st.multiselect("Evidence", evidence_choices(), key="plan_evidence", help=picked)
    return {k: st.session_state[k] for k in DEFAULTS}


def remember() -> None:
    st.session_state[Keys.PLANNER_INPUTS] = {k: st.session_state.get(k, DEFAULTS[k]) for k in DEFAULTS}


# --- output ----------------------------------------------------------------------------------------


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
        f"{d.describe() if d else request.backend} {v['plan_dtype']}, batch {v['plan_batch']}, "
        f"context {v['plan_context']:,} (prompt {prompt:,} {feed}, then {v['plan_context'] - prompt:,} decode steps)",
    ]
    if r.weights_bytes is not None:
        lines.append(f"weights {human_bytes(r.weights_bytes)} per device ({r.fits[0].device.weights_note})")
    if r.cache_budget is not None:
        lines.append(
            f"budget {human_bytes(request.budget_bytes)} − reserve {human_bytes(request.reserve_bytes)}"
            f" − overhead {human_bytes(r.fits[0].overhead_bytes)} − weights = "
            f"**{human_bytes(r.cache_budget)} for the cache and activations**"
        )
    st.markdown(" · ".join(lines))
    st.caption("Memory in GiB (2^30 bytes), per device. " + SESSIONS_TEXT[0].upper() + SESSIONS_TEXT[1:] + ".")

    with st.expander("The same plan from the command line"):
        st.code(p.command, language="bash", wrap_lines=True)


def counted(p: Planned) -> None:
    """What "fits" counts on one device, term by term, for the first strategy."""
    first = p.result.fits[0]
    with st.expander(f"What \"fits\" counts, per device, for {first.spec}"):
        st.dataframe(pd.DataFrame([{"term": name, "bytes": human_bytes(n), "from": note}
                                   for name, n, note in first.device.terms()]),
                     hide_index=True, width="stretch", key="plan_terms")  # fmt: skip


def recommendation(p: Planned) -> None:
    for warning in p.evidence.warnings:
        st.warning(md(warning))  # names a file
    rec = p.result.recommendation
    if p.values["plan_max_kl"] is None and p.values["plan_min_agreement"] is None:
        st.info("Set a quality threshold (max mean KL and/or min top-1 agreement) to get a recommendation.")
    elif not p.evidence.points:
        st.info(
            "**No evidence, no recommendation.** Pick evidence in the sidebar (the committed evaluations, or a "
            "team's own evaluations under the profiles folder); without it the quality price of these strategies "
            "is unknown. Measure it with `python -m cachelib evaluate`."
        )
    elif rec.fit is None:
        st.warning(rec.text)
    else:
        st.success(f"**Recommended: `{rec.fit.spec}`.** {rec.text} {plan_charts.savings_text(rec.fit, p.fits)}")
    if p.result.added:
        st.caption("Also planned because the evidence speaks for them: " + ", ".join(f"`{s}`" for s in p.result.added) + ".")
    for spec, why in p.result.skipped.items():
        st.caption(f"Measured but not plannable here: `{spec}` ({why}).")
    uncovered = [j for j in p.result.judgements.values() if j.quality is None or j.command]
    if uncovered:
        with st.expander(f"What the evidence does not cover ({len(uncovered)})"):
            for j in uncovered:
                st.text(f"{j.spec}: {j.reason}")
                if j.command:
                    st.code(j.command, language="bash", wrap_lines=True)


def charts(p: Planned) -> None:
    names = [f.spec for f in p.fits]
    a, b, c = st.columns([2, 1, 3], vertical_alignment="bottom")
    auto, what = "2 x context (at most the model's)", "the end of both charts' context axis"
    _number("Charts up to (tokens)", "plan_range", what, where=a, min_value=1, step=1024, placeholder=auto)
    b.checkbox("Log scales", key="plan_log", help="contexts from 1 token on a log axis; bytes on a log axis too")
    c.radio("Frontier of", list(plan_charts.FRONTIER_MEASURES), key="plan_measure", horizontal=True,
            format_func=lambda m: plan_charts.FRONTIER_MEASURES[m])  # fmt: skip
    log, measure = p.values["plan_log"], st.session_state["plan_measure"]
    left, right = st.columns(2)
    with left:
        fig = plan_charts.plan_memory_figure(
            p.curves, names, cache_budget=p.result.cache_budget, context=p.values["plan_context"], fits=p.fits, log=log
        )
        st.plotly_chart(fig, key="plan_memory", config=PLOTLY_CONFIG)
    with right:
        workload = (p.values["plan_context"], p.values["plan_batch"] if measure == "max_batch" else 1)
        fig = plan_charts.plan_frontier_figure(p.frontier, names, measure=measure, workload=workload, log=log)
        st.plotly_chart(fig, key="plan_frontier", config=PLOTLY_CONFIG)


def evidence(p: Planned) -> None:
    sources = ", ".join(p.values["plan_evidence"]) or "none picked"
    with st.expander(f"Evidence: {len(p.evidence.points)} measured point(s) from {sources}", expanded=True):
        if p.evidence.retrieval is not None:
            found = retrieval_heatmap_info(p.evidence.retrieval)
            st.plotly_chart(retrieval_heatmap(found), key="plan_retrieval", config=PLOTLY_CONFIG)
        if not p.evidence.points:
            st.caption("No measured KL or agreement in the evidence picked.")
            return
        info = plan_charts.quality_info(p.evidence.points, p.fits, p.values["plan_context"], p.values["plan_backend"])
        st.plotly_chart(plan_charts.quality_figure(info), key="plan_quality", config=PLOTLY_CONFIG)
        st.dataframe(plan_charts.evidence_table(p.evidence.points), hide_index=True, width="stretch", key="plan_evidence_table")


st.title("Planner")
st.caption(
    "Exact KV-cache bytes per strategy at a context, what fits in a memory budget, and the cheapest strategy "
    "whose measured quality meets your thresholds: the numbers `python -m cachelib plan` prints."
)
values = inputs()
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
header(planned)
recommendation(planned)
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
from app.speed_charts import speed_section  # noqa: E402  # the speed section (issue 31), after the rest

speed_section(planned)
