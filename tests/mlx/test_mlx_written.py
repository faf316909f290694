"""Each cache's ``written`` says what its last update changed in the keys/values it handed back:
every slot outside ``[start, end)`` holds what the update before handed back there, and a
``verbatim`` write holds the update's input as given. The strategy batch copies only those slots
into its buffers, so a wrong claim would put stale keys under the attention of a batched row."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cachelib.mlx import (
    ConcatenateKVCache,
    KIVICache,
    KVCache,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
    RotatingKVCache,
    StaticKVCache,
)
from cachelib.mlx.formats import FormatKVCache
from cachelib.mlx.quantized import dequantize

CACHES = {
    "standard": lambda: KVCache(),
    "concat": lambda: ConcatenateKVCache(),
    "static": lambda: StaticKVCache(max_len=200),
    "ring keep 2": lambda: RotatingKVCache(max_size=12, keep=2),
    "ring keep 0": lambda: RotatingKVCache(max_size=9),
    "quantized 8": lambda: QuantizedKVCache(group_size=32, bits=8),
    "quantized 4, start 20": lambda: QuantizedKVCache(group_size=32, bits=4, start=20),
    "quantized mixed widths": lambda: QuantizedKVCache(group_size=32, key_bits=8, value_bits=4),
    "quantized ring": lambda: QuantizedRotatingKVCache(max_size=10, keep=1, group_size=32, bits=4),
    "kivi": lambda: KIVICache(residual=4, group_size=32, bits=4),
    "kivi residual 1": lambda: KIVICache(residual=1, group_size=32, bits=8),
    "format fp8": lambda: FormatKVCache("fp8"),
    "format q4_0": lambda: FormatKVCache("q4_0"),
}
# update sizes: a prompt, single tokens (rings wrap, KIVI flushes, buffers grow), a block, more tokens
UPDATES = [7] + [1] * 20 + [3] + [1] * 15


def _float(x, cache) -> np.ndarray:
    if isinstance(x, (list, tuple)):
        x = dequantize(x, cache.group_size, cache.key_bits)
    return np.array(x)


@pytest.mark.parametrize("name", list(CACHES))
def test_slots_outside_what_an_update_says_it_wrote_are_unchanged(name, kv):
    cache = CACHES[name]()
    rng = np.random.default_rng(3)
    before, claims, verbatim = None, 0, 0
    for n in UPDATES:
        k, v = kv(rng, 1, 2, n, 64)
        out = _float(cache.update_and_fetch(k, v)[0], cache)
        w = cache.written
        if w is not None and before is not None:
            claims += 1
            assert 0 <= w.start <= w.end <= out.shape[2], f"{name}: {w} outside {out.shape[2]} slots"
            kept = [j for j in range(min(out.shape[2], before.shape[2])) if not w.start <= j < w.end]
            assert np.array_equal(out[:, :, kept], before[:, :, kept]), f"{name}: a slot outside {w} changed"
            assert w.end >= out.shape[2] or out.shape[2] <= before.shape[2], f"{name}: new slots past {w}"
            if w.verbatim:
                verbatim += 1
                assert np.array_equal(out[:, :, w.start : w.end], np.array(k)), f"{name}: {w} is not the input"
        before = out
    assert claims > len(UPDATES) // 2, f"{name}: only {claims} updates said what they wrote"
    quantizing = name.startswith(("quantized", "kivi", "format"))
    assert verbatim > 0 or quantizing, f"{name}: no update was a verbatim write"


def test_an_update_that_reorders_a_ring_claims_nothing(kv):
    cache = RotatingKVCache(max_size=6, keep=1)
    rng = np.random.default_rng(4)
    cache.update_and_fetch(*kv(rng, 1, 2, 10, 8))  # a block longer than the ring
    assert cache.written is None
    cache.update_and_fetch(*kv(rng, 1, 2, 1, 8))  # cuts the block down to max_size
    assert cache.written is None
    cache.update_and_fetch(*kv(rng, 1, 2, 1, 8))
    assert cache.written is not None and cache.written.end - cache.written.start == 1


def test_a_trimmed_kivi_cache_claims_nothing_for_its_next_update(kv):
    cache = KIVICache(residual=4, group_size=32, bits=4)
    rng = np.random.default_rng(5)
    for n in (8, 1, 1):
        cache.update_and_fetch(*kv(rng, 1, 2, n, 64))
    cache.trim(1)
    cache.update_and_fetch(*kv(rng, 1, 2, 1, 64))
    assert cache.written is None
    mx.eval(cache.state)
