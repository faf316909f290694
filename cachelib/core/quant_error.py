"""The quantization error of many small updates at once, in NumPy on the host.

A profiled decode step quantizes one token per layer in every quantizing cache: some sixty tiny
updates, whose error figures (``[sum of squared error, sum of squared input, max abs error]``
each) cost the backends' dispatch of every small op, not arithmetic. On a CPU, where the
backends' arrays are the host's memory, reading them as NumPy arrays is a view, and the joins,
the dequantization and the reductions of every update together come to a few NumPy calls.

Both backends pack codes the same way: ``8 // bits`` codes to a byte, lowest bits first (MLX's
``uint32`` words are those bytes on a little-endian host), each group of ``group_size`` codes
``w`` reconstructed as ``w * scale + bias`` in the scales' dtype, a product then a sum (two
roundings), as both backends' dequantization does on the CPU. The figures are summed in float64.
"""

from __future__ import annotations

import numpy as np

HOST_BITS = (2, 4, 8)  # widths whose codes never straddle a byte
HOST_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))  # what both NumPy and the backends hold

_TABLES: dict[tuple, np.ndarray] = {}


def unpacked(packed: np.ndarray, bits: int, dtype) -> np.ndarray:
    """The codes of the bytes ``packed`` (..., B) as (..., B * 8 // bits) values of ``dtype``."""
    dtype = np.dtype(dtype)
    if bits == 8:
        return packed.astype(dtype)
    table = _TABLES.get((bits, dtype))
    if table is None:  # (256, 8 // bits): the codes each byte holds
        byte = np.arange(256)
        codes = [(byte >> (j * bits)) & ((1 << bits) - 1) for j in range(8 // bits)]
        table = _TABLES[(bits, dtype)] = np.stack(codes, -1).astype(dtype)
    return table[packed].reshape(*packed.shape[:-1], -1)


def reconstructed(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int) -> np.ndarray:
    """``(rows, D)``: the reconstruction of ``rows`` rows of packed codes ``(rows, D * bits / 8)``
    bytes with their ``(rows, D / group_size)`` scales and biases, in the scales' dtype."""
    rows = packed.shape[0]
    w = unpacked(packed, bits, scales.dtype).reshape(-1, group_size)
    w *= scales.reshape(-1, 1)  # w is a fresh array: in place, one rounding each
    w += biases.reshape(-1, 1)
    return w.reshape(rows, -1)


def error_rows(x: np.ndarray, x_hat: np.ndarray) -> np.ndarray:
    """``(rows, 3)`` float64: per row of ``x`` and its reconstruction ``x_hat`` (both ``(rows, D)``),
    the sum of squared error, the sum of squared ``x`` and the largest absolute error."""
    x = x.astype(np.float64)
    diff = x_hat.astype(np.float64)
    diff -= x
    out = np.empty((x.shape[0], 3))
    np.einsum("ij,ij->i", diff, diff, out=out[:, 0])
    np.einsum("ij,ij->i", x, x, out=out[:, 1])
    if diff.shape[1]:
        np.abs(diff, out=diff).max(axis=1, out=out[:, 2])
    else:
        out[:, 2] = 0.0
    return out


def host_readable(dtype, bits: int | None = None) -> bool:
    """Whether arrays of ``dtype`` (a NumPy dtype, or a name NumPy knows) and codes of ``bits``
    bits (None: no codes) can be read here: bfloat16, and widths that straddle bytes, cannot."""
    if dtype is None:
        return False
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        return False
    return dtype in HOST_DTYPES and (bits is None or bits in HOST_BITS)
