"""The run form's widgets: model and device, input text, probes, and the strategy rows.

The strategy editor is built from :data:`cachelib.spec.STRATEGIES`: every knob of the chosen
strategy gets a widget (a select box for knobs with a fixed set of values, an "off" choice for
optional ones; a text field read as a whole number for the others, :func:`int_field`). Rows live
in ``st.session_state``; the widgets hold the values and keep them through page changes
(:func:`app.keys.kept`). Turning rows into specs goes through :func:`cachelib.spec.make_spec` and
:func:`cachelib.profile.check_distinct`, so a bad combination (``keep >= max_size``) or a
repeated strategy is refused with the same message as everywhere else, in its row, before Run.
"""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Any

import streamlit as st

from cachelib.models import model_names
from cachelib.profile import PROBE_HELP, Probes, check_distinct, parse_memory_limit
from cachelib.spec import STRATEGIES, Knob, Spec, make_spec, parse_spec

from . import shelf
from .keys import Keys, kept
from .live import RunOptions
from .plain import md

DEFAULT_PROMPT = "Explain what a KV cache is in two sentences."
DEFAULT_TOKENS = 64
MAX_TOKENS = 2048
DEFAULT_STRATEGIES = ("standard", "rotating:max_size=64,keep=4", "quantized:bits=4,group_size=64")
BOUNDED_START = 256  # first value offered for a required size knob (max_size, window, ...)
OFF = "off"
FOLDER = "a local model folder…"


# --- model, backend, device --------------------------------------------------------------------


def model_settings() -> dict[str, Any]:
    """Backend, device and model; returns the keyword arguments of :func:`shelf.loaded_model`."""
    here = shelf.backends_here()
    backends = [b for b, why in here.items() if not why]
    if not backends:
        st.error("Neither MLX nor PyTorch imports here: " + "; ".join(f"{b}: {w}" for b, w in here.items()))
        st.stop()
    backend = st.radio(
        "Backend", backends, horizontal=True, **kept(Keys.BACKEND), help="only backends that import here"
    )
    devices = shelf.devices_of(backend)
    device = st.selectbox(
        "Device", devices, **kept(Keys.device(backend)), help="devices this machine offers the backend"
    )
    choice = st.selectbox(
        "Model",
        [*model_names(), FOLDER],
        **kept(Keys.MODEL),
        help="smollm2: the bundled SmolLM2-135M (real weights); tiny-*: real architectures with random weights",
    )
    name = choice
    if choice == FOLDER:
        name = st.text_input(
            "Model folder", **kept(Keys.MODEL_FOLDER), placeholder="/path/to/model (config.json + safetensors)"
        )
    return {"name": name.strip(), "backend": backend, "device": device}


def input_settings() -> RunOptions:
    """Prompt or evaluation text, tokens, mode (the probes and the memory limit come from
    :func:`probe_settings`)."""
    kind = st.radio("Input", ["chat prompt", "evaluation text"], horizontal=True, **kept(Keys.INPUT_KIND))
    if kind == "chat prompt":
        prompt = st.text_area("Prompt", DEFAULT_PROMPT, **kept(Keys.PROMPT), height=90)
    else:
        text = st.text_area(
            "Evaluation text",
            **kept(Keys.EVAL_TEXT),
            height=160,
            help="every strategy is fed this text; its first tokens are the prompt",
        )
    max_tokens = st.slider("Tokens to decode", 1, MAX_TOKENS, DEFAULT_TOKENS, **kept(Keys.MAX_TOKENS))
    one_by_one = st.checkbox(
        "One by one",
        **kept(Keys.ONE_BY_ONE),
        help="advance every strategy by its own forward pass; by default the strategies are the rows of "
        "one batch, one forward per step (the profile's rows and bytes are the same)",
    )
    if kind != "chat prompt":
        return RunOptions(text=text, max_tokens=max_tokens, one_by_one=one_by_one)
    free_running = st.checkbox(
        "Free-running",
        **kept(Keys.FREE_RUNNING),
        help="each strategy feeds its own greedy tokens instead of the baseline's",
    )
    return RunOptions(prompt=prompt, max_tokens=max_tokens, free_running=free_running, one_by_one=one_by_one)


