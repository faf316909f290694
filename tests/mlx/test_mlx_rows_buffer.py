"""The MLX strategy batch keeps each layer's keys and values in buffers and writes only what a
step changed (what each row's cache says it wrote: an appending row's new tokens, the slot a ring
overwrote, the tokens KIVI's store took), one scatter per buffer when every row changed one slot:
the logits are those of the batch that copies every row afresh each step, bit for bit, through
the buffers' growth past a step of 256 slots, rings wrapping and cutting a long prompt, KIVI
flushing, a quantized cache converting at ``start``, and after the batch passes its byte limit
and drops them mid-run."""

from __future__ import annotations

import tempfile

import mlx.core as mx
import mlx.utils
import numpy as np
import pytest

from cachelib.decode import Runner
from cachelib.mlx.rows import make_rows_cache
from cachelib.profile.backends import probe_for
from cachelib.spec import parse_spec

STRATEGIES = [
    "standard",
    "concat",
    "static:max_len=300",
    "rotating:max_size=12,keep=2",
    "quantized:bits=8,group_size=32",
    "quantized:bits=4,group_size=32",
    "quantized:bits=4,group_size=32,start=20",
    "kivi:bits=4,group_size=32,residual=4",
]
# rows that take the other paths: a quantized ring, a ring without sinks, KIVI flushing every step
MORE = [
    "rotating:max_size=10,keep=1,bits=4,group_size=32",
    "rotating:max_size=7,keep=0",
    "kivi:bits=8,group_size=32,residual=1",
]


def _decode(loaded, buffer_bytes: int, prompt: list[int], steps: int, strategies=STRATEGIES):
    runner, probe = Runner(loaded), probe_for(loaded)
    caches = [probe.make_cache(parse_spec(s)) for s in strategies]
    rows = make_rows_cache(caches, buffer_bytes=buffer_bytes)
    out, feed = [], prompt
    for _ in range(steps):
        logits = runner.step_rows(rows, [feed] * len(strategies))
        out.append(logits)
        feed = [int(np.argmax(logits[0]))]
    return np.stack(out), rows


@pytest.fixture(scope="module")
def tiny(load_model):
    return load_model("tiny-llama", "mlx")


def test_buffered_batch_gives_the_logits_of_a_batch_copied_afresh_every_step(tiny):
    prompt = [int(i) for i in np.random.default_rng(1).integers(1, 100, 250)]  # the buffers grow at 256
    copied, rows = _decode(tiny, 0, prompt, 12)
    assert rows[0]._buffers == [None, None]
    buffered, rows = _decode(tiny, 1 << 30, prompt, 12)
    assert rows[0]._buffers[0] is not None and rows[0]._buffers[0].shape[2] == 512
    assert np.array_equal(buffered, copied)


def test_a_short_prompt_and_a_long_decode_give_the_logits_of_a_batch_copied_afresh(tiny):
    prompt = [int(i) for i in np.random.default_rng(3).integers(1, 100, 5)]
    copied, _ = _decode(tiny, 0, prompt, 40, STRATEGIES + MORE)
    buffered, rows = _decode(tiny, 1 << 30, prompt, 40, STRATEGIES + MORE)
    assert rows[0]._buffers[0] is not None
    assert np.array_equal(buffered, copied)


def test_every_row_cache_is_evaluated_with_each_forward(tiny):
    # a row whose new token the batch writes from its input is read by nothing the logits need:
    # unless the forward evaluates the rows' states too, their updates pile up unevaluated
    prompt = [int(i) for i in np.random.default_rng(4).integers(1, 100, 5)]
    _, rows = _decode(tiny, 1 << 30, prompt, 6, STRATEGIES + MORE)
    with tempfile.NamedTemporaryFile("w+", suffix=".dot") as f:
        for layer in rows:
            for cache in layer.rows:
                arrays = [x for _, x in mlx.utils.tree_flatten(cache.state) if isinstance(x, mx.array)]
                mx.export_to_dot(f.name, *arrays)
                pending = open(f.name).read().count("shape=rectangle")
                assert pending == 0, f"{type(cache).__name__}: {pending} operations of its state left unevaluated"


def test_a_batch_past_its_buffer_limit_drops_the_buffers_and_gives_the_same_logits(tiny):
    prompt = [int(i) for i in np.random.default_rng(2).integers(1, 100, 250)]
    copied, _ = _decode(tiny, 0, prompt, 12)
    # room for every layer's 256-slot buffers, not for their growth to 512 slots at token 257
    layers, kv_heads, head_dim = len(tiny.model.layers), tiny.model.args.num_key_value_heads, tiny.model.args.head_dim
    one_step = 2 * len(STRATEGIES) * kv_heads * 256 * head_dim * 4 * layers
    dropped, rows = _decode(tiny, one_step, prompt, 12)
    assert rows[0]._expected.unbuffered and all(r._buffers == [None, None] for r in rows)
    assert rows[0]._expected.buffered == 0
    assert np.array_equal(dropped, copied)


def test_a_negative_buffer_limit_is_refused(tiny):
    probe = probe_for(tiny)
    caches = [probe.make_cache(parse_spec("standard")) for _ in range(2)]
    with pytest.raises(ValueError, match="buffer_bytes must be an integer >= 0"):
        make_rows_cache(caches, buffer_bytes=-1)


def _default_limit(tiny, monkeypatch, available: int):
    """A 250-token prompt decoded 12 steps by a batch of the default limit, its floor set to hold
    the layers' 256-slot buffers but not their growth to 512 slots, ``available`` bytes free.
    Returns (logits, rows, how often the free memory was read, the logits copied afresh, the floor)."""
    from cachelib.core import memory

    prompt = [int(i) for i in np.random.default_rng(2).integers(1, 100, 250)]
    copied, _ = _decode(tiny, 0, prompt, 12)
    layers, kv_heads, head_dim = len(tiny.model.layers), tiny.model.args.num_key_value_heads, tiny.model.args.head_dim
    floor = 2 * len(STRATEGIES) * kv_heads * 256 * head_dim * 4 * layers
    reads = []
    monkeypatch.setattr(memory, "BATCH_BUFFER_FLOOR", floor)
    monkeypatch.setattr(memory, "available_memory", lambda device: reads.append(device) or available)
    logits, rows = _decode(tiny, None, prompt, 12)
    return logits, rows, len(reads), copied, floor


def test_the_default_limit_reads_the_free_memory_once_past_its_floor_and_keeps_the_buffers(tiny, monkeypatch):
    logits, rows, reads, copied, floor = _default_limit(tiny, monkeypatch, available=1 << 40)
    assert reads == 1 and rows[0]._expected.buffer_limit == 1 << 38  # a quarter of what was free
    assert rows[0]._buffers[0].shape[2] == 512 and rows[0]._expected.buffered == 2 * floor
    assert np.array_equal(logits, copied)


def test_the_default_limit_with_little_free_memory_is_its_floor_and_drops_the_buffers(tiny, monkeypatch):
    logits, rows, reads, copied, floor = _default_limit(tiny, monkeypatch, available=0)
    assert reads == 1 and rows[0]._expected.buffer_limit == floor and rows[0]._expected.unbuffered
    assert all(r._buffers == [None, None] for r in rows) and rows[0]._expected.buffered == 0
    assert np.array_equal(logits, copied)
