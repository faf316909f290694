"""The torch strategy batch keeps each layer's keys and values in buffers and writes only what a
step changed (what each row's layer says it wrote: an appending row's new tokens, the slot a ring
overwrote, a quantized row's new tokens dequantized alone, the tokens KIVI's store took at a
flush); a row that moved everything (an eviction, a ring put back in order, a quantized cache
converting at ``start``) is copied whole. The logits are those of the batch that copies every row
whole each step (``buffer_bytes=0``, the path before the buffers), bit for bit, every step:
through the buffers' growth past 256 slots, rings wrapping, KIVI flushing, a quantized start,
knorm evicting, and after the batch passes its byte limit mid-run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cachelib.decode import Runner
from cachelib.profile.backends import probe_for
from cachelib.spec import parse_spec
from cachelib.torch.formats import FormatKVCacheLayer
from cachelib.torch.layers import DynamicLayer
from cachelib.torch.mlx_style import ChunkedKVCacheLayer, KVCacheLayer, QuantizedKVCacheLayer
from cachelib.torch.quantized import QuantizedLayer
from cachelib.torch.rotating import RotatingKVCacheLayer
from cachelib.torch.rows import RowsCache
from cachelib.torch.static import StaticLayer

STRATEGIES = [
    "standard",
    "rotating:max_size=12,keep=2",  # wraps at step 10 of a 3-token prompt
    "quantized:bits=8,group_size=32",
    "quantized:bits=4,group_size=32,start=8",  # converts every held token at the 9th
    "kivi:bits=4,group_size=32,residual=4",  # flushes every 4 tokens
    "knorm:budget=10",  # evicts past 10 held tokens
]
# rows that take the other paths: a quantized ring, a static row (slots past the queries hidden),
# a format row, KIVI flushing every step, a concatenating row
MORE = [
    "rotating:max_size=10,keep=1,bits=4,group_size=32",
    "static:max_len=300",
    "q4_0",
    "kivi:bits=8,group_size=32,residual=1",
    "concat",
]


def _decode(loaded, buffer_bytes: int, prompt: list[int], steps: int, strategies=STRATEGIES):
    runner, probe = Runner(loaded), probe_for(loaded)
    caches = [probe.make_cache(parse_spec(s)) for s in strategies]
    rows = RowsCache(caches, loaded.model.config.get_text_config(decoder=True), buffer_bytes=buffer_bytes)
    out, feed = [], prompt
    for _ in range(steps):
        logits = runner.step_rows(rows, [feed] * len(strategies))
        out.append(logits)
        feed = [int(np.argmax(logits[0]))]
    return np.stack(out), rows


@pytest.fixture(scope="module")
def tiny(load_model):
    return load_model("tiny-llama", "torch")


def test_buffered_batch_gives_the_logits_of_a_batch_copied_whole_every_step(tiny):
    prompt = [int(i) for i in np.random.default_rng(3).integers(1, 100, 3)]
    copied, rows = _decode(tiny, 0, prompt, 24)
    assert rows._layers == {} and rows._buffers[0] is not None
    buffered, rows = _decode(tiny, 1 << 30, prompt, 24)
    assert rows._buffers == [None, None] and rows._layers[0].keys.shape[2] == 256
    for step, (a, b) in enumerate(zip(buffered, copied)):
        assert np.array_equal(a, b), f"step {step}: rows {np.flatnonzero((a != b).any(axis=1)).tolist()} differ"


def test_the_other_rows_and_growth_past_256_slots_give_the_same_logits(tiny):
    prompt = [int(i) for i in np.random.default_rng(1).integers(1, 100, 250)]
    copied, _ = _decode(tiny, 0, prompt, 10, STRATEGIES + MORE)
    buffered, rows = _decode(tiny, 1 << 30, prompt, 10, STRATEGIES + MORE)
    assert rows._layers[0].keys.shape[2] == 512
    assert np.array_equal(buffered, copied)


def test_the_rows_own_caches_are_what_they_are_alone(tiny):
    # the batch changes what comes back, never what a row holds: a KIVI row's store and residual
    # after the buffered batch equal those after the batch that copies whole
    kivi = "kivi:bits=4,group_size=32,residual=4"
    prompt = [int(i) for i in np.random.default_rng(5).integers(1, 100, 3)]
    _, rows = _decode(tiny, 1 << 30, prompt, 9, [kivi, "standard"])
    _, copied = _decode(tiny, 0, prompt, 9, [kivi, "standard"])
    for a, b in zip(rows.rows[0].layers, copied.rows[0].layers):
        assert a.quantized_keys[0].shape[-2] == 11  # the 3-token prompt, then two flushes of 4
        assert all(torch.equal(x, y) for x, y in zip(a.quantized_keys, b.quantized_keys))
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_batch_past_its_buffer_limit_drops_the_buffers_and_gives_the_same_logits(tiny):
    prompt = [int(i) for i in np.random.default_rng(2).integers(1, 100, 250)]
    copied, _ = _decode(tiny, 0, prompt, 10)
    config = tiny.model.config
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    # room for every layer's 256-slot buffers, not for their growth to 512 slots at token 257
    one_step = 2 * len(STRATEGIES) * heads * 256 * dim * 4 * config.num_hidden_layers
    dropped, rows = _decode(tiny, one_step, prompt, 10)
    assert rows.buffer_limit == 0 and rows._layers == {} and rows._buffered == 0
    assert np.array_equal(dropped, copied)


def test_a_negative_buffer_limit_is_refused(tiny):
    probe = probe_for(tiny)
    caches = [probe.make_cache(parse_spec("standard")) for _ in range(2)]
    with pytest.raises(ValueError, match="buffer_bytes must be an integer >= 0"):
        RowsCache(caches, buffer_bytes=-1)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_table_unpack_of_a_few_tokens_gives_the_values_of_the_shifts(bits, dtype):
    from cachelib.torch import quantizer

    q = quantizer.Quantizer(bits, 32)
    codes, _, _ = q.quantize(torch.randn(1, 3, 40, 64, generator=torch.Generator().manual_seed(bits)))
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(1, 1, -1, 64 * bits // 8)
    for packed in (codes[..., :1, :], codes[..., 7:9, :], every_byte):
        assert packed.numel() <= quantizer.LOOKUP_BYTES
        looked_up = q._unpack(packed, dtype)
        limit, quantizer.LOOKUP_BYTES = quantizer.LOOKUP_BYTES, -1  # the shifts, for reference
        try:
            shifted = q._unpack(packed, dtype)
        finally:
            quantizer.LOOKUP_BYTES = limit
        assert looked_up.dtype == dtype and torch.equal(looked_up, shifted)


LAYERS = {
    "standard": lambda: KVCacheLayer(),
    "concat": lambda: DynamicLayer(),
    "static": lambda: StaticLayer(max_cache_len=200),
    "ring keep 2": lambda: RotatingKVCacheLayer(max_size=12, keep=2),
    "ring keep 0": lambda: RotatingKVCacheLayer(max_size=9),
    "quantized ring": lambda: RotatingKVCacheLayer(max_size=10, keep=1, bits=4, group_size=32),
    "quantized 8": lambda: QuantizedKVCacheLayer(group_size=32, bits=8),
    "quantized 4, start 20": lambda: QuantizedKVCacheLayer(group_size=32, bits=4, start=20),
    "quantized mixed widths": lambda: QuantizedKVCacheLayer(group_size=32, key_bits=8, value_bits=2),
    "kivi": lambda: QuantizedLayer(nbits=4, q_group_size=32, residual_length=4),
    "kivi residual 1": lambda: QuantizedLayer(nbits=8, q_group_size=32, residual_length=1),
    "format q4_0": lambda: FormatKVCacheLayer("q4_0"),
    "chunked": lambda: ChunkedKVCacheLayer(chunk_size=30),  # trims from the 24th update on,
}
# update sizes: a prompt, single tokens (rings wrap, KIVI flushes, storage grows), a block, more
UPDATES = [7] + [1] * 20 + [3] + [1] * 15


@pytest.mark.parametrize("name", list(LAYERS))
def test_written_claims_hold_and_the_changed_slots_rebuild_what_update_returns(name):
    # a layer driven by update and its twin driven by update_changed, fed the same keys: every
    # slot outside `written` is what the update before returned, and the twin's changed slots
    # laid over its copy of the last return give exactly what update returned
    layer, twin = LAYERS[name](), LAYERS[name]()
    gen = torch.Generator().manual_seed(3)
    before, held, claims = None, None, 0
    for n in UPDATES:
        k, v = torch.randn(1, 2, n, 64, generator=gen), torch.randn(1, 2, n, 64, generator=gen)
        out, _ = layer.update(k, v)
        w = layer.written
        if w is not None and before is not None:
            claims += 1
            kept = [j for j in range(min(out.shape[2], before.shape[2])) if not w.start <= j < w.end]
            assert torch.equal(out[:, :, kept], before[:, :, kept]), f"{name}: a slot outside {w} changed"
            if w.verbatim:
                assert torch.equal(out[:, :, w.start : w.end], k), f"{name}: {w} is not the input"
        start, part, _, length = twin.update_changed(k, v, 0 if held is None else held.shape[2], out.shape[2])
        assert length == out.shape[2]
        rebuilt = torch.zeros_like(out)
        if held is not None:
            rebuilt[:, :, : min(length, held.shape[2])] = held[:, :, :length]
        rebuilt[:, :, start : start + part.shape[2]] = part
        assert torch.equal(rebuilt, out), f"{name}: the changed slots [{start}, +{part.shape[2]}) miss a change"
        before, held = out.clone(), rebuilt
    assert claims > len(UPDATES) // 2, f"{name}: only {claims} updates said what they wrote"


def _buffers_at_256_slots(tiny) -> int:
    """Bytes of every layer's key/value buffers at 256 slots for the rows of STRATEGIES."""
    config = tiny.model.config
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    return 2 * len(STRATEGIES) * heads * 256 * dim * 4 * config.num_hidden_layers


