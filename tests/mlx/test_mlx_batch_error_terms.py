"""In a buffered MLX strategy batch, a decode step's quantization error terms take the new slots
the batch dequantized for its buffers as their reconstruction (no second dequantization of the
same codes), and the terms of every width join one stacked graph: the figures are those of the
batch that copies every row afresh (which dequantizes the codes for the terms), bit for bit,
step after step, rings wrapping and mixed widths included."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cachelib.decode import Runner
from cachelib.mlx.quantized import QuantizingCache
from cachelib.mlx.rows import make_rows_cache
from cachelib.profile.backends import probe_for
from cachelib.spec import parse_spec

STRATEGIES = [
    "standard",
    "quantized:bits=8,group_size=32",
    "quantized:bits=4,group_size=32",
    "quantized:bits=4,group_size=32,key_bits=8,value_bits=4",
    "rotating:max_size=10,keep=1,bits=4,group_size=32",
    "rotating:max_size=10,keep=0,group_size=32,key_bits=4,value_bits=8",
    "kivi:bits=4,group_size=32,residual=4",
    "quantized:bits=4,group_size=32,start=9",  # full precision for steps 1-3, converts at step 4
]


def _errors(loaded, buffer_bytes: int, steps: int):
    runner, probe = Runner(loaded), probe_for(loaded)
    caches = [probe.make_cache(parse_spec(s)) for s in STRATEGIES]
    for cache in caches:
        probe.set_track_error(cache, True)
    rows = make_rows_cache(caches, buffer_bytes=buffer_bytes)
    feed = [int(i) for i in np.random.default_rng(5).integers(1, 100, 6)]
    out = []
    for _ in range(steps):
        logits = runner.step_rows(rows, [feed] * len(caches), extra=lambda: probe.pending(caches))
        views = probe.views_of(caches)
        out.append(
            [[None if v.quant_error is None else dataclasses.astuple(v.quant_error) for v in row] for row in views]
        )
        feed = [int(np.argmax(logits[0]))]
    return out


@pytest.fixture
def count_taken(monkeypatch):
    taken = []
    decoded = QuantizingCache._decoded

    def spy(self, *args):
        decoded(self, *args)
        taken.append(all(t.x_hat is not None for t in self._error) if type(self._error) is tuple else False)

    monkeypatch.setattr(QuantizingCache, "_decoded", spy)
    return taken


def test_a_buffered_batch_computes_the_error_of_the_slots_it_dequantized_bit_for_bit(load_model, count_taken):
    loaded = load_model("tiny-llama", "mlx")
    steps = 16  # the rings of 10 wrap
    copied = _errors(loaded, 0, steps)
    assert count_taken == []  # the batch that copies rows afresh dequantizes nothing for the terms
    buffered = _errors(loaded, 1 << 30, steps)
    layers = len(buffered[0][0])
    # every decode step, the five quantizing rows that hand back their codes (KIVI hands back
    # its residual's floats): their terms took the batch's dequantized slots; at the prompt, the
    # three appending ones (a ring puts its prompt in time order: every slot rewritten); the row
    # with start=9 from step 5 on (its conversion rewrote every slot)
    assert sum(count_taken) == layers * (5 * (steps - 1) + 3 + (steps - 5))
    assert buffered == copied
    errors = [e for step in buffered[1:] for row in step[1:6] for e in row]
    assert all(e is not None and e[0] > 0 and e[2] > 0 for e in errors)
