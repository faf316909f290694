"""The Inspector's figures of what a bounded cache keeps: which absolute positions each layer
holds at one step (layers x positions), and which positions one layer holds at each recorded
step (positions x steps). Read from the profile's ``slots`` table (the ``ring`` probe): a ring
records one row per layer, the importance caches (``knorm``, ``snapkv``, ``tova``, ``h2o``) one
row per layer and KV head (``head``). A cell is the share of the layer's recorded heads that hold
the position (0..1; a ring or a one-head cache: 0 or 1), NaN for a position not yet seen.

Built as :mod:`app.charts` builds its figures: ``_*_info(tables) -> NamedTuple`` (what the tests
pin), then ``_*_plot(info) -> go.Figure``. No Streamlit, no I/O.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from cachelib.profile.figure_data import floats

from .figures import LEGEND_RIGHT, PALETTE, empty_figure, sampling_period
from .inspector_charts import HOVER_CELLS, _key_list

HELD_COLOR = PALETTE[0]
EVICTED_COLOR = "#eeeeee"  # seen, held by no head
KEPT_SPAN = 256  # recorded steps the positions x steps figure shows, ending at the chosen step
COLORSCALE = [[0.0, EVICTED_COLOR], [1.0, HELD_COLOR]]
NO_SLOTS = " (the ring probe records rings and importance caches)"


def _held_sets(rows: pd.DataFrame) -> list[np.ndarray]:
    """The positions each slot row holds (empty slots, -1, left out)."""
    out = []
    for text in rows["positions"]:
        keys = _key_list(None if pd.isna(text) else text)
        out.append(np.unique(keys[keys >= 0]))
    return out


def _share(rows: pd.DataFrame, width: int) -> tuple[np.ndarray, int]:
    """(width,) share of the rows (one per KV head, or one for a ring) holding each position."""
    held = _held_sets(rows)
    count = np.zeros(width, dtype=np.float64)
    for keys in held:
        count[keys[keys < width]] += 1
    return count / max(len(held), 1), len(held)


def _offsets(layers: pd.DataFrame, strategy: str) -> dict[tuple[int, int], int]:
    """{(step, layer): tokens seen} from the per-layer rows (memory probe)."""
    rows = layers[(layers["strategy"] == strategy) & layers["offset"].notna()]
    return {(int(s), int(l)): int(o) for s, l, o in zip(rows["step"], rows["layer"], floats(rows["offset"]))}


def _prompt_tokens(slots: pd.DataFrame, layers: pd.DataFrame, strategy: str) -> int | None:
    """Tokens in the prompt: the offset after the prefill (step 0), else what step 0's slots held."""
    off = [o for (s, _), o in _offsets(layers, strategy).items() if s == 0]
    if off:
        return max(off)
    rows = slots[(slots["strategy"] == strategy) & (slots["step"] == 0)]
    held = [k for k in _held_sets(rows) if len(k)]
    return int(max(k.max() for k in held)) + 1 if held else None


def _seen(offsets: dict, step: int, layer: int, rows: pd.DataFrame) -> int:
    """Positions seen by a layer at a step: its offset, else one past the newest it holds."""
    if (step, layer) in offsets:
        return offsets[step, layer]
    held = [k for k in _held_sets(rows) if len(k)]
    return int(max(k.max() for k in held)) + 1 if held else 0


def has_slots(slots: pd.DataFrame, strategy: str) -> bool:
    return bool((slots["strategy"] == strategy).any())


# --- layers x positions at one step -------------------------------------------------------------


class KeptLayersInfo(NamedTuple):
    strategy: str
    step: int
    layers: np.ndarray  # (L,) the layers with slot rows at this step
    positions: np.ndarray  # (P,) 0..the last position any layer has seen
    share: np.ndarray  # (L, P) share of the layer's KV heads holding the position; NaN: not yet seen
    heads: np.ndarray  # (L,) slot rows per layer (KV heads; 1 for a ring)
    seen: np.ndarray  # (L,) positions seen by each layer (its offset)
    prompt_tokens: int | None

    @property
    def per_head(self) -> bool:
        return bool((self.heads > 1).any())

    def held(self, layer: int) -> np.ndarray:
        """Positions held by at least one head of ``layer``."""
        i = self.layers.tolist().index(layer)
        return np.flatnonzero(np.nan_to_num(self.share[i]) > 0)


