"""Planner: the cache each strategy needs at a context, what fits in a memory budget, and which
strategy the measured quality recommends; the numbers of ``python -m cachelib plan``."""

from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import pandas as pd
import streamlit as st

from app import plan_charts, state
from app.keys import Keys
from app.panels import PLOTLY_CONFIG
from cachelib.core.units import DTYPE_BYTES, human_bytes
from cachelib.plan import (
    Arch, Fit, PlanRequest, PlanResult, Quality, chart_range, context_grid, frontier_curves, gb_to_bytes,
    memory_curves, plan_request, preset_names, resolve_model,
)  # fmt: skip
from cachelib.plan.quality import Evidence, quality_table
from cachelib.profile.evidence import collect_evidence
from cachelib.spec import STRATEGIES

CONFIG = "a config.json…"
DEFAULTS: dict[str, Any] = {  # widget key -> first value
    "plan_model": "llama-3.1-8b", "plan_config": "", "plan_backend": "mlx", "plan_dtype": "float16",
    "plan_context": 32768, "plan_batch": 1, "plan_prefill": None, "plan_prefill_chunk": 2048,
    "plan_strategies": "standard\nrotating:max_size=4096\nquantized:bits=8\nquantized:bits=4\nkivi",
    "plan_budget": 24.0, "plan_weights": None, "plan_weight_bits": 16.0, "plan_reserve": 1.0,
    "plan_max_kl": 0.1, "plan_min_agreement": 0.9, "plan_range": None, "plan_log": False, "plan_measure": "max_batch",
}  # fmt: skip
OPTIONAL = {"plan_prefill_chunk", "plan_budget", "plan_weights", "plan_max_kl", "plan_min_agreement"}  # empty: none


# --- pure and cached -----------------------------------------------------------------------------


@st.cache_data(show_spinner=False, max_entries=64)
def _plan_request(arch: Arch, request: PlanRequest, quality: dict) -> PlanResult:
    return plan_request(arch, request, quality)


@st.cache_data(show_spinner=False, max_entries=32)
def _memory_curves(arch: Arch, request: PlanRequest, grid: tuple[int, ...]) -> pd.DataFrame:
    return memory_curves(arch, request, grid)


@st.cache_data(show_spinner=False, max_entries=32)
def _frontier_curves(arch: Arch, request: PlanRequest, grid: tuple[int, ...]) -> pd.DataFrame:
    return frontier_curves(arch, request, grid)


@st.cache_data(show_spinner=False, max_entries=8)
def _evidence(folder: str, version: tuple) -> tuple[list[Evidence], dict[str, Quality]]:
    """What the profiles under ``folder`` measured (``version``, the files' mtimes and sizes, keys the cache)."""
    if not Path(folder).is_dir():
        return [], {}
    evidence = collect_evidence(folder)
    return evidence, quality_table(evidence)


