"""The runtimes' KV formats on MLX (``fp8``, ``q8_0``, ``q4_0``): what the cache stores equals the
reference implementation of each format bit for bit (ggml's blocks as the ``gguf`` package writes
them; ``torch.float8_e4m3fn`` with vLLM's saturation), equals the torch backend's bytes, and
speaks mlx-lm's cache protocol."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from cachelib.core.rules import format_bytes
from cachelib.mlx.factory import make_cache
from cachelib.mlx.formats import FormatKVCache, decode, encode
from cachelib.torch import formats as torch_formats

GGML = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}


def kv_like(seed: int, shape=(2, 3, 40, 64)) -> np.ndarray:
    """(B, H, T, D) float32 with per-token magnitudes from 1e-3 to 30 and ggml's edge cases: a
    zero block, a tie of +-max (q4_0 keeps the first one's sign), a scale that underflows fp16."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * rng.uniform(1e-3, 30, shape[:3] + (1,))).astype(np.float32)
    x[0, 0, 0, :32] = 0
    x[0, 0, 1, :4] = [2.0, -2.0, 1.0, 0.5]
    x[0, -1, 1, 32:36] = [-3.0, 3.0, 0.0, 1.5]
    x[-1, -1, 3, :32] = np.float32(1e-30)
    return x


def rows(x: np.ndarray) -> np.ndarray:
    """ggml's K/V rows: one per token, heads x head_dim elements, head-major."""
    b, h, t, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b * t, h * d)


def blocks(parts) -> np.ndarray:
    """Our stored [codes, scales] as ggml's bytes: per row, for each block its fp16 scale then codes."""
    codes, scales = (np.array(p) for p in parts)
    b, h, t, nb = scales.shape
    per_block = np.concatenate([scales[..., None].view(np.uint8), codes.reshape(b, h, t, nb, -1)], axis=-1)
    return per_block.transpose(0, 2, 1, 3, 4).reshape(b * t, -1)


@pytest.mark.parametrize("kv_format", ["q8_0", "q4_0"])
def test_ggml_blocks_equal_gguf_quantizer_bit_for_bit(kv_format):
    x = kv_like(0)
    reference = quants.quantize(rows(x), GGML[kv_format])
    parts = encode(mx.array(x), kv_format)
    assert parts[0].dtype == mx.uint8 and parts[1].dtype == mx.float16
    assert np.array_equal(blocks(parts), reference)
    theirs = quants.dequantize(reference, GGML[kv_format])
    ours = rows(np.array(decode(parts, kv_format, mx.float32)))
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_fp8_equals_torch_e4m3_cast_with_vllm_saturation():
    # every finite float16 value, then random float32 over seven decades, and values past +-448
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    rng = np.random.default_rng(1)
    wide = rng.standard_normal(200_000).astype(np.float32) * np.float32(10.0) ** rng.uniform(-4, 3, 200_000)
    x = np.concatenate([halves[np.isfinite(halves)], wide, [500.0, -1e4, 448.0, 460.0]]).astype(np.float32)
    codes = encode(mx.array(x), "fp8")[0]
    reference = torch.from_numpy(x).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert np.array_equal(np.array(codes), reference.view(torch.uint8).numpy())
    back = np.array(decode([codes], "fp8", mx.float32))
    assert np.array_equal(back, reference.float().numpy())
    assert back[-4:].tolist() == [448.0, -448.0, 448.0, 448.0]


@pytest.mark.parametrize("kv_format", ["fp8", "q8_0", "q4_0"])
def test_mlx_and_torch_store_the_same_bytes(kv_format):
    x = kv_like(5, (1, 2, 7, 64))
    ours = [np.array(p) for p in encode(mx.array(x), kv_format)]
    theirs = torch_formats.encode(torch.from_numpy(x), kv_format)
    theirs = [theirs.numpy()] if kv_format == "fp8" else [t.numpy() for t in theirs]
    assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("kv_format", ["fp8", "q8_0", "q4_0"])
