"""The quantization-error probe of torch layers makes the reconstruction of an update's new
tokens only when the error is read (``base.Dequantized``), dequantizing those of one quantizer
configuration and shape together, and keeps the keys and values a layer quantized in one pass
stacked as they were (``_record_stacked``): the figures are bit for bit those of the
reconstruction made at update time, one layer and one of keys or values at a time (the
computation before the deferral)."""

from __future__ import annotations

import pytest
import torch

from cachelib.torch.base import Dequantized, QuantErrorProbe, dequantized, resolve_errors
from cachelib.torch.mlx_style import QuantizedKVCacheLayer
from cachelib.torch.quantized import QuantizedLayer
from cachelib.torch.quantizer import LOOKUP_BYTES, Quantizer, quant_error_of
from cachelib.torch.rotating import RotatingKVCacheLayer
from cachelib.torch.storage import DENSE, QuantizedCodec


class _Probe(QuantErrorProbe):
    track_error = True


def _record(quantizer, x, v, deferred: bool) -> _Probe:
    layer = _Probe()
    qk, qv = quantizer.quantize(x), quantizer.quantize(v)
    if deferred:
        layer._record_error([(x, Dequantized(quantizer, qk), v, Dequantized(quantizer, qv))])
    else:  # the reconstruction made now, as every layer did before
        layer._record_error([(x, quantizer.dequantize(qk), v, quantizer.dequantize(qv))])
    return layer


@pytest.mark.parametrize("bits,group_size", [(2, 32), (4, 64), (8, 64), (4, 32)])
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deferred_reconstructions_give_the_same_errors_bit_for_bit(bits, group_size, tokens, dtype):
    g = torch.Generator().manual_seed(bits * 100 + tokens)
    quantizer = Quantizer(bits, group_size)
    layers = 60  # stacked, keys and values together, their codes pass the unpack's lookup size (another path)
    inputs = [
        (
            (torch.randn(1, 3, tokens, 64, generator=g) * 4).to(dtype),
            torch.randn(1, 3, tokens, 64, generator=g).to(dtype),
        )
        for _ in range(layers)
    ]
    assert 2 * layers * 3 * tokens * 64 * bits // 8 > LOOKUP_BYTES
    now = [_record(quantizer, x, v, False) for x, v in inputs]
    later = [_record(quantizer, x, v, True) for x, v in inputs]
    resolve_errors(now)
    resolve_errors(later)
    for a, b in zip(now, later):
        assert a._last_error == b._last_error  # every float equal
    one = _record(quantizer, *inputs[0], True)  # alone: dequantized by itself
    assert one.quant_error == now[0]._last_error


def test_the_reconstructions_of_different_quantizers_and_shapes_are_kept_apart():
    g = torch.Generator().manual_seed(7)
    cases = [(Quantizer(4, 32), 1), (Quantizer(8, 64), 1), (Quantizer(4, 32), 2), (Quantizer(4, 64), 1)]
    inputs = [(q, torch.randn(1, 2, n, 64, generator=g), torch.randn(1, 2, n, 64, generator=g)) for q, n in cases]
    now = [_record(q, x, v, False) for q, x, v in inputs]
    later = [_record(q, x, v, True) for q, x, v in inputs]
    resolve_errors(now + later)
    for a, b in zip(now, later):
        assert a._last_error == b._last_error


def test_dequantized_defers_only_a_quantizers_codes():
    q = QuantizedCodec(4, 32)
    x = torch.randn(1, 1, 1, 64)
    stored = q.encode(x)
    assert isinstance(dequantized(q, stored), Dequantized)
    assert torch.equal(dequantized(q, stored).quantizer.dequantize(stored), q.dense(stored))
    assert dequantized(DENSE, x) is x  # full precision: nothing to make


def _run(layer, steps: int, seed: int) -> list:
    """Every step's error of ``layer`` fed ``steps`` single tokens after a prompt."""
    g = torch.Generator().manual_seed(seed)
    layer.track_error = True
    out = []
    for n in [7] + [1] * steps:
        layer.update(torch.randn(1, 2, n, 64, generator=g), torch.randn(1, 2, n, 64, generator=g))
        out.append(layer.quant_error)
    return out


def _eager(monkeypatch):
    """The layers' reconstructions made at update time, keys apart from values, as before the
    deferral and the stacking."""
    import cachelib.torch.base as base

    monkeypatch.setattr(base.QuantErrorProbe, "_record_error", _eager_record)
    monkeypatch.setattr(base.QuantErrorProbe, "_record_stacked", _eager_stacked)


_deferring_record = QuantErrorProbe._record_error


def _dense(t):
    return t.quantizer.dequantize(t.packed) if isinstance(t, Dequantized) else t


def _eager_record(self, pairs):
    return _deferring_record(self, [tuple(_dense(t) for t in p) for p in pairs])


def _eager_stacked(self, x, x_hat):
    x_hat = _dense(x_hat)
    return _deferring_record(self, [(x[0], x_hat[0], x[1], x_hat[1])])


