"""The runtimes' KV formats on torch (``fp8``, ``q8_0``, ``q4_0``): what the cache stores equals the
reference implementation of each format bit for bit (ggml's blocks as the ``gguf`` package writes
them; ``torch.float8_e4m3fn`` with vLLM's saturation), its bytes are the format's, and a model
runs on it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from cachelib.core.rules import format_bytes
from cachelib.spec import parse_spec
from cachelib.torch.formats import FormatKVCache, FormatKVCacheLayer, decode, encode

GGML = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}


def kv_like(seed: int, shape=(2, 3, 40, 64)) -> np.ndarray:
    """(B, H, T, D) float32 with per-token magnitudes from 1e-3 to 30, and the blocks that test
    ggml's edge cases: all zeros, and a tie of +-max (q4_0 keeps the first one's sign)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * rng.uniform(1e-3, 30, shape[:3] + (1,))).astype(np.float32)
    x[0, 0, 0, :32] = 0
    x[0, 0, 1, :4] = [2.0, -2.0, 1.0, 0.5]
    x[0, 1, 1, 32:36] = [-3.0, 3.0, 0.0, 1.5]
    x[-1, -1, 3, :32] = np.float32(1e-30)  # a block whose scale underflows fp16
    return x


def rows(x: np.ndarray) -> np.ndarray:
    """ggml's K/V rows: one per token, heads x head_dim elements, head-major."""
    b, h, t, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b * t, h * d)


def blocks(stored) -> np.ndarray:
    """Our stored (codes, scales) as ggml's bytes: per row, for each block its fp16 scale then codes."""
    codes, scales = (np.ascontiguousarray(t.numpy()) for t in stored)
    b, h, t, nb = scales.shape
    per_block = np.concatenate([scales[..., None].view(np.uint8), codes.reshape(b, h, t, nb, -1)], axis=-1)
    return per_block.transpose(0, 2, 1, 3, 4).reshape(b * t, -1)


@pytest.mark.parametrize("kv_format", ["q8_0", "q4_0"])
def test_ggml_blocks_equal_gguf_quantizer_bit_for_bit(kv_format):
    x = kv_like(0)
    reference = quants.quantize(rows(x), GGML[kv_format])
    stored = encode(torch.from_numpy(x), kv_format)
    assert np.array_equal(blocks(stored), reference)
    theirs = quants.dequantize(reference, GGML[kv_format])
    ours = rows(decode(stored, kv_format, torch.float32).numpy())
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_fp8_equals_torch_e4m3_cast_with_vllm_saturation():
    x = kv_like(1)
    x[1, 0, 0, :4] = [500.0, -1e4, 448.0, 460.0]  # past e4m3's range: vLLM saturates to +-448
    codes = encode(torch.from_numpy(x), "fp8")
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    reference = torch.from_numpy(x).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(codes, reference.view(torch.uint8))
    back = decode(codes, "fp8", torch.float32)
    assert torch.equal(back, reference.float())
    assert back[1, 0, 0, :4].tolist() == [448.0, -448.0, 448.0, 448.0]


@pytest.mark.parametrize("kv_format", ["fp8", "q8_0", "q4_0"])
def test_layer_stores_the_formats_bytes_and_hands_back_the_decoded_values(kv_format):
    layer = FormatKVCacheLayer(kv_format)
    x = torch.from_numpy(kv_like(2, (1, 3, 300, 64)))
    k, v = layer.update(x[:, :, :290], -x[:, :, :290])
    k2, v2 = layer.update(x[:, :, 290:], -x[:, :, 290:])
    assert torch.equal(k2, decode(encode(x, kv_format), kv_format, torch.float32))
    assert torch.equal(v2, decode(encode(-x, kv_format), kv_format, torch.float32))
    # 512 slots after two growth steps; keys and values at the format's bytes per element
    assert layer.nbytes == 2 * format_bytes(3 * 64, kv_format) * 512
    view = layer.introspect()
    assert (view.kind, view.tokens_held, view.capacity, view.dtype) == ("FormatKVCache", 300, 512, kv_format)
    assert view.key_bits == (4 if kv_format == "q4_0" else 8)
    assert not torch.equal(k2, x)  # lossy: a stored value differs from its input


