"""The Inspector's figures of one layer cache: its slots, the attention masks it produced, and
what it held over a block of decode steps. Built as :mod:`app.charts` builds its figures:
``_*_info(tables) -> NamedTuple`` (what the tests pin), then ``_*_plot(info) -> go.Figure``.

A mask cell says one of five things about a key for a query (:data:`MASK_STATES`): visible,
held but masked, masked by causality (a later position), evicted (seen, no longer held: never
drawn as visible), or an empty slot. The states have fixed colours, named in each legend.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from cachelib.profile.figure_data import floats

from .figures import LEGEND_RIGHT, empty_figure, sampling_period

EMPTY_SLOT_COLOR = "#e5e5e5"
EDGE = {"width": 1, "color": "#999"}  # the outline of a legend's colour square


# --- inspector: the slots of one layer cache --------------------------------------------------------


class RingInfo(NamedTuple):
    strategy: str
    step: int
    layer: int
    layout: str  # "ring" (from the slots table) or "linear" (derived from the layers row)
    positions: np.ndarray  # (capacity,) absolute position per slot, -1 empty
    width: int  # slots per drawn row
    write_index: int | None
    keep: int
    evicted: int
    offset: int


def slot_grid_width(capacity: int) -> int:
    return max(1, min(capacity, 32 if capacity <= 512 else 64))


def _ring_info(slots: pd.DataFrame, layers: pd.DataFrame, strategy: str, step: int, layer: int) -> RingInfo | None:
    lrow = layers[(layers["strategy"] == strategy) & (layers["step"] == step) & (layers["layer"] == layer)]
    srow = _first_head(slots[(slots["strategy"] == strategy) & (slots["step"] == step) & (slots["layer"] == layer)])
    lr = lrow.iloc[0] if len(lrow) else None
    if len(srow):
        r = srow.iloc[0]
        text = str(r["positions"]).strip()
        positions = np.array([int(p) for p in text.split()] if text else [], dtype=np.int64)
        write_index = None if pd.isna(r["write_index"]) else int(r["write_index"])
        keep = 0 if pd.isna(r["keep"]) else int(r["keep"])
        layout = "ring"
    elif lr is not None:
        # Append-only layouts: the held tokens fill the first slots, ending at the newest position.
        capacity, held, offset = int(lr["capacity"]), int(lr["tokens_held"]), int(lr["offset"])
        positions = np.full(capacity, -1, dtype=np.int64)
        positions[: min(held, capacity)] = np.arange(offset - held, offset - held + min(held, capacity))
        write_index = None if pd.isna(lr["write_index"]) else int(lr["write_index"])
        keep = 0 if pd.isna(lr["keep"]) else int(lr["keep"])
        layout = "linear"
    else:
        return None
    held = positions[positions >= 0]
    offset = int(lr["offset"]) if lr is not None and pd.notna(lr["offset"]) else int(held.max() + 1 if len(held) else 0)
    evicted = int(lr["evicted"]) if lr is not None and pd.notna(lr["evicted"]) else max(0, offset - len(held))
    width = slot_grid_width(len(positions))
    return RingInfo(strategy, step, layer, layout, positions, width, write_index, keep, evicted, offset)


def _ring_plot(info: RingInfo) -> go.Figure:
    cap, w = len(info.positions), info.width
    rows = -(-cap // w) if cap else 0
    grid = np.full(rows * w, np.nan)
    grid[:cap] = np.where(info.positions >= 0, info.positions, np.nan)
    idx = np.arange(rows * w)
    # Cell and hover text: the position a slot holds, "empty" for a slot that holds nothing.
    label = np.array([str(int(p)) if p >= 0 else "empty" for p in info.positions] + [""] * (rows * w - cap))
    slot_text = np.where(idx < cap, idx.astype(str), "").astype(object)
    custom = np.dstack([slot_text.reshape(rows, w), label.reshape(rows, w)])
    fig = go.Figure(
        go.Heatmap(
            z=grid.reshape(rows, w),
            x=np.arange(w),
            y=np.arange(rows),
            customdata=custom,
            colorscale="Viridis",
            zmin=0,
            zmax=max(info.offset - 1, 1),
            xgap=1,
            ygap=1,
            colorbar={"title": {"text": "position", "side": "right"}, "thickness": 14, "len": 1.0, "y": 0.5},
            name="slots",
            hoverongaps=True,
            hovertemplate="slot %{customdata[0]}<br>position %{customdata[1]}<extra></extra>",
            text=label.reshape(rows, w) if cap <= 128 else None,
            texttemplate="%{text}" if cap <= 128 else None,
            textfont={"size": 9},
        )
    )
    if (info.positions < 0).any():
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name="empty slot",
                marker={"symbol": "square", "size": 12, "color": EMPTY_SLOT_COLOR, "line": EDGE},
            )
        )
    if info.keep:
        k = np.arange(min(info.keep, cap))
        fig.add_trace(
            go.Scatter(
                x=k % w,
                y=k // w,
                mode="markers",
                name=f"keep region ({info.keep} sink slots)",
                marker={"symbol": "square-open", "size": 18, "color": "#D55E00", "line": {"width": 2}},
                hoverinfo="skip",
            )
        )
    if info.write_index is not None:
        wi = info.write_index
        past_end = wi >= cap
        shown = min(wi, max(cap - 1, 0))
        name = f"write pointer → slot {wi}" + (" (past the end: the next write wraps or grows)" if past_end else "")
        fig.add_trace(
            go.Scatter(
                x=[shown % w + (0.5 if past_end else 0)],
                y=[shown // w - 0.45],
                mode="markers",
                name=name,
                marker={"symbol": "triangle-down", "size": 14, "color": "#CC0000"},
                hoverinfo="name",
            )
        )
    held = int((info.positions >= 0).sum())
    fig.update_layout(
        title={
            "text": (
                f"{info.strategy} · layer {info.layer} · step {info.step}:<br><sup>{held} of {cap} slots hold "
                f"tokens, keep {info.keep}, evicted {info.evicted}</sup>"
            ),
            "y": 0.98,
            "yanchor": "top",
            "yref": "container",
        },
        xaxis={"title": "slot (column)", "showgrid": False, "zeroline": False, "dtick": 4 if w <= 32 else 8},
        yaxis={
            "title": "slots",
            "autorange": "reversed",
            "showgrid": False,
            "zeroline": False,
            "tickvals": list(range(rows)),
            "ticktext": [f"{r * w}–{min(cap, (r + 1) * w) - 1}" for r in range(rows)],
        },
        plot_bgcolor=EMPTY_SLOT_COLOR,
        # The legend sits above the plot area, under the title: clear of the axis titles below
        # and of the colour bar on the right.
        legend={"orientation": "h", "x": 0.0, "xanchor": "left", "y": 1.02, "yanchor": "bottom"},
        margin={"t": 90, "b": 60},
        # Tall enough that a one-row ring's colour bar (as tall as the plot area) stays readable.
        height=min(900, max(330, 190 + 40 * rows)),
    )
    return fig


def ring_figure(slots: pd.DataFrame, layers: pd.DataFrame, strategy: str, step: int, layer: int) -> go.Figure:
    """The slots of one layer cache at one step, coloured by the absolute position each holds:
    ring caches from the ``slots`` table, append-only caches from their ``layers`` row."""
    info = _ring_info(slots, layers, strategy, step, layer)
    if info is None:
        return empty_figure("Slots", f"nothing recorded for {strategy} at step {step}, layer {layer}")
    return _ring_plot(info)


# --- inspector: attention masks -------------------------------------------------------------------

# What a cell of a mask figure says about one key for one query (the code is the cell's z).
VISIBLE, HIDDEN, CAUSAL, EVICTED, EMPTY = range(5)
MASK_STATES = {
    VISIBLE: ("visible", "#0072B2"),
    HIDDEN: ("held, masked", "#9ACFEA"),  # the cache holds the key but the mask hides it (a window)
    CAUSAL: ("masked by causality", "#F2F2F2"),  # a later position than the query's
    EVICTED: ("evicted", "#D55E00"),  # seen before, no longer held by the cache
    EMPTY: ("empty slot", "#BDBDBD"),  # slot order only: a slot that holds nothing
}
NOT_HELD = "not held"


def _key_list(text) -> np.ndarray:
    text = "" if text is None or (isinstance(text, float) and np.isnan(text)) else str(text).strip()
    return np.array([int(p) for p in text.split()] if text else [], dtype=np.int64)


def _states_slot_order(visible: np.ndarray, keys: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """(queries, slots) state of each key slot, as the cache returned them."""
    later = keys[None, :] > queries[:, None]
    state = np.where(visible, VISIBLE, np.where(later, CAUSAL, HIDDEN))
    state[:, keys < 0] = EMPTY
    return state.astype(np.int8)


def _states_temporal(
    visible: np.ndarray, keys: np.ndarray, queries: np.ndarray, positions: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(queries, positions) state of every absolute position 0..P and the slot holding each
    (-1: not held). A position the cache no longer holds is evicted, never visible."""
    slot_of = np.full(len(positions), -1, dtype=np.int64)
    held = keys >= 0
    slot_of[keys[held]] = np.flatnonzero(held)
    later = positions[None, :] > queries[:, None]
    state = np.where(later, CAUSAL, EVICTED).astype(np.int8)
    cols = np.flatnonzero(slot_of >= 0)
    vis = visible[:, slot_of[cols]]
    state[:, cols] = np.where(vis, VISIBLE, np.where(later[:, cols], CAUSAL, HIDDEN))
    return state, slot_of


