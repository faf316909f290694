"""The speed model's step (:mod:`cachelib.plan.speed`): what one decode step or prefill chunk of a
batch reads and computes on one device (:func:`step_cost`, from the planner's exact byte
accounting) and how long it takes at a runtime's fractions of the device's peaks
(:func:`step_time`, :class:`Efficiency`). Where those fractions come from is
:mod:`cachelib.plan.speed_fit`."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from ..spec import Spec
from .accounting import account
from .arch import Arch
from .device import _embedding_params
from .hardware import Hardware
from .runtimes import own_loop

MIN_SPREAD = 0.10  # the narrowest interval quoted: +-10% of the step time
# A fit on published measurements quotes at least +-20%: its calibration residuals understate it (2-4
# runs per runtime, fitted almost exactly), and the held-out published measurements of
# tests/plan/test_plan_speed.py miss by up to 19% (llama.cpp), 15% (vLLM), 11% (mlx-lm).
PUBLISHED_SPREAD = 0.20
BORROWED_SPREAD = 0.30  # a runtime whose fractions come from another runtime's measurements


@dataclass(frozen=True)
class Efficiency:
    """What a runtime reaches on a kind of device: fractions of peak bandwidth and compute, a
    per-step overhead (seconds), the relative half-width of the interval, and where they come
    from."""

    bandwidth_fraction: float
    compute_fraction: float
    overhead_s: float
    spread: float
    source: str
    # Seconds per (head x visible key) of a decode step's attention computed as matvec + softmax
    # (the CPU backends): not a fused kernel streaming K/V at the bandwidth. 0 where it is fused.
    pair_s: float = 0.0
    # Seconds per session row of a decode step beyond its bytes: on the CPU backends each row's
    # token costs the work of its own vector through every layer (measured: a batch of 4 is not
    # 4 rows for the price of the weights' bytes). 0 where not fitted.
    row_s: float = 0.0
    # Multiplies the attention probe's seconds (:class:`~cachelib.plan.hardware.AttentionProbe`:
    # this CPU's attention kernel timed bare at each layer's length) where a decode step's attention
    # is charged by it instead of by its K/V bytes and a constant cost per pair. 0: not probed (every
    # published fit: GPU and Apple plans never probe).
    attention_scale: float = 0.0


class StepCost(NamedTuple):
    """What one step moves and computes on one device."""

    weight_bytes: int
    kv_bytes: int  # K/V read, in the storage format (codes + scales + biases where quantized)
    score_bytes: int  # attention scores materialised: written and read back
    flops: float
    comm_bytes: int  # tensor-parallel all-reduce payload per device
    decoded_bytes: int = 0  # K/V decoded to the dtype for attention: written and read back
    pairs: float = 0.0  # heads x queries x visible keys, summed over layers and rows
    rows: float = 0.0  # sessions decoding one token each (a decode step); 0 for a prefill chunk
    attention_flops: float = 0.0  # of ``flops``: QK^T and PV
    probed_attention_s: float = 0.0  # the attention probe's seconds for this step's layers and rows; 0: not probed
    probed_decode: bool = False  # the probe's seconds include decoding the K/V whole (torch's quantized caches)

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.score_bytes + self.decoded_bytes

    @property
    def bytes_besides_attention(self) -> int:
        """What the step moves outside a probed attention: the weights, and a cache decoded whole
        before attention its codes read and its decode written, unless the probe timed that decode
        too (:attr:`probed_decode`; attention's read of it, of a cache it reads as held, and of the
        scores it materialises are the probe's)."""
        decode = self.kv_bytes + self.decoded_bytes // 2 if self.decoded_bytes and not self.probed_decode else 0
        return self.weight_bytes + decode


def runtime_key(runtime: str | None, backend: str) -> str:
    """The name calibrations are kept under: the runtime, else cachelib's loop on its backend."""
    return f"cachelib-{backend}" if own_loop(runtime) else runtime


def _held_after(arch, spec, backend, dtype, deployment, chunk, context, prefill) -> tuple[int, tuple[int, ...]]:
    """(K/V bytes one session's cache holds, tokens held per attention layer) at ``context``
    tokens of which the first ``prefill`` were a prompt fed in ``chunk``-token chunks."""
    acc = account(
        arch,
        spec,
        backend,
        context=context,
        prefill=prefill,
        prefill_chunk=chunk,
        batch=1,
        dtype=dtype,
        deployment=deployment,
    )
    return acc.bytes_used, tuple(la.tokens_held for la in acc.layers if la.layer_type != "recurrent")


@lru_cache(maxsize=4096)
def _held(
    arch: Arch, spec: Spec, backend: str, dtype: str, deployment, prefill_chunk: int | None, context: int
) -> tuple[int, tuple[int, ...]]:
    """What one session's cache holds right after the decode step that brings it to ``context``
    tokens (the prompt fed before it, then that step): :func:`_held_after`."""
    prefill = context - 1 if context > 1 else None
    return _held_after(arch, spec, backend, dtype, deployment, prefill_chunk, context, prefill)


def _prompt_held(arch, spec, backend, dtype, deployment, chunk, context) -> tuple[int, tuple[int, ...]]:
    """What one session's cache holds once a ``context``-token prompt went in (no decode step)."""
    return _held_after(arch, spec, backend, dtype, deployment, chunk, context, context)


def _active_params(arch: Arch, tp: int) -> tuple[float, float]:
    """(parameters a token multiplies through on one device, of which the LM head's)."""
    embed, tied = _embedding_params(arch)
    params = (arch.num_params or 0) - (0 if tied else embed)  # the input embedding is a lookup
    return params / tp, embed / tp


def step_cost(
    arch: Arch,
    spec: Spec,
    *,
    rows: int,
    tokens: int,
    held: tuple[int, tuple[int, ...]],
    weights_bytes: int,
    quantized: bool,
    materialised: bool,
    all_logits: bool,
    tp: int = 1,
    decoded_itemsize: int = 0,
) -> StepCost:
    """One forward of ``rows`` sessions x ``tokens`` new tokens over caches that hold ``held``
    (bytes per session, tokens per attention layer) after it, on one device of ``tp``;
    ``decoded_itemsize``: the quantized K/V is decoded whole at this itemsize for attention."""
    kv_per_row, layer_tokens = held
    embed, tied = _embedding_params(arch)
    read_weights = weights_bytes if tied or not arch.num_params else weights_bytes * (1 - embed / arch.num_params)
    params, head = _active_params(arch, tp)
    if not all_logits and tokens > 1:  # the runtime computes the last position's logits only
        params_flops = 2 * rows * ((params - head) * tokens + head)
    else:
        params_flops = 2 * rows * tokens * params
    heads = arch.num_heads / tp
    dim = (arch.key_dim + arch.value_dim) / 2
    visible = 0.0  # query-key pairs summed over layers, per row
    for held_tokens in layer_tokens:
        before = max(0, held_tokens - tokens)
        visible += tokens * held_tokens if materialised or tokens == 1 else tokens * before + tokens * (tokens + 1) / 2
    attn_flops = 4 * heads * dim * visible * rows
    deq_flops = 2 * rows * sum(layer_tokens) * arch.kv_heads / tp * (arch.key_dim + arch.value_dim) if quantized else 0
    score_bytes = int(4 * 4 * heads * visible * rows) if materialised else 0  # float32 scores and probs, out and in
    # 2 all-reduces per layer of the 16-bit hidden states
    comm = 2 * arch.num_layers * rows * tokens * arch.hidden_size * 2 if tp > 1 else 0
    elements = rows * sum(layer_tokens) * arch.kv_heads / tp * (arch.key_dim + arch.value_dim)
    decoded = int(2 * elements * decoded_itemsize)
    # The per-pair cost is single-query attention's (a decode step); a chunk's is matmul FLOPs.
    pairs = heads * visible * rows if tokens == 1 else 0.0
    return StepCost(
        int(read_weights),
        kv_per_row * rows,
        score_bytes,
        params_flops + attn_flops + deq_flops,
        comm,
        decoded,
        pairs,
        float(rows) if tokens == 1 else 0.0,
        attn_flops,
    )


def step_time(cost: StepCost, hw: Hardware, eff: Efficiency, compute_dtype: str, tp: int = 1) -> float:
    """Seconds for one step: the slower of moving its bytes and doing its FLOPs at the
    runtime's fractions of the device's peaks, plus the per-step overhead and the all-reduces.
    Materialised attention scores are written by one kernel and read by the next (the softmax
    between two matmuls), so their traffic adds to the step rather than hiding under its FLOPs."""
    bw = eff.bandwidth_fraction * hw.bandwidth
    probed = cost.probed_attention_s and eff.attention_scale  # the attention as the probe timed it
    if probed:  # the probe's time stands for the attention's bytes and FLOPs
        streamed, flops = cost.bytes_besides_attention, cost.flops - cost.attention_flops
    else:
        streamed, flops = cost.bytes - cost.score_bytes, cost.flops
    t = streamed / bw
    peak = hw.compute(compute_dtype)
    if peak:
        t = max(t, flops / (eff.compute_fraction * peak))
    if probed:
        return t + eff.attention_scale * cost.probed_attention_s + cost.rows * eff.row_s + eff.overhead_s
    t += cost.score_bytes / bw
    if tp > 1 and cost.comm_bytes:
        if hw.link_bandwidth is None:
            raise ValueError(f"{hw.name} has no published link bandwidth for tensor parallelism")
        t += 2 * (tp - 1) / tp * cost.comm_bytes / hw.link_bandwidth  # ring all-reduce
    return t + cost.pairs * eff.pair_s + cost.rows * eff.row_s + eff.overhead_s
