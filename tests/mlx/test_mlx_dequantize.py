"""cachelib's MLX dequantize (a compiled, shape-free elementwise graph on the CPU) gives
``mx.dequantize``'s values bit for bit, whatever the token count, head size, rank and dtype a
call brings: the compiled graph is reused across token counts, so a shape it kept from its
first call would show here. The quantization-error terms a profiled step reads together
equal those read one by one."""

from __future__ import annotations

import mlx.core as mx
import pytest

from cachelib.mlx.quantized import dequantize


@pytest.mark.parametrize("bits,group_size", [(8, 64), (4, 64), (4, 32), (2, 32), (3, 32), (6, 64)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_dequantize_equals_mlx_for_every_shape_in_turn(bits, group_size, dtype):
    shapes = [(1, 3, 1, 64), (1, 3, 17, 64), (2, 3, 300, 64), (1, 2, 5, 128), (1, 3, 1, 64), (3, 40, 64)]
    for i, shape in enumerate(shapes):
        x = (mx.random.normal(shape, key=mx.random.key(i)) * 3).astype(dtype)
        parts = mx.quantize(x, group_size=group_size, bits=bits)
        ours = dequantize(parts, group_size, bits)
        theirs = mx.dequantize(*parts, group_size=group_size, bits=bits)
        assert ours.shape == theirs.shape == x.shape and ours.dtype == theirs.dtype
        assert mx.array_equal(ours, theirs).item(), (shape, bits, group_size, dtype)


@pytest.mark.parametrize("tokens", [1, 7])
def test_a_steps_error_terms_read_together_equal_each_read_alone(tokens):
    """The profiler reads every quantizing layer's error terms of a step as one stacked graph per
    width and shape; each equals its own reading to float rounding, and mixed widths, shapes
    and already-read terms come back right."""
    from cachelib.mlx.quantized import error_terms, merge_terms, quantize, resolve_terms

    xs = [mx.random.normal((1, 3, tokens + (i % 2), 64), key=mx.random.key(i)) * (1 + i) for i in range(12)]
    widths = [(64, 4), (32, 8), (32, 2)]

    def make():
        out = [error_terms(x, quantize(x, *widths[i % 3]), *widths[i % 3]) for i, x in enumerate(xs)]
        return out + [merge_terms(out[0], out[1])]

    together, alone = make(), make()
    together[3].values()  # one read before the rest
    resolve_terms(together)
    for t, a in zip(together, alone):
        assert t.floats is not None
        for p, q in zip(t.values(), a.values()):
            assert abs(p - q) <= 1e-5 * abs(q), (p, q)