def _version(folder: Path) -> tuple:
    if not folder.is_dir():
        return ()
    return tuple(sorted((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in folder.rglob("*.csv")))


class Planned(NamedTuple):
    result: PlanResult  # the fits (asked, then measured candidates), weights, budget, recommendation
    values: dict[str, Any]  # the inputs it was planned from
    curves: pd.DataFrame
    frontier: pd.DataFrame
    evidence: list[Evidence]
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
    request = PlanRequest(  # GB read into bytes here, at the edge, as the CLI reads its flags
        plan_charts.parse_strategies(v["plan_strategies"]), context=int(v["plan_context"]),
        batch=int(v["plan_batch"]), backend=v["plan_backend"], dtype=v["plan_dtype"], prefill=v["plan_prefill"],
        prefill_chunk=v["plan_prefill_chunk"], weights_bytes=gb_to_bytes("weights-gb", v["plan_weights"]),
        budget_bytes=gb_to_bytes("budget-gb", v["plan_budget"]),
        reserve_bytes=gb_to_bytes("reserve-gb", v["plan_reserve"]) or 0, weight_bits=v["plan_weight_bits"],
        max_kl=v["plan_max_kl"], min_agreement=v["plan_min_agreement"],
    )  # fmt: skip
    folder = state.profiles_dir()
    evidence, quality = _evidence(str(folder), _version(folder))
    result = _plan_request(arch, request, quality)

    # the curves draw the measured candidates too; they never depend on the thresholds
    charted = replace(request, strategies=tuple(f.spec for f in result.fits), max_kl=None, min_agreement=None)
    context = request.context
    grid = tuple(context_grid(
        context, v["plan_range"] or chart_range(context, arch.max_position_embeddings), log=v["plan_log"]
    ))  # fmt: skip
    frontier = pd.DataFrame() if result.cache_budget is None else _frontier_curves(arch, charted, grid)
    shown_folder = folder.relative_to(state.ROOT) if folder.is_relative_to(state.ROOT) else folder
    command = shlex.join(request.to_argv(model, str(shown_folder)))
    return Planned(result, dict(v), _memory_curves(arch, charted, grid), frontier, evidence, command)


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
        budget = "device memory for weights + reserve + cache; 1 GB = 10^9 bytes"
        _number("Budget (GB)", "plan_budget", budget, min_value=0.0, step=1.0, placeholder="none")
        weights = "measured weight bytes; empty: counted from the parameters"
        _number("Weights (GB)", "plan_weights", weights, min_value=0.0, step=0.5, placeholder="params x weight bits")
        bits = "bits per weight when counting (e.g. 4.5 for 4-bit weights with group scales)"
        _number("Weight bits", "plan_weight_bits", bits, min_value=0.5, step=0.5)
        _number("Reserve (GB)", "plan_reserve", "kept free for activations and the runtime", min_value=0.0, step=0.5)

        st.subheader("Quality")
        kl = "measured KL(full cache ‖ strategy), mean over decode steps"
        _number("Max mean KL (nats)", "plan_max_kl", kl, min_value=0.0, step=0.01, format="%.4f", placeholder="none")
        agree = "share of steps whose top token equals the full cache's (0..1)"
        _number("Min top-1 agreement", "plan_min_agreement", agree, min_value=0.0, max_value=1.0, step=0.01,
                placeholder="none")  # fmt: skip
    return {k: st.session_state[k] for k in DEFAULTS}


def remember() -> None:
    st.session_state[Keys.PLANNER_INPUTS] = {k: st.session_state.get(k, DEFAULTS[k]) for k in DEFAULTS}


# --- output ----------------------------------------------------------------------------------------


def header(p: Planned) -> None:
    v, arch = p.values, p.arch
    prompt = v["plan_context"] if v["plan_prefill"] is None else min(v["plan_prefill"], v["plan_context"])
    feed = f"in chunks of {v['plan_prefill_chunk']:,}" if v["plan_prefill_chunk"] else "in one update"
    lines = [
        f"**{arch.describe()}**",
        f"{v['plan_backend']} {v['plan_dtype']}, batch {v['plan_batch']}, context {v['plan_context']:,} "
        f"(prompt {prompt:,} {feed}, then {v['plan_context'] - prompt:,} decode steps)",
    ]
    r = p.result
    if r.weights_bytes is not None:
        how = (
            "given" if v["plan_weights"] is not None else f"{arch.num_params:,} params x {v['plan_weight_bits']:g} bits"
        )
        lines.append(f"weights {human_bytes(r.weights_bytes)} ({how})")
    if r.cache_budget is not None:
        lines.append(
            f"budget {human_bytes(r.request.budget_bytes)} − reserve {human_bytes(r.request.reserve_bytes)}"
            f" − weights = **{human_bytes(r.cache_budget)} for the cache**"
        )
    st.markdown(" · ".join(lines))
    with st.expander("The same plan from the command line"):
        st.code(p.command, language="bash", wrap_lines=True)


def recommendation(p: Planned) -> None:
    folder = state.profiles_dir()
    if p.values["plan_max_kl"] is None and p.values["plan_min_agreement"] is None:
        st.info("Set a quality threshold (max mean KL and/or min top-1 agreement) to get a recommendation.")
    elif not p.evidence:
        st.info(
            f"**No evidence, no recommendation.** No complete profile in `{folder}` measured a strategy against its "
            "baseline, so the quality price of these strategies is unknown. Profile them on the Live comparison "
            "page (or with `python -m cachelib profile`); every profile in that folder and its subfolders counts."
        )
    elif p.result.recommendation.fit is None:
        st.warning(p.result.recommendation.text)
    else:
        pick = p.result.recommendation.fit
        st.success(f"**Recommended: `{pick.spec}`.** {p.result.recommendation.text} {plan_charts.savings_text(pick, p.fits)}")
    if p.result.added:
        st.caption("Also planned because profiles measured them: " + ", ".join(f"`{s}`" for s in p.result.added) + ".")
    for spec, why in p.result.skipped.items():
        st.caption(f"Measured but not plannable here: `{spec}` ({why}).")


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
    with st.expander(f"Evidence: quality measured by the profiles in `{state.profiles_dir()}`"):
        if not p.evidence:
            st.caption("None yet.")
        else:
            st.dataframe(plan_charts.evidence_table(p.evidence), hide_index=True, width="stretch", key="plan_evidence")


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
st.dataframe(plan_charts.styled_plan_table(table, [f.spec for f in planned.fits]), hide_index=True, width="stretch")
charts(planned)
evidence(planned)