def test_half_precision_inputs_come_back_in_their_dtype():
    layer = FormatKVCacheLayer("q8_0")
    x = torch.from_numpy(kv_like(3, (1, 2, 5, 64))).to(torch.bfloat16)
    k, _ = layer.update(x, x)
    assert k.dtype == torch.bfloat16
    assert torch.equal(k, decode(encode(x.float(), "q8_0"), "q8_0", torch.bfloat16))


def test_error_probe_measures_the_format():
    layer = FormatKVCacheLayer("q4_0")
    layer.track_error = True
    x = torch.from_numpy(kv_like(4, (1, 2, 8, 64)))
    layer.update(x, x)
    err = layer.introspect().quant_error
    assert 0.01 < err.key_rel_rms < 0.3 and err.key_rel_rms == err.value_rel_rms


def test_bad_format_and_head_dim_name_the_allowed_values():
    with pytest.raises(ValueError, match="allowed: fp8, q8_0, q4_0"):
        FormatKVCacheLayer("q5_0")
    layer = FormatKVCacheLayer("q4_0")
    x = torch.zeros(1, 1, 2, 48)
    with pytest.raises(ValueError, match="head_dim=48 is not a multiple of 32"):
        layer.update(x, x)
    FormatKVCacheLayer("fp8").update(x, x)  # fp8 has no blocks


def test_tiny_model_runs_on_each_format_with_the_error_its_precision_predicts(tiny):
    """Prefill then a chunk, through transformers' attention: every format is lossy, and the
    logits drift in the order of the formats' precision (q8_0: 8-bit codes per 32-block; fp8: 3
    mantissa bits per element; q4_0: 4-bit codes per 32-block)."""
    model = tiny("tiny-llama")
    ids = torch.arange(3, 43).unsqueeze(0)
    err = {}
    with torch.no_grad():
        full = model(ids).logits
        for text in ("fp8", "q8_0", "q4_0"):
            spec = parse_spec(text)
            cache = spec.strategy.builder("torch")(spec, model.config)
            assert isinstance(cache, FormatKVCache)
            ours = model(ids[:, :30], cache=cache).logits
            ours = torch.cat([ours, model(ids[:, 30:], cache=cache).logits], dim=1)
            assert cache.get_seq_length() == 40
            err[text] = ((ours - full).abs().mean() / full.abs().mean()).item()
    assert 0 < err["q8_0"] < err["fp8"] < err["q4_0"] < 1, err


def test_format_caches_share_a_strategy_batch_with_the_results_of_one_by_one(load_model):
    """The evaluation runs strategies as the rows of one batch: each format row gives the logits
    its cache gives alone."""
    from cachelib.profile.evaluate import teacher_forced_logits, teacher_forced_logits_rows
    from cachelib.torch.rows import batch_problem

    loaded = load_model("tiny-llama", "torch")
    specs = [parse_spec(t) for t in ("standard", "fp8", "q8_0", "q4_0")]

    def caches():
        return [s.strategy.builder("torch")(s, loaded.model.config) for s in specs]

    prefix, continuation = list(range(3, 40)), list(range(40, 48))
    assert all(batch_problem(c) is None for c in caches())
    rows = teacher_forced_logits_rows(loaded, caches(), prefix, continuation, prefill_chunk=16)
    for i, cache in enumerate(caches()):
        alone = teacher_forced_logits(loaded, cache, prefix, continuation, prefill_chunk=16)
        # batched matmuls round differently, and a code on a rounding boundary may then flip
        diff = np.abs(rows[i] - alone)
        assert diff.mean() < 5e-3 and diff.max() < 0.1, (str(specs[i]), diff.mean(), diff.max())  # logits ~2.3