def probe_settings() -> tuple[Probes, str | None, list[str]]:
    """Sampling period per probe (1 = every step, k = every k-th step and the last, 0 = off), the
    memory limit as typed (checked when the run starts), and what does not parse (one line each,
    also shown beside its field)."""
    base = Probes()
    problems: list[str] = []
    with st.expander("Probes", expanded=False):
        values = {}
        for f in fields(Probes):
            value, problem = int_field(
                f.name,
                Keys.probe(f.name),
                lo=0,
                hi=MAX_TOKENS,
                default=getattr(base, f.name),
                help=PROBE_HELP.get(f.name, ""),
            )
            values[f.name] = getattr(base, f.name) if value is None else value
            problems += [problem] if problem else []
        limit = st.text_input(
            "Memory limit",
            **kept(Keys.MEMORY_LIMIT),
            placeholder="e.g. 2GiB or 2GB (empty: none)",
            help="stop the run before the caches of all strategies together would pass this size; "
            "a bare number is GiB (2^30 bytes), 2GB is 2 x 10^9 bytes",
        )
        try:
            parse_memory_limit(limit.strip() or None)
        except ValueError as e:
            st.error(md(e))
            problems.append(str(e))
    return Probes(**values), limit.strip() or None, problems


# --- whole numbers, as typed -------------------------------------------------------------------

_WHOLE = re.compile(r"[+-]?\d+(?:_\d+)*")


def allowed_text(lo: int | None, hi: int | None, empty: str | None = None) -> str:
    """The allowed values of a whole-number field, in words."""
    if lo is not None and hi is not None:
        text = f"a whole number from {lo} to {hi}"
    elif lo is not None:
        text = f"a whole number >= {lo}"
    elif hi is not None:
        text = f"a whole number <= {hi}"
    else:
        text = "a whole number"
    return text + (f" (empty: {empty})" if empty else "")


def parse_int(
    text: str, lo: int | None = None, hi: int | None = None, *, empty: str | None = None, what: str = "value"
) -> int | None:
    """``text`` as the whole number it spells in digits (``1_000`` too), or None when empty and
    ``empty`` says what that means ("off", "default 4"). Anything else (``1e12``, ``2.5``,
    ``abc``, out of range) raises ValueError naming ``what`` and the allowed values: nothing is
    rounded or clipped into range."""
    t = str(text).strip()
    allowed = allowed_text(lo, hi, empty)
    if not t:
        if empty:
            return None
        raise ValueError(f"{what} is empty; allowed: {allowed}")
    if not _WHOLE.fullmatch(t):
        raise ValueError(f"{what} = {t!r} is not a whole number in digits; allowed: {allowed}")
    value = int(t.replace("_", ""))
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{what} = {t} is out of range; allowed: {allowed}")
    return value


def int_field(
    label: str,
    key: str,
    *,
    lo: int | None,
    hi: int | None,
    default: int | None,
    empty: str | None = None,
    help: str = "",
) -> tuple[int | None, str]:
    """A whole-number field read as typed: (value, "") or (None, the problem). The problem shows
    under the field (no hovering needed); the caller keeps Run off while any field has one."""
    if key not in st.session_state:
        st.session_state[key] = "" if default is None else str(default)
    elif not isinstance(st.session_state[key], str):  # a value set by code (a test, an older session)
        st.session_state[key] = "" if st.session_state[key] is None else str(st.session_state[key])
    allowed = allowed_text(lo, hi, empty)
    text = st.text_input(label, **kept(key), help=f"{help}. Allowed: {allowed}".lstrip(". "), placeholder=empty)
    try:
        return parse_int(text, lo, hi, empty=empty, what=label), ""
    except ValueError as e:
        st.error(md(e))
        return None, str(e)


# --- strategy rows -----------------------------------------------------------------------------


def _seed_row(row: int, spec: Spec) -> None:
    st.session_state[Keys.strategy(row, "name")] = spec.name
    # Knobs written out in the seed spec stay in its label even at their default value.
    st.session_state[Keys.strategy(row, f"{spec.name}.given")] = tuple(k for k, _ in spec.params)
    for knob in spec.strategy.knobs:
        value = dict(spec.params).get(knob.name, knob.default)
        st.session_state[Keys.strategy(row, f"{spec.name}.{knob.name}")] = _widget_value(knob, value)


def _widget_value(knob: Knob, value: int | None) -> Any:
    """What a knob's widget holds: a choice (a select box), or the text of a whole number."""
    if knob.choices is not None:
        return OFF if value is None else value
    if value is None and knob.required:
        lo = knob.min if knob.min is not None else 1
        hi = knob.max if knob.max is not None else max(lo, BOUNDED_START)
        value = min(max(BOUNDED_START, lo), hi)
    return "" if value is None else str(value)


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