def _kept_layers_info(slots: pd.DataFrame, layers: pd.DataFrame, strategy: str, step: int) -> KeptLayersInfo | None:
    rows = slots[(slots["strategy"] == strategy) & (slots["step"] == step)]
    if not len(rows):
        return None
    offsets = _offsets(layers, strategy)
    ids = sorted(int(x) for x in rows["layer"].unique())
    per_layer = {l: rows[rows["layer"] == l] for l in ids}
    seen = np.array([_seen(offsets, step, l, per_layer[l]) for l in ids], dtype=np.int64)
    width = int(seen.max()) if len(seen) else 0
    share = np.full((len(ids), width), np.nan)
    heads = np.zeros(len(ids), dtype=np.int64)
    for i, l in enumerate(ids):
        s, heads[i] = _share(per_layer[l], width)
        share[i, : seen[i]] = s[: seen[i]]
    return KeptLayersInfo(
        strategy, step, np.array(ids), np.arange(width), share, heads, seen, _prompt_tokens(slots, layers, strategy)
    )


def _hover(share: np.ndarray, heads: np.ndarray) -> np.ndarray:
    """Words per cell: 'held', 'evicted', 'k of H KV heads hold it', 'not yet seen'."""
    h = np.broadcast_to(np.asarray(heads, dtype=np.int64), share.shape)
    k = np.rint(np.nan_to_num(share) * h).astype(np.int64)
    words = np.where(k > 0, "held", "evicted").astype(object)
    many = h > 1
    words[many] = [f"{a} of {b} KV heads hold it" for a, b in zip(k[many], h[many])]
    words[np.isnan(share)] = "not yet seen"
    return words


def _heatmap(z, x, y, heads, xname: str, yname: str, per_head: bool) -> go.Heatmap:
    bar = (
        {"title": {"text": "share of KV heads holding", "side": "right"}}
        if per_head
        else {"tickvals": [0, 1], "ticktext": ["evicted", "held"]}
    )
    where = f"{yname} %{{y}}<br>{xname} %{{x}}<br>"
    hover = (
        {"customdata": _hover(z, heads), "hovertemplate": where + "%{customdata}<extra></extra>"}
        if z.size <= HOVER_CELLS
        else {"hovertemplate": where + "share %{z}<extra></extra>"}
    )
    return go.Heatmap(
        z=z,
        x=x,
        y=y,
        zmin=0,
        zmax=1,
        colorscale=COLORSCALE,
        hoverongaps=False,
        xgap=0.3,
        ygap=0.3,
        colorbar={**bar, "thickness": 14, "len": 1.0, "y": 0.5},
        **hover,
    )


def _prompt_line(fig: go.Figure, prompt_tokens: int | None, axis: str) -> None:
    if not prompt_tokens:
        return
    at = prompt_tokens - 0.5
    line = {"dash": "dot", "color": "#D55E00", "width": 1.5}
    if axis == "x":
        fig.add_vline(x=at, line=line)
    else:
        fig.add_hline(y=at, line=line)
    fig.add_trace(
        go.Scatter(x=[None], y=[None], mode="lines", line=line, name=f"end of the prompt ({prompt_tokens} tokens)")
    )


def _kept_layers_plot(info: KeptLayersInfo) -> go.Figure:
    heat = _heatmap(info.share, info.positions, info.layers, info.heads[:, None], "position", "layer", info.per_head)
    fig = go.Figure(heat)
    _prompt_line(fig, info.prompt_tokens, "x")
    held = [len(info.held(int(l))) for l in info.layers]
    what = (
        f"colour: share of the layer's {int(info.heads.max())} KV heads holding it"
        if info.per_head
        else "which absolute positions each layer holds"
    )
    count = f"{min(held)}" if min(held) == max(held) else f"{min(held)}–{max(held)} (by layer)"
    # Per-head eviction: a position counts as held when any KV head holds it; each head holds
    # fewer (the summary's "tokens held" counts one head's).
    union = " by any KV head (each head holds fewer)" if info.per_head else ""
    fig.update_layout(
        title={
            "text": (
                f"kept positions per layer<br><sup>{info.strategy} · step {info.step}</sup>"
                f"<br><sup>{what}</sup><br><sup>{count} of {int(info.seen.max())} positions held{union}</sup>"
            )
        },
        xaxis_title="absolute position",
        yaxis_title="layer",
        legend=LEGEND_RIGHT,
        height=max(240, min(560, 150 + 22 * len(info.layers))),
        margin={"t": 80},
    )
    fig.update_yaxes(autorange="reversed", dtick=1 if len(info.layers) <= 32 else None)
    return fig