class MaskInfo(NamedTuple):
    strategy: str
    step: int
    layer: int
    order: str  # "slot" or "temporal"
    state: np.ndarray  # (queries, columns) codes of MASK_STATES
    query_positions: np.ndarray  # (queries,)
    key_positions: np.ndarray  # (columns,) absolute position per column, -1 for an empty slot
    key_slots: np.ndarray  # (columns,) slot per column, -1 where no slot holds the position

    @property
    def visible(self) -> np.ndarray:
        return self.state == VISIBLE

    def count(self, code: int, query: int = -1) -> int:
        """Columns in ``code``'s state for one query row (default the last)."""
        return int((self.state[query] == code).sum()) if len(self.state) else 0


def _mask_info(masks: pd.DataFrame, strategy: str, step: int, layer: int, order: str) -> MaskInfo | None:
    if order not in ("slot", "temporal"):
        raise ValueError(f"order must be 'slot' or 'temporal', got {order!r}")
    rows = masks[(masks["strategy"] == strategy) & (masks["step"] == step) & (masks["layer"] == layer)]
    if not len(rows):
        return None
    rows = rows.sort_values("query")
    keys = _key_list(rows.iloc[0]["key_positions"])
    width = min(len(keys), min(len(str(m)) for m in rows["mask"]))
    keys = keys[:width]
    visible = np.array([[c == "1" for c in str(m)[:width]] for m in rows["mask"]], dtype=bool).reshape(len(rows), width)
    queries = floats(rows["query_position"]).astype(np.int64)
    if order == "slot":
        state = _states_slot_order(visible, keys, queries)
        return MaskInfo(strategy, step, layer, order, state, queries, keys, np.arange(width))
    last = int(max(keys.max() if len(keys) else -1, queries.max()))
    positions = np.arange(last + 1)
    state, slot_of = _states_temporal(visible, keys, queries, positions)
    return MaskInfo(strategy, step, layer, order, state, queries, positions, slot_of)


