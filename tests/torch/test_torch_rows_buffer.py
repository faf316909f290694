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
from cachelib.torch.rows import RowsCache

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
