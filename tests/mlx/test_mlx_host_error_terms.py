"""The quantization-error figures of a decode step's one-token updates, read on the host in NumPy
on the CPU (``cachelib.core.quant_error``, MLX's ``_host_terms``) instead of joined by MLX (a copy
dispatched per joined array): the reconstruction is MLX's own bit for bit (and torch's, whose
bytes are the same), the figures are the float64 formula of ``cachelib.introspect.quant_error``,
and only what NumPy reads goes there."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from cachelib.core.quant_error import error_rows, host_readable, reconstructed
from cachelib.introspect import quant_error
from cachelib.mlx import quantized as q
from cachelib.mlx.probe import MLXProbe, _terms
from cachelib.mlx.quantized import QuantizedKVCache, Terms, error_terms, resolve_terms, stage_terms
from cachelib.torch.quantizer import Quantizer

WIDTHS = [(2, 32), (4, 64), (8, 64), (4, 128)]


@pytest.mark.parametrize("bits,group_size", WIDTHS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_reconstruction_is_each_backends_own_bit_for_bit(bits, group_size, dtype):
    x = (mx.random.normal((20, 3, 1, 128), key=mx.random.key(bits * group_size)) * 4).astype(getattr(mx, dtype))
    packed, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
    rows = 60
    got = reconstructed(
        np.array(packed).reshape(rows, -1).view(np.uint8),
        np.array(scales).reshape(rows, -1),
        np.array(biases).reshape(rows, -1),
        bits,
        group_size,
    )
    want = np.array(mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits)).reshape(rows, -1)
    assert got.dtype == want.dtype and np.array_equal(got, want)
    quantizer = Quantizer(bits, group_size)  # torch packs the same bytes: the same reconstruction
    codes, t_scales, t_biases = quantizer.quantize(torch.from_numpy(np.array(x)))
    got = reconstructed(*(t.numpy().reshape(rows, -1) for t in (codes, t_scales, t_biases)), bits, group_size)
    assert np.array_equal(got, quantizer.dequantize((codes, t_scales, t_biases)).numpy().reshape(rows, -1))


def test_the_figures_are_the_float64_formula_per_row():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 48)).astype(np.float32)
    x_hat = (x + rng.standard_normal((5, 48)).astype(np.float32) * 0.01).astype(np.float32)
    x_hat[2] = x[2]  # an exact row: no error
    rows = error_rows(x, x_hat)
    for row, a, b in zip(rows, x, x_hat):
        rel, worst = quant_error(a, b)
        assert np.sqrt(row[0]) / np.sqrt(row[1]) == pytest.approx(rel, rel=1e-14) and row[2] == worst
    assert rows[2, 0] == 0.0 and rows[2, 2] == 0.0
    assert error_rows(np.zeros((2, 0), np.float32), np.zeros((2, 0), np.float32)).tolist() == [[0.0] * 3] * 2


def _decoded(bits: int, group_size: int, layers: int, tokens: int = 1, dtype=mx.float32) -> list[Terms]:
    """The error terms of ``layers`` quantizing caches after a 5-token prefill and one update of
    ``tokens`` tokens, keys then values."""
    caches = [QuantizedKVCache(group_size=group_size, bits=bits) for _ in range(layers)]
    probe = MLXProbe(model=None)
    probe.set_track_error(caches, True)
    mx.random.seed(bits + layers)
    for n in (5, tokens):
        for c in caches:
            c.update_and_fetch(
                (mx.random.normal((1, 3, n, 128)) * 3).astype(dtype), mx.random.normal((1, 3, n, 128)).astype(dtype)
            )
    return _terms([caches])


@pytest.mark.parametrize("bits,group_size", WIDTHS)
def test_a_decode_steps_terms_are_read_on_the_host_and_equal_mlxs_own(bits, group_size):
    terms = _decoded(bits, group_size, layers=30)
    inputs = [(np.array(t.x), [np.array(p) for p in t.parts]) for t in terms]
    assert stage_terms(terms) == []  # nothing for MLX to join or compute: the host reads them
    resolve_terms(terms)
    for t, (x, (packed, scales, biases)) in zip(terms, inputs):
        x_hat = mx.dequantize(mx.array(packed), mx.array(scales), mx.array(biases), group_size=group_size, bits=bits)
        rel, worst = quant_error(x, np.array(x_hat))
        err, norm, most = t.values()
        assert np.sqrt(err) / np.sqrt(norm) == pytest.approx(rel, rel=1e-12) and most == worst
        assert t.x is None and t.parts is None  # the update's arrays are let go once read
    # MLX's own stacked graph (float32 sums) gives the same figures to float32 rounding
    again = _decoded(bits, group_size, layers=30)
    for t in again:
        t.array = q._error_terms(t.x, t.parts, group_size, bits)
    for a, b in zip(terms, again):
        assert a.values() == pytest.approx(b.values(), rel=1e-5)


@pytest.mark.parametrize(
    "bits,tokens,dtype,layers,why",
    [
        (3, 1, mx.float32, 8, "a width whose codes straddle bytes"),
        (4, 1, mx.bfloat16, 8, "bfloat16, which NumPy does not hold"),
        (4, 7, mx.float32, 8, "a prefill chunk (more than one token)"),
        (4, 1, mx.float32, 1, "a term alone (one layer's keys)"),
    ],
)
def test_what_numpy_cannot_read_stays_with_mlx(bits, tokens, dtype, layers, why):
    terms = _decoded(bits, 64, layers=layers, tokens=tokens, dtype=dtype)[: 2 * layers - (layers == 1)]
    assert len(stage_terms(terms)) == 1, why  # one graph for MLX: keys and values of every layer
    resolve_terms(terms)
    assert all(t.values()[1] > 0 for t in terms)


def test_host_readable_names_what_numpy_holds():
    assert host_readable(np.float32, 4) and host_readable("float16", 8) and host_readable(np.float32)
    assert not host_readable(np.float32, 3) and not host_readable(np.float64, 4) and not host_readable(None)
    assert not host_readable("bfloat16")  # not a NumPy dtype


def test_a_read_terms_can_still_be_merged():
    """A KIVI flush merges the terms of two quantizations: one read on the host already joins as an array."""
    terms = _decoded(4, 64, layers=4)
    resolve_terms(terms)
    ones = mx.ones((1, 3, 1, 128))
    merged = q.merge_terms(terms[0], error_terms(ones, mx.quantize(ones, 64, 4), 64, 4))
    first = terms[0].values()
    assert merged.values()[1] == pytest.approx(first[1] + 3 * 128, rel=1e-6)
