"""The profiler reads the quantization error of a decode step's quantizing layers together
(stacked by size, one host read): each layer's figure equals what it reads alone, by the formula
of ``quant_error_of``, and a large update's (a prefill chunk) is computed at once."""

from __future__ import annotations

import pytest
import torch

from cachelib.torch.base import Decoded, resolve_errors
from cachelib.torch.mlx_style import QuantizedKVCacheLayer
from cachelib.torch.quantized import QuantizedLayer
from cachelib.torch.quantizer import quant_error_of
from cachelib.torch.rotating import RotatingKVCacheLayer


def _layers():
    return [
        QuantizedKVCacheLayer(group_size=32, bits=4),
        QuantizedKVCacheLayer(group_size=64, bits=8),
        QuantizedLayer(nbits=2, q_group_size=32, residual_length=1),
    ]


def _feed(layers, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    fed = []
    for layer in layers:
        layer.track_error = True
        k, v = torch.randn(1, 2, tokens, 64, generator=g) * 3, torch.randn(1, 2, tokens, 64, generator=g)
        layer.update(k, v)
        fed.append((k, v))
    return fed


def test_errors_read_together_equal_each_read_alone():
    together, alone = _layers(), _layers()
    for layers in (together, alone):
        _feed(layers, 9, seed=0)  # the prompt
        _feed(layers, 1, seed=1)  # a decode step: its error waits to be read
    assert all(layer._pending_error is not None for layer in together)
    resolve_errors(together + [object()])  # a layer without a pending error is skipped
    for a, b in zip(together, alone):
        assert a._pending_error is None
        ea, eb = a.quant_error, b.quant_error  # b computes its own, alone
        for x, y in zip(
            (ea.key_rel_rms, ea.key_max_abs, ea.value_rel_rms, ea.value_max_abs),
            (eb.key_rel_rms, eb.key_max_abs, eb.value_rel_rms, eb.value_max_abs),
        ):
            assert x == pytest.approx(y, rel=1e-12, abs=1e-15)
            assert x > 0


def test_the_figure_is_quant_error_of_the_update():
    layer = QuantizedKVCacheLayer(group_size=32, bits=4)
    layer.track_error = True
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 2, 5, 64, generator=g), torch.randn(1, 2, 5, 64, generator=g)
    k_out, v_out = layer.update(k, v)
    err = layer.quant_error
    from cachelib.torch.quantizer import Quantizer

    q = Quantizer(bits=4, group_size=32)
    assert (err.key_rel_rms, err.key_max_abs) == pytest.approx(
        quant_error_of(k, q.dequantize(q.quantize(k))), rel=1e-12
    )
    assert (err.value_rel_rms, err.value_max_abs) == pytest.approx(
        quant_error_of(v, q.dequantize(q.quantize(v))), rel=1e-12
    )


def test_a_prefill_chunks_error_is_computed_at_once():
    layer = QuantizedKVCacheLayer(group_size=64, bits=8)
    _feed([layer], 1024, seed=4)  # 2 x 1024 x 64 elements, past the deferral threshold
    assert layer._pending_error is None and layer._last_error is not None


def _quantizing_layers():
    return [
        QuantizedKVCacheLayer(group_size=32, bits=4),
        QuantizedKVCacheLayer(group_size=64, bits=8),
        QuantizedKVCacheLayer(group_size=32, key_bits=8, value_bits=4),  # keys and values apart
        QuantizedKVCacheLayer(group_size=32, bits=4, start=8),  # converts its held tokens at step 4
        RotatingKVCacheLayer(8, keep=2, bits=4, group_size=32),
        RotatingKVCacheLayer(8, keep=0, key_bits=4, value_bits=8, group_size=32),
    ]


def _errors(layer):
    e = layer.quant_error  # None: the update quantized nothing (before start)
    return None if e is None else (e.key_rel_rms, e.key_max_abs, e.value_rel_rms, e.value_max_abs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_batch_steps_reconstruction_gives_the_errors_of_the_codes_bit_for_bit(dtype):
    """A strategy batch's ``update_changed`` decodes each step's new slots; the pending error takes
    those as its reconstruction (no second dequantization), and every layer, whatever its bits,
    then resolves in one group: the figures equal, bit for bit, those of ``update`` (the codes
    dequantized by the probe), step after step, the ring past its wrap included."""
    batch, plain = _quantizing_layers(), _quantizing_layers()
    g = torch.Generator().manual_seed(7)
    held = [0] * len(batch)
    for step in range(14):
        n = 5 if step == 0 else 1
        inputs = [
            ((torch.randn(1, 2, n, 64, generator=g) * 3).to(dtype), torch.randn(1, 2, n, 64, generator=g).to(dtype))
            for _ in batch
        ]
        for i, (a, b, (k, v)) in enumerate(zip(batch, plain, inputs)):
            a.track_error = b.track_error = True
            start, _, _, length = a.update_changed(k, v, held[i], 10**6)
            held[i] = length
            b.update(k, v)
        if step:  # a decode step: every batch layer's reconstruction is the decoded slot, not the codes
            # the layer with start=8 holds its first tokens at full precision (nothing to measure)
            # and converts them all at step 4 (that error covers every held token: computed as before)
            assert [isinstance(a._pending_error, Decoded) for a in batch] == [
                not getattr(a, "start", 0) or step > 4 for a in batch
            ]
            resolve_errors(batch)  # one group: every layer's keys and values, of every configuration
        assert [_errors(a) for a in batch] == [_errors(b) for b in plain]