def test_cache_stores_the_formats_bytes_and_hands_back_the_decoded_values(kv_format):
    cache = FormatKVCache(kv_format)
    x = mx.array(kv_like(2, (1, 3, 300, 64)))
    cache.update_and_fetch(x[:, :, :290], -x[:, :, :290])
    k, v = cache.update_and_fetch(x[:, :, 290:], -x[:, :, 290:])
    assert mx.array_equal(k, decode(encode(x, kv_format), kv_format, mx.float32)).item()
    assert mx.array_equal(v, decode(encode(-x, kv_format), kv_format, mx.float32)).item()
    assert cache.nbytes == 2 * format_bytes(3 * 64, kv_format) * 512  # two growth steps of 256
    view = cache.introspect()
    assert (view.kind, view.tokens_held, view.capacity, view.dtype) == ("FormatKVCache", 300, 512, kv_format)
    assert view.key_bits == (4 if kv_format == "q4_0" else 8)
    assert not hasattr(cache, "bits")  # mlx-lm's standard attention, over the decoded values
    assert not mx.array_equal(k, x).item()  # lossy


def test_half_precision_in_half_precision_out_and_protocol():
    cache = FormatKVCache("q4_0")
    x = mx.array(kv_like(3, (1, 2, 10, 64))).astype(mx.bfloat16)
    k, _ = cache.update_and_fetch(x, x)
    assert k.dtype == mx.bfloat16
    assert mx.array_equal(k, decode(encode(x, "q4_0"), "q4_0", mx.bfloat16)).item()
    assert cache.trim(4) == 4 and cache.offset == 6
    k, _ = cache.update_and_fetch(x[:, :, :1], x[:, :, :1])
    assert k.shape[2] == 7
    again = FormatKVCache.from_state(cache.state)  # hands back the next update's dtype
    assert again.offset == 7 and again.nbytes == cache.nbytes
    k2, _ = again.update_and_fetch(x[:, :, :1], x[:, :, :1])
    k3, _ = cache.update_and_fetch(x[:, :, :1], x[:, :, :1])
    assert mx.array_equal(k2, k3).item() and k2.dtype == mx.bfloat16


def test_error_probe_measures_the_format():
    cache = FormatKVCache("q8_0")
    cache.track_error = True
    x = mx.array(kv_like(4, (1, 2, 8, 64)))
    cache.update_and_fetch(x, x)
    err = cache.introspect().quant_error
    assert 0 < err.key_rel_rms < 0.02 and err.key_rel_rms == err.value_rel_rms


def test_bad_format_head_dim_and_state_name_the_allowed_values():
    with pytest.raises(ValueError, match="allowed: fp8, q8_0, q4_0"):
        FormatKVCache("q5_0")
    x = mx.zeros((1, 1, 2, 48))
    with pytest.raises(ValueError, match="head_dim=48 is not a multiple of 32"):
        FormatKVCache("q8_0").update_and_fetch(x, x)
    FormatKVCache("fp8").update_and_fetch(x, x)  # fp8 has no blocks
    with pytest.raises(ValueError, match="4 entries"):
        FormatKVCache.from_state((None, None, 0))


@pytest.mark.parametrize("text", ["fp8", "q8_0", "q4_0"])
def test_make_cache_puts_the_format_on_the_models_layers(load_model, text):
    loaded = load_model("tiny-llama", "mlx")
    cache = make_cache(loaded.model, text)
    assert cache and all(isinstance(c, FormatKVCache) and c.kv_format == text for c in cache)
    ids = mx.array([[3, 4, 5, 6, 7, 8]])
    logits = loaded.model(ids, cache=cache)
    mx.eval(logits)
    assert cache[0].offset == 6 and bool(mx.all(mx.isfinite(logits)).item())


def test_format_caches_share_a_strategy_batch_with_the_results_of_one_by_one(load_model):
    """The evaluation runs strategies as the rows of one batch: each format row gives the logits
    its cache gives alone (up to the rounding of batched matmuls, which may flip a code)."""
    from cachelib.mlx.rows import batch_problem
    from cachelib.profile.evaluate import teacher_forced_logits, teacher_forced_logits_rows

    loaded = load_model("tiny-llama", "mlx")
    specs = ["standard", "fp8", "q8_0", "q4_0"]

    def caches():
        return [make_cache(loaded.model, s) for s in specs]

    assert all(batch_problem(c) is None for c in caches())
    prefix, continuation = list(range(3, 40)), list(range(40, 48))
    rows = teacher_forced_logits_rows(loaded, caches(), prefix, continuation, prefill_chunk=16)
    for i, cache in enumerate(caches()):
        diff = np.abs(rows[i] - teacher_forced_logits(loaded, cache, prefix, continuation, prefill_chunk=16))
        assert diff.mean() < 5e-3 and diff.max() < 0.1, (specs[i], diff.mean(), diff.max())  # logits ~2.3
