"""The run form's widgets: model and device, input text, probes, and the strategy rows.

The strategy editor is built from :data:`cachelib.spec.STRATEGIES`: every knob of the chosen
strategy gets a widget with its valid range (a select box for knobs with a fixed set of values,
an "off" choice for optional ones). Rows live in ``st.session_state``; the widgets hold the values.
Turning rows into specs goes through :func:`cachelib.spec.make_spec`, so a bad combination
(``keep >= max_size``) is refused with the same message as everywhere else.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import streamlit as st

from cachelib.models import model_names
from cachelib.profile import PROBE_HELP, Probes
from cachelib.spec import STRATEGIES, Knob, Spec, make_spec, parse_spec

from . import state
from .keys import Keys
from .live import RunOptions

DEFAULT_PROMPT = "Explain what a KV cache is in two sentences."
DEFAULT_TOKENS = 64
MAX_TOKENS = 2048
DEFAULT_STRATEGIES = ("standard", "rotating:max_size=64,keep=4", "quantized:bits=4,group_size=64")
BOUNDED_START = 256  # first value offered for a required size knob (max_size, window, ...)
OFF = "off"
FOLDER = "a local model folder…"


# --- model, backend, device --------------------------------------------------------------------


def model_settings() -> dict[str, Any]:
    """Backend, device and model; returns the keyword arguments of :func:`state.loaded_model`."""
    here = state.backends_here()
    backends = [b for b, why in here.items() if not why]
    if not backends:
        st.error("Neither MLX nor PyTorch imports here: " + "; ".join(f"{b}: {w}" for b, w in here.items()))
        st.stop()
    backend = st.radio("Backend", backends, horizontal=True, key=Keys.BACKEND, help="only backends that import here")
    devices = state.devices_of(backend)
    device = st.selectbox("Device", devices, key=Keys.device(backend), help="devices this machine offers the backend")
    choice = st.selectbox(
        "Model",
        [*model_names(), FOLDER],
        key=Keys.MODEL,
        help="smollm2: the bundled SmolLM2-135M (real weights); tiny-*: real architectures with random weights",
    )
    name = choice
    if choice == FOLDER:
        name = st.text_input(
            "Model folder", key=Keys.MODEL_FOLDER, placeholder="/path/to/model (config.json + safetensors)"
        )
    return {"name": name.strip(), "backend": backend, "device": device}


def input_settings() -> RunOptions:
    """Prompt or evaluation text, tokens, mode (the probes and the memory limit come from
    :func:`probe_settings`)."""
    kind = st.radio("Input", ["chat prompt", "evaluation text"], horizontal=True, key=Keys.INPUT_KIND)
    if kind == "chat prompt":
        prompt = st.text_area("Prompt", DEFAULT_PROMPT, key=Keys.PROMPT, height=90)
    else:
        text = st.text_area(
            "Evaluation text", key=Keys.EVAL_TEXT, height=160,
            help="every strategy is fed this text; its first tokens are the prompt",
        )  # fmt: skip
    max_tokens = st.slider("Tokens to decode", 1, MAX_TOKENS, DEFAULT_TOKENS, key=Keys.MAX_TOKENS)
    one_by_one = st.checkbox(
        "One by one", key=Keys.ONE_BY_ONE,
        help="advance every strategy by its own forward pass; by default the strategies are the rows of "
        "one batch, one forward per step (the profile's rows and bytes are the same)",
    )  # fmt: skip
    if kind != "chat prompt":
        return RunOptions(text=text, max_tokens=max_tokens, one_by_one=one_by_one)
    free_running = st.checkbox(
        "Free-running", key=Keys.FREE_RUNNING,
        help="each strategy feeds its own greedy tokens instead of the baseline's",
    )  # fmt: skip
    return RunOptions(prompt=prompt, max_tokens=max_tokens, free_running=free_running, one_by_one=one_by_one)


def probe_settings() -> tuple[Probes, str | None]:
    """Sampling period per probe (1 = every step, k = every k-th step and the last, 0 = off), and
    the memory limit as typed (checked when the run starts)."""
    base = Probes()
    with st.expander("Probes"):
        values = {
            f.name: st.number_input(
                f.name, min_value=0, max_value=MAX_TOKENS, value=getattr(base, f.name), step=1,
                key=Keys.probe(f.name), help=PROBE_HELP.get(f.name, ""),
            )  # fmt: skip
            for f in fields(Probes)
        }
        limit = st.text_input(
            "Memory limit", key=Keys.MEMORY_LIMIT, placeholder="e.g. 2GiB or 2GB (empty: none)",
            help="stop the run before the caches of all strategies together would pass this size; "
            "a bare number is GiB (2^30 bytes), 2GB is 2 x 10^9 bytes",
        )  # fmt: skip
    return Probes(**{k: int(v) for k, v in values.items()}), limit.strip() or None


# --- strategy rows -----------------------------------------------------------------------------


def _seed_row(row: int, spec: Spec) -> None:
    st.session_state[Keys.strategy(row, "name")] = spec.name
    # Knobs written out in the seed spec stay in its label even at their default value.
    st.session_state[Keys.strategy(row, f"{spec.name}.given")] = tuple(k for k, _ in spec.params)
    for knob in spec.strategy.knobs:
        value = dict(spec.params).get(knob.name, knob.default)
        st.session_state[Keys.strategy(row, f"{spec.name}.{knob.name}")] = _widget_value(knob, value)


def _widget_value(knob: Knob, value: int | None) -> Any:
    if knob.choices is not None:
        return OFF if value is None else value
    if value is None and knob.required:
        lo = knob.min if knob.min is not None else 1
        hi = knob.max if knob.max is not None else max(lo, BOUNDED_START)
        return min(max(BOUNDED_START, lo), hi)
    return value


def _next_id() -> int:
    n = st.session_state.get(Keys.STRATEGY_NEXT, 0)
    st.session_state[Keys.STRATEGY_NEXT] = n + 1
    return n


def init_rows() -> None:
    if Keys.STRATEGY_ROWS in st.session_state:
        return
    ids = []
    for text in DEFAULT_STRATEGIES:
        row = _next_id()
        _seed_row(row, parse_spec(text))
        ids.append(row)
    st.session_state[Keys.STRATEGY_ROWS] = ids


def _add_row() -> None:
    row = _next_id()
    _seed_row(row, make_spec("standard"))
    st.session_state[Keys.STRATEGY_ROWS] = [*st.session_state[Keys.STRATEGY_ROWS], row]


def _remove_row(row: int) -> None:
    st.session_state[Keys.STRATEGY_ROWS] = [r for r in st.session_state[Keys.STRATEGY_ROWS] if r != row]


def _duplicate_row(row: int) -> None:
    new = _next_id()
    prefix = Keys.strategy(row)
    for k in [k for k in st.session_state if isinstance(k, str) and k.startswith(prefix)]:
        what = k[len(prefix) :]
        if what == "name" or "." in what:  # the strategy and its knobs ("rotating.keep"), not the buttons
            st.session_state[Keys.strategy(new, what)] = st.session_state[k]
    ids = list(st.session_state[Keys.STRATEGY_ROWS])
    ids.insert(ids.index(row) + 1, new)
    st.session_state[Keys.STRATEGY_ROWS] = ids


def _knob_widget(row: int, strategy: str, knob: Knob) -> Any:
    key = Keys.strategy(row, f"{strategy}.{knob.name}")
    if key not in st.session_state:
        st.session_state[key] = _widget_value(knob, knob.default)
    help_text = f"{knob.help}. Allowed: {knob.range_text}"
    if not knob.required:
        help_text += f"; default: {OFF if knob.default is None else knob.default}"
    if knob.choices is not None:
        options = ([] if knob.required or knob.default is not None else [OFF]) + list(knob.choices)
        value = st.selectbox(knob.name, options, key=key, help=help_text)
    else:
        value = st.number_input(
            knob.name, min_value=knob.min, max_value=knob.max, step=1, key=key, help=help_text,
            placeholder=OFF if not knob.required and knob.default is None else None,
        )  # fmt: skip
    return None if value == OFF else value


def strategy_editor(backend: str) -> list[dict[str, Any]]:
    """Draw the rows; return [{"name", "knobs"}] in order (the first is the baseline)."""
    init_rows()
    rows = st.session_state[Keys.STRATEGY_ROWS]
    out = []
    names = list(STRATEGIES)
    for i, row in enumerate(rows):
        with st.container(border=True):
            head, buttons = st.columns([5, 2], vertical_alignment="bottom")
            with head:
                name = st.selectbox(
                    "baseline (the others are compared to it)" if i == 0 else f"strategy {i + 1}",
                    names, key=Keys.strategy(row, "name"),
                    format_func=lambda n: n if backend in STRATEGIES[n].backends else f"{n} (not on {backend})",
                )  # fmt: skip
            with buttons:
                b1, b2 = st.columns(2)
                b1.button("Duplicate", key=Keys.strategy(row, "dup"), on_click=_duplicate_row, args=(row,), width="stretch")
                b2.button(
                    "Remove", key=Keys.strategy(row, "del"), on_click=_remove_row, args=(row,),
                    disabled=len(rows) == 1, width="stretch",
                )  # fmt: skip
            strategy = STRATEGIES[name]
            st.caption(strategy.summary)
            knobs = {}
            given = st.session_state.get(Keys.strategy(row, f"{name}.given"), ())
            if strategy.knobs:
                cols = st.columns(min(len(strategy.knobs), 6))
                for j, knob in enumerate(strategy.knobs):
                    with cols[j % len(cols)]:
                        value = _knob_widget(row, name, knob)
                    # Defaults stay implicit, so labels read like specs people write.
                    if value is not None and (knob.required or value != knob.default or knob.name in given):
                        knobs[knob.name] = value
            out.append({"name": name, "knobs": knobs})
    st.button("Add strategy", key=Keys.STRATEGY_ADD, on_click=_add_row)
    return out


def specs_of(rows: list[dict[str, Any]], backend: str) -> list[Spec]:
    """The validated spec of each row; a bad row raises ValueError naming the row and the knob."""
    specs = []
    for i, r in enumerate(rows):
        where = "baseline" if i == 0 else f"strategy {i + 1}"
        try:
            spec = make_spec(r["name"], r["knobs"])
            spec.check_backend(backend)
        except ValueError as e:
            raise ValueError(f"{where} ({r['name']}): {e}") from None
        specs.append(spec)
    return specs