def kept_layers_figure(slots: pd.DataFrame, layers: pd.DataFrame, strategy: str, step: int) -> go.Figure:
    """Layers x absolute positions at one recorded step: which positions each layer holds (for a
    cache that evicts per KV head, the share of the layer's heads that hold it)."""
    info = _kept_layers_info(slots, layers, strategy, step)
    if info is None:
        why = f"no slot table recorded for {strategy} at step {step}" + NO_SLOTS
        return empty_figure("Kept positions per layer", why)
    return _kept_layers_plot(info)


# --- positions x steps for one layer ------------------------------------------------------------


class KeptStepsInfo(NamedTuple):
    strategy: str
    layer: int
    steps: np.ndarray  # (S,) the recorded steps of the block
    positions: np.ndarray  # (P,) 0..the last position seen
    share: np.ndarray  # (P, S) share of KV heads holding the position at the step; NaN: not yet seen
    heads: np.ndarray  # (S,) slot rows (KV heads) recorded per step
    seen: np.ndarray  # (S,) positions seen at each step
    prompt_tokens: int | None
    every: int | None  # sampling period of the ring probe

    def held(self, step: int) -> np.ndarray:
        """Positions held by at least one head at ``step``."""
        j = self.steps.tolist().index(step)
        return np.flatnonzero(np.nan_to_num(self.share[:, j]) > 0)

    @property
    def kept_throughout(self) -> np.ndarray:
        """Positions held (by some head) at every decode step of the block (step > 0)."""
        cols = self.steps > 0
        if not cols.any():
            return np.array([], dtype=np.int64)
        return np.flatnonzero((np.nan_to_num(self.share[:, cols]) > 0).all(axis=1))


def _kept_steps_info(
    slots: pd.DataFrame, layers: pd.DataFrame, strategy: str, layer: int, step: int, span: int = KEPT_SPAN
) -> KeptStepsInfo | None:
    rows = slots[(slots["strategy"] == strategy) & (slots["layer"] == layer)]
    recorded = sorted(int(s) for s in rows["step"].unique())
    if not recorded:
        return None
    upto = [s for s in recorded if s <= step]
    block = upto[-span:] if upto else recorded[:span]
    offsets = _offsets(layers, strategy)
    by_step = {s: rows[rows["step"] == s] for s in block}
    seen = np.array([_seen(offsets, s, layer, by_step[s]) for s in block], dtype=np.int64)
    width = int(seen.max())
    share = np.full((width, len(block)), np.nan)
    heads = np.zeros(len(block), dtype=np.int64)
    for j, s in enumerate(block):
        col, heads[j] = _share(by_step[s], width)
        share[: seen[j], j] = col[: seen[j]]
    return KeptStepsInfo(
        strategy,
        layer,
        np.array(block),
        np.arange(width),
        share,
        heads,
        seen,
        _prompt_tokens(slots, layers, strategy),
        sampling_period(block),
    )


def _kept_steps_plot(info: KeptStepsInfo) -> go.Figure:
    per_head = bool((info.heads > 1).any())
    fig = go.Figure(_heatmap(info.share, info.steps, info.positions, info.heads[None, :], "step", "position", per_head))
    _prompt_line(fig, info.prompt_tokens, "y")
    every = f", recorded every {info.every} steps" if info.every and info.every > 1 else ""
    stay = len(info.kept_throughout)
    fig.update_layout(
        title={
            "text": (
                f"kept positions over the run<br><sup>{info.strategy} · layer {info.layer} · steps "
                f"{info.steps[0]}–{info.steps[-1]}{every}</sup>"
                f"<br><sup>a ring's window climbs the diagonal; chosen positions stay as rows</sup>"
                f"<br><sup>{stay} positions held at every decode step shown</sup>"
            )
        },
        xaxis_title="step",
        yaxis_title="absolute position",
        legend=LEGEND_RIGHT,
        height=max(300, min(640, 160 + 4 * len(info.positions))),
        margin={"t": 80},
    )
    return fig


def kept_steps_figure(
    slots: pd.DataFrame, layers: pd.DataFrame, strategy: str, layer: int, step: int, span: int = KEPT_SPAN
) -> go.Figure:
    """Absolute positions x recorded steps for one layer, over up to ``span`` recorded steps
    ending at ``step``: which positions the layer holds at each step."""
    info = _kept_steps_info(slots, layers, strategy, layer, step, span)
    if info is None:
        why = f"no slot table recorded for {strategy} at layer {layer}" + NO_SLOTS
        return empty_figure("Kept positions over the run", why)
    return _kept_steps_plot(info)