def _state_colorscale() -> list:
    """A stepped colour scale: code c is drawn in its state's colour (z from -0.5 to 4.5)."""
    n = len(MASK_STATES)
    scale = []
    for code, (_, color) in sorted(MASK_STATES.items()):
        scale += [[code / n, color], [(code + 1) / n, color]]
    return scale


def _state_legend(fig: go.Figure, present: set[int]) -> None:
    """One legend entry per state the figure shows (a heatmap has none of its own)."""
    for code, (name, color) in MASK_STATES.items():
        if code in present:
            fig.add_trace(
                go.Scatter(
                    x=[None],
                    y=[None],
                    mode="markers",
                    name=name,
                    showlegend=True,
                    hoverinfo="skip",
                    marker={"symbol": "square", "size": 12, "color": color, "line": EDGE},
                )
            )


HOVER_CELLS = 200_000  # past this many cells a figure drops the per-cell hover words (megabytes of JSON)


def _state_heatmap(state, x, y, slot_text, position_text, row: str = "query position") -> go.Heatmap:
    names = np.array([MASK_STATES[c][0] for c in sorted(MASK_STATES)], dtype=object)
    if state.size > HOVER_CELLS:
        hover = {"hovertemplate": f"{row} %{{y}}<br>key %{{x}}<extra></extra>"}
    else:
        hover = {
            "customdata": np.dstack([slot_text, position_text, names[state]]),
            # The same words in both orders: hovering a key names its slot and its position.
            "hovertemplate": f"{row} %{{y}}<br>key position %{{customdata[1]}} · slot %{{customdata[0]}}"
            "<br>%{customdata[2]}<extra></extra>",
        }
    return go.Heatmap(
        z=state,
        x=x,
        y=y,
        zmin=-0.5,
        zmax=len(MASK_STATES) - 0.5,
        colorscale=_state_colorscale(),
        showscale=False,
        xgap=0.3,
        ygap=0.3,
        **hover,
    )