@pytest.mark.parametrize(
    "make",
    [
        lambda: QuantizedKVCacheLayer(group_size=32, bits=4),
        lambda: QuantizedKVCacheLayer(group_size=64, bits=8, start=10),
        lambda: QuantizedKVCacheLayer(group_size=32, bits=4, key_bits=8),  # keys and values apart
        lambda: QuantizedLayer(nbits=4, q_group_size=32, residual_length=3),
        lambda: RotatingKVCacheLayer(max_size=6, keep=2, bits=4, group_size=32),
    ],
)
@pytest.mark.parametrize("together", [False, True])
def test_layers_record_the_same_errors_as_with_the_reconstruction_made_at_update(make, together, monkeypatch):
    """Each layer's figures, read one step at a time (alone) or resolved for several layers of
    different configurations in one call (together), equal the reconstruction made at update
    time, keys apart from values, bit for bit."""
    run = _run_together if together else _run
    deferred = run(make(), 9, seed=11)
    _eager(monkeypatch)
    eager = _run(make(), 9, seed=11)
    assert sum(e is not None and e.key_rel_rms > 0 for e in eager) >= 3
    assert deferred == eager


def _run_together(layer, steps: int, seed: int) -> list:
    """As :func:`_run`, with the layer's error resolved at each step in one call with the errors
    of layers of other configurations and shapes (mlx-style 4- and 8-bit, a KIVI flush)."""
    g = torch.Generator().manual_seed(seed)
    others = [QuantizedKVCacheLayer(64, 4), QuantizedKVCacheLayer(64, 8), QuantizedLayer(2, 32, residual_length=1)]
    h = torch.Generator().manual_seed(seed + 1)
    for other in others:
        other.track_error = True
    layer.track_error = True
    out = []
    for n in [7] + [1] * steps:
        layer.update(torch.randn(1, 2, n, 64, generator=g), torch.randn(1, 2, n, 64, generator=g))
        for other in others:
            other.update(torch.randn(1, 2, n, 64, generator=h), torch.randn(1, 2, n, 64, generator=h))
        resolve_errors([others[0], layer, *others[1:]])
        out.append(layer.quant_error)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_keys_and_values_give_the_errors_of_each_alone(dtype):
    """A stacked record (keys and values quantized in one pass) gives, in a call resolving many
    layers of several quantizers, shapes and kinds of record, the figures of its keys and its
    values reconstructed at once and read alone, bit for bit, and those of quant_error_of."""
    g = torch.Generator().manual_seed(5)
    cases = [(Quantizer(4, 64), 1), (Quantizer(8, 64), 1), (Quantizer(4, 32), 1), (Quantizer(4, 64), 4)] * 4
    stacked, apart, inputs = [], [], []
    for i, (q, n) in enumerate(cases):
        kv = (torch.randn(2, 1, 3, n, 64, generator=g) * (1 + i)).to(dtype)
        packed = q.quantize(kv)
        layer = _Probe()
        if i % 5 == 4:  # a reconstruction already made
            layer._record_stacked(kv, q.dequantize(packed))
        else:
            layer._record_stacked(kv, Dequantized(q, packed))
        stacked.append(layer)
        alone = _Probe()
        qk, qv = q.quantize(kv[0]), q.quantize(kv[1])
        alone._record_error([(kv[0], q.dequantize(qk), kv[1], q.dequantize(qv))])
        apart.append(alone)
        inputs.append((q, kv))
    resolve_errors([_Probe(), *stacked])  # a layer without a pending error is skipped
    for layer, alone, (q, kv) in zip(stacked, apart, inputs):
        assert layer._pending_error is None
        err = alone.quant_error  # resolved alone
        assert layer.quant_error == err
        k_hat, v_hat = q.dequantize(q.quantize(kv[0])), q.dequantize(q.quantize(kv[1]))
        expected = (*quant_error_of(kv[0], k_hat), *quant_error_of(kv[1], v_hat))
        got = (err.key_rel_rms, err.key_max_abs, err.value_rel_rms, err.value_max_abs)
        assert got == pytest.approx(expected, rel=1e-12, abs=1e-15) and min(got) > 0


def test_a_large_stacked_update_is_resolved_at_once():
    q = Quantizer(8, 64)
    kv = torch.randn(2, 1, 2, 600, 64)  # 76,800 key elements, past the deferral threshold
    layer = _Probe()
    layer._record_stacked(kv, Dequantized(q, q.quantize(kv)))
    assert layer._pending_error is None and layer._last_error.key_rel_rms > 0
    small = _Probe()
    small._record_stacked(kv[..., :1, :], Dequantized(q, q.quantize(kv[..., :1, :])))
    assert small._pending_error is not None


def test_the_cache_switch_reaches_layers_added_or_replaced_after_it_was_first_set():
    from cachelib.torch.cache import Cache

    cache = Cache(layers=[QuantizedKVCacheLayer(64, 4), QuantizedKVCacheLayer(64, 8)])
    cache.track_error = True
    assert all(layer.track_error for layer in cache.layers)
    cache.track_error = False
    cache.layers[1] = QuantizedLayer(4, 64)
    cache.layers.append(QuantizedKVCacheLayer(64, 4))
    cache.track_error = True
    assert [layer.track_error for layer in cache.layers] == [True, True, True]
    cache.track_error = False
    assert not any(layer.track_error for layer in cache.layers)
    cache.layers = [QuantizedKVCacheLayer(64, 4)]
    cache.track_error = True
    assert cache.layers[0].track_error
