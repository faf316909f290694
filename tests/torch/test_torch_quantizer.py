"""Our group-wise quantizer: the same codes, scales and biases as MLX's ``mx.quantize`` (so
quantized caches agree across backends, byte for byte), storage of bits/8 bytes per element,
and reconstruction within the computed error bound."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from cachelib.torch.quantizer import Quantizer

TORCH_TO_MLX = {torch.float32: mx.float32, torch.float16: mx.float16, torch.bfloat16: mx.bfloat16}


def _inputs(rng, dtype):
    x = rng.standard_normal((2, 3, 9, 128)).astype(np.float32) * rng.uniform(0.05, 20)
    x[0, 0, 0] = 0.0  # an all-zero group
    x[0, 0, 1] = 3.5  # a constant group
    x[0, 1, 2] = np.abs(x[0, 1, 2])  # all positive
    x[0, 1, 3] = -np.abs(x[0, 1, 3])  # all negative
    return torch.from_numpy(x).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_codes_scales_and_biases_equal_mlx_quantize(bits, group, dtype):
    rng = np.random.default_rng(bits * 1000 + group)
    x = _inputs(rng, dtype)
    q = Quantizer(bits, group)
    codes, scales, biases = q.quantize(x)
    m_codes, m_scales, m_biases = mx.quantize(
        mx.array(x.float().numpy()).astype(TORCH_TO_MLX[dtype]), group_size=group, bits=bits
    )
    # Our uint8 codes are the bytes of MLX's little-endian uint32 words.
    np.testing.assert_array_equal(codes.numpy(), np.array(m_codes).view(np.uint8))
    np.testing.assert_array_equal(scales.float().numpy(), np.array(m_scales.astype(mx.float32)))
    np.testing.assert_array_equal(biases.float().numpy(), np.array(m_biases.astype(mx.float32)))
    assert scales.dtype == biases.dtype == dtype
    got = q.dequantize((codes, scales, biases))
    want = mx.dequantize(m_codes, m_scales, m_biases, group_size=group, bits=bits)
    np.testing.assert_allclose(
        got.float().numpy(), np.array(want.astype(mx.float32)), rtol=1e-2 if dtype != torch.float32 else 0
    )


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_storage_takes_bits_over_8_bytes_per_element_plus_a_scale_and_bias_per_group(bits, group):
    x = torch.randn(3, 2, 5, 256)
    codes, scales, biases = Quantizer(bits, group).quantize(x)
    assert codes.dtype == torch.uint8 and codes.nbytes == x.numel() * bits // 8
    assert scales.shape == biases.shape == (3, 2, 5, 256 // group)
    assert Quantizer(bits, group).bytes_per_vector(256, torch.float32) == 256 * bits // 8 + 2 * (256 // group) * 4


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_reconstruction_stays_within_one_grid_step_per_group(bits):
    """The bound: |x - deq(q(x))| <= (max - min) / (2**bits - 1) of the element's group, even
    with the grid anchored at the larger edge (exact zero) and the far edge clipped."""
    q = Quantizer(bits, 32)
    for seed in range(200):
        rng = np.random.default_rng(seed)
        x = torch.from_numpy(rng.standard_normal((4, 64)).astype(np.float32) * rng.uniform(0.01, 100))
        x += float(rng.uniform(-50, 50)) * (rng.random() < 0.3)  # groups far from zero
        err = (q.dequantize(q.quantize(x)) - x).abs()
        assert (err <= q.error_bound(x) * (1 + 1e-5) + 1e-6).all()
    zeros = torch.zeros(1, 32)
    assert torch.equal(q.dequantize(q.quantize(zeros)), zeros)  # exact zeros survive


def test_bad_bits_and_group_sizes_are_refused_naming_the_allowed_values():
    with pytest.raises(ValueError, match="bits=3 is not supported; allowed: 2, 4, 8"):
        Quantizer(3, 64)
    with pytest.raises(ValueError, match="group_size=48 is not supported; allowed: 32, 64, 128"):
        Quantizer(4, 48)
    with pytest.raises(ValueError, match="group_size=64 must divide head_dim=96"):
        Quantizer(4, 64).quantize(torch.zeros(1, 96))