def _mask_plot(info: MaskInfo) -> go.Figure:
    q, k = info.state.shape
    if info.order == "slot":
        x = info.key_slots
        slots = np.broadcast_to(info.key_slots.astype(str), (q, k))
        pos = np.broadcast_to(np.where(info.key_positions >= 0, info.key_positions.astype(str), "empty"), (q, k))
        where = "key slot (the order the cache returns keys)"
    else:
        x = info.key_positions
        slots = np.broadcast_to(np.where(info.key_slots >= 0, info.key_slots.astype(str), NOT_HELD), (q, k))
        pos = np.broadcast_to(info.key_positions.astype(str), (q, k))
        where = "key position (temporal order)"
    fig = go.Figure(_state_heatmap(info.state, x, info.query_positions, slots, pos))
    _state_legend(fig, set(np.unique(info.state).tolist()))
    held = int((info.key_positions >= 0).sum()) if info.order == "slot" else int((info.key_slots >= 0).sum())
    title = f"mask, {info.order} order · step {info.step} · layer {info.layer}"
    detail = f"last query sees {info.count(VISIBLE)} of {held} held keys"
    if info.order == "temporal":
        detail += f"; {info.count(EVICTED)} earlier positions evicted"
    fig.update_layout(
        title={"text": f"{title}<br><sup>{detail}</sup>"},
        xaxis_title=where,
        yaxis_title="query position",
        legend=LEGEND_RIGHT,
        height=max(260, min(520, 150 + 8 * q)),
        margin={"t": 80},
    )
    fig.update_yaxes(autorange="reversed", type="category" if q <= 1 else "linear")
    return fig


def mask_figure(masks: pd.DataFrame, strategy: str, step: int, layer: int, order: str = "slot") -> go.Figure:
    """The attention mask (query x key) a layer cache produced at one step, with the keys in
    slot order or by absolute position (temporal order, every position up to the query's, so
    the positions a ring evicted show as evicted). The states have fixed colours, named in the
    legend."""
    info = _mask_info(masks, strategy, step, layer, order)
    if info is None:
        return empty_figure("Attention mask", f"no mask recorded for {strategy} at step {step}, layer {layer}")
    return _mask_plot(info)


# --- inspector: what the cache holds over a run ---------------------------------------------------

RUN_SPAN = 64  # recorded decode steps in the block the run matrix shows


class MaskRunInfo(NamedTuple):
    strategy: str
    layer: int
    steps: np.ndarray  # (rows,) the recorded decode steps of the block
    query_positions: np.ndarray  # (rows,) the position each step's query has
    key_positions: np.ndarray  # (columns,) 0..the last query's position
    state: np.ndarray  # (rows, columns) codes of MASK_STATES
    key_slots: np.ndarray  # (rows, columns) slot holding the position, -1 not held
    source: str  # "slots" (a ring's slot table) or "layers" (an append-only cache's rows)
    every: int | None  # sampling period of the rows (the probe that recorded them)
    masked_steps: list[int]  # rows whose visibility a recorded mask gave (elsewhere: held = visible)


def _first_head(rows: pd.DataFrame) -> pd.DataFrame:
    """Slot rows of one KV head: caches that evict per head record a row per head (``head``);
    the figures show the first head's (a ring's rows have no head and all stay)."""
    if "head" not in rows or not rows["head"].notna().any():
        return rows
    return rows[rows["head"].isna() | (rows["head"] == rows["head"].min())]


def _held_per_step(slots: pd.DataFrame, layers: pd.DataFrame, strategy: str, layer: int):
    """{step: positions held in slot order} from the slot table (ring caches), else from the
    layers rows (append-only caches hold the newest ``tokens_held`` positions in order)."""
    srows = _first_head(slots[(slots["strategy"] == strategy) & (slots["layer"] == layer)])
    if len(srows):
        return {int(r.step): _key_list(r.positions) for r in srows.itertuples()}, "slots"
    lrows = layers[(layers["strategy"] == strategy) & (layers["layer"] == layer)]
    out = {}
    for r in lrows.itertuples():
        if pd.isna(r.offset) or pd.isna(r.tokens_held):
            continue
        offset, held = int(r.offset), int(r.tokens_held)
        out[int(r.step)] = np.arange(offset - held, offset, dtype=np.int64)
    return out, "layers"


