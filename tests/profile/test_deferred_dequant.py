"""The quantization-error probe of torch layers makes the reconstruction of an update's new
tokens only when the error is read (``base.Dequantized``), dequantizing those of one quantizer
and shape together: the figures are bit for bit those of the reconstruction made at update time,
one layer at a time (the computation before the deferral)."""

from __future__ import annotations

import pytest
import torch

from cachelib.torch.base import Dequantized, QuantErrorProbe, dequantized, resolve_errors
from cachelib.torch.mlx_style import QuantizedKVCacheLayer
from cachelib.torch.quantized import QuantizedLayer
from cachelib.torch.quantizer import LOOKUP_BYTES, Quantizer
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
    """The layers' reconstructions made at update time, as before the deferral."""
    import cachelib.torch.base as base

    monkeypatch.setattr(base.QuantErrorProbe, "_record_error", _eager_record)


_deferring_record = QuantErrorProbe._record_error


def _eager_record(self, pairs):
    pairs = [tuple(t.quantizer.dequantize(t.packed) if isinstance(t, Dequantized) else t for t in p) for p in pairs]
    return _deferring_record(self, pairs)


@pytest.mark.parametrize(
    "make",
    [
        lambda: QuantizedKVCacheLayer(group_size=32, bits=4),
        lambda: QuantizedKVCacheLayer(group_size=64, bits=8, start=10),
        lambda: QuantizedLayer(nbits=4, q_group_size=32, residual_length=3),
        lambda: RotatingKVCacheLayer(max_size=6, keep=2, bits=4, group_size=32),
    ],
)
def test_layers_record_the_same_errors_as_with_the_reconstruction_made_at_update(make, monkeypatch):
    deferred = _run(make(), 9, seed=11)
    _eager(monkeypatch)
    eager = _run(make(), 9, seed=11)
    assert any(e is not None for e in eager)
    assert deferred == eager