def _default_limit(tiny, monkeypatch, available: int):
    """A 250-token prompt decoded 10 steps by a batch of the default limit, its floor set to hold
    the layers' 256-slot buffers but not their growth to 512 slots, ``available`` bytes free.
    Returns (logits, rows, the devices whose free memory was read, the logits copied whole)."""
    from cachelib.core import memory

    prompt = [int(i) for i in np.random.default_rng(2).integers(1, 100, 250)]
    copied, _ = _decode(tiny, 0, prompt, 10)
    reads = []
    monkeypatch.setattr(memory, "BATCH_BUFFER_FLOOR", _buffers_at_256_slots(tiny))
    monkeypatch.setattr(memory, "available_memory", lambda device: reads.append(device) or available)
    logits, rows = _decode(tiny, None, prompt, 10)
    return logits, rows, reads, copied


def test_the_default_limit_reads_the_free_memory_once_past_its_floor_and_keeps_the_buffers(tiny, monkeypatch):
    floor = _buffers_at_256_slots(tiny)
    logits, rows, reads, copied = _default_limit(tiny, monkeypatch, available=16 * floor)
    assert reads == ["cpu"]  # once, when the growth to 512 slots passed the floor
    assert rows.buffer_limit == 4 * floor  # a quarter of what was free
    assert rows._layers[0].keys.shape[2] == 512 and rows._buffered == 2 * floor
    assert np.array_equal(logits, copied)


def test_the_default_limit_with_little_free_memory_is_its_floor_and_drops_the_buffers(tiny, monkeypatch):
    logits, rows, reads, copied = _default_limit(tiny, monkeypatch, available=0)
    assert reads == ["cpu"] and rows.buffer_limit == 0 and rows._layers == {} and rows._buffered == 0
    assert np.array_equal(logits, copied)


def test_a_batch_within_the_floor_never_reads_the_free_memory(tiny, monkeypatch):
    from cachelib.core import memory

    monkeypatch.setattr(memory, "available_memory", lambda device: pytest.fail("read the free memory"))
    _, rows = _decode(tiny, None, [1, 2, 3], 4)
    assert rows.buffer_limit is None and rows._layers[0].keys.shape[2] == 256