def _knob_widget(row: int, strategy: str, knob: Knob) -> tuple[Any, str]:
    """(the knob's value, None for off; the problem with what was typed, or "")."""
    key = Keys.strategy(row, f"{strategy}.{knob.name}")
    if knob.choices is None:
        if key not in st.session_state:
            st.session_state[key] = _widget_value(knob, knob.default)
        empty = None if knob.required else OFF if knob.default is None else f"default {knob.default}"
        return int_field(knob.name, key, lo=knob.min, hi=knob.max, default=knob.default, empty=empty, help=knob.help)
    if key not in st.session_state:
        st.session_state[key] = _widget_value(knob, knob.default)
    help_text = f"{knob.help}. Allowed: {knob.range_text}"
    if not knob.required:
        help_text += f"; default: {OFF if knob.default is None else knob.default}"
    options = ([] if knob.required or knob.default is not None else [OFF]) + list(knob.choices)
    value = st.selectbox(knob.name, options, **kept(key), help=help_text)
    return (None if value == OFF else value), ""


def strategy_editor(backend: str) -> list[dict[str, Any]]:
    """Draw the rows; return [{"name", "knobs", "spec", "problem"}] in order (the first is the
    baseline). ``spec`` is the row's validated spec, or None with ``problem`` saying why (a knob
    that does not parse, a bad combination, another backend's strategy, a repeat of an earlier
    row); each problem also shows in its row."""
    init_rows()
    rows = st.session_state[Keys.STRATEGY_ROWS]
    out: list[dict[str, Any]] = []
    names = list(STRATEGIES)
    for i, row in enumerate(rows):
        with st.container(border=True):
            head, buttons = st.columns([5, 2], vertical_alignment="bottom")
            with head:
                name = st.selectbox(
                    "baseline (the others are compared to it)" if i == 0 else f"strategy {i + 1}",
                    names,
                    **kept(Keys.strategy(row, "name")),
                    format_func=lambda n: n if backend in STRATEGIES[n].backends else f"{n} (not on {backend})",
                )
            with buttons:
                b1, b2 = st.columns(2)
                b1.button(
                    "Duplicate", key=Keys.strategy(row, "dup"), on_click=_duplicate_row, args=(row,), width="stretch"
                )
                b2.button(
                    "Remove",
                    key=Keys.strategy(row, "del"),
                    on_click=_remove_row,
                    args=(row,),
                    disabled=len(rows) == 1,
                    width="stretch",
                )
            strategy = STRATEGIES[name]
            st.caption(strategy.summary)
            knobs, bad = {}, []
            given = st.session_state.get(Keys.strategy(row, f"{name}.given"), ())
            if strategy.knobs:
                cols = st.columns(min(len(strategy.knobs), 6))
                for j, knob in enumerate(strategy.knobs):
                    with cols[j % len(cols)]:
                        value, problem = _knob_widget(row, name, knob)
                    if problem:
                        bad.append(knob.name)
                    # Defaults stay implicit, so labels read like specs people write.
                    elif value is not None and (knob.required or value != knob.default or knob.name in given):
                        knobs[knob.name] = value
            entry = {"name": name, "knobs": knobs, "spec": None, "problem": ""}
            where = "baseline" if i == 0 else f"strategy {i + 1}"
            if bad:
                entry["problem"] = f"{where} ({name}): fix {', '.join(bad)}"  # shown beside the knob already
            else:
                try:
                    spec = make_spec(name, knobs)
                    spec.check_backend(backend)
                except ValueError as e:
                    entry["problem"] = f"{where} ({name}): {e}"
                else:
                    try:
                        check_distinct([r["spec"] for r in out] + [spec])
                        entry["spec"] = spec
                    except ValueError as e:
                        entry["problem"] = str(e)
                if entry["problem"]:
                    st.error(md(entry["problem"]))
            out.append(entry)
    st.button("Add strategy", key=Keys.STRATEGY_ADD, on_click=_add_row)
    return out


def specs_of(rows: list[dict[str, Any]], backend: str) -> list[Spec]:
    """The validated spec of each row; a bad row raises ValueError naming the row and the knob."""
    for r in rows:
        if r.get("problem"):
            raise ValueError(r["problem"])
    specs = []
    for i, r in enumerate(rows):
        where = "baseline" if i == 0 else f"strategy {i + 1}"
        try:
            spec = r.get("spec") or make_spec(r["name"], r["knobs"])
            spec.check_backend(backend)
        except ValueError as e:
            raise ValueError(f"{where} ({r['name']}): {e}") from None
        specs.append(spec)
    check_distinct(specs)
    return specs