def _mask_run_info(
    steps: pd.DataFrame,
    layers: pd.DataFrame,
    slots: pd.DataFrame,
    masks: pd.DataFrame,
    strategy: str,
    layer: int,
    step: int,
    span: int = RUN_SPAN,
) -> MaskRunInfo | None:
    held, source = _held_per_step(slots, layers, strategy, layer)
    srows = steps[(steps["strategy"] == strategy) & (steps["phase"] == "decode")]
    query = dict(zip(floats(srows["step"]).astype(np.int64).tolist(), floats(srows["position"]).tolist()))
    recorded = sorted(s for s in held if s in query and np.isfinite(query[s]))
    if not recorded:
        return None
    upto = [s for s in recorded if s <= step]
    block = upto[-span:] if upto else recorded[:span]
    qpos = np.array([int(query[s]) for s in block], dtype=np.int64)
    positions = np.arange(int(qpos.max()) + 1)
    state = np.empty((len(block), len(positions)), dtype=np.int8)
    key_slots = np.full((len(block), len(positions)), -1, dtype=np.int64)
    mrows = masks[(masks["strategy"] == strategy) & (masks["layer"] == layer)]
    masked_steps = []
    for i, s in enumerate(block):
        keys = np.where(held[s] < len(positions), held[s], -1)
        visible = np.ones((1, len(keys)), dtype=bool)
        m = mrows[mrows["step"] == s]
        if len(m):  # a recorded mask: its last query row (this step's token) says what it saw
            last = m.sort_values("query").iloc[-1]
            mkeys = _key_list(last["key_positions"])
            seen = {int(p) for p, c in zip(mkeys, str(last["mask"])) if c == "1" and p >= 0}
            visible = np.array([[int(p) in seen for p in keys]], dtype=bool)
            masked_steps.append(s)
        row_state, slot_of = _states_temporal(visible, keys, qpos[i : i + 1], positions)
        state[i], key_slots[i] = row_state[0], slot_of
    return MaskRunInfo(
        strategy,
        layer,
        np.array(block),
        qpos,
        positions,
        state,
        key_slots,
        source,
        sampling_period(block),
        masked_steps,
    )


def _mask_run_plot(info: MaskRunInfo) -> go.Figure:
    r, k = info.state.shape
    slots = np.where(info.key_slots >= 0, info.key_slots.astype(str), NOT_HELD)
    pos = np.broadcast_to(info.key_positions.astype(str), (r, k))
    fig = go.Figure(_state_heatmap(info.state, info.key_positions, info.steps, slots, pos, row="step"))
    _state_legend(fig, set(np.unique(info.state).tolist()))
    every = f", recorded every {info.every} steps" if info.every and info.every > 1 else ""
    fig.update_layout(
        title={
            "text": (
                f"what the cache holds, steps {info.steps[0]}–{info.steps[-1]}{every} · layer {info.layer}"
                f"<br><sup>one row per decode step: which earlier positions its query can still see</sup>"
            )
        },
        xaxis_title="key position (temporal order)",
        yaxis_title="decode step",
        legend=LEGEND_RIGHT,
        height=max(300, min(640, 160 + 7 * r)),
        margin={"t": 80},
    )
    fig.update_yaxes(autorange="reversed")
    return fig


def mask_run_figure(
    steps: pd.DataFrame,
    layers: pd.DataFrame,
    slots: pd.DataFrame,
    masks: pd.DataFrame,
    strategy: str,
    layer: int,
    step: int,
    span: int = RUN_SPAN,
) -> go.Figure:
    """Decode steps x key positions over a block of up to ``span`` recorded steps ending at
    ``step``: visible, evicted or later than the step's query. What a ring holds comes from its
    slot table, an append-only cache's from its layers rows; a step with a recorded mask takes
    visibility from it (elsewhere a decode query sees every key held)."""
    info = _mask_run_info(steps, layers, slots, masks, strategy, layer, step, span)
    if info is None:
        why = f"no slot table or per-layer rows recorded for {strategy}'s decode steps at layer {layer}"
        return empty_figure("What the cache holds over the run", why)
    return _mask_run_plot(info)
