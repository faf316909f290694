"""The planner's bytes equal transformers' cache layers byte for byte: the installed
``transformers.cache_utils`` layers get random tensors of an arch's shapes with random update
sizes, and the sum of their tensors' nbytes is compared after every update; then real models
(toy presets) run with transformers' own DynamicCache / StaticCache, every layer compared after
every forward."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import cache_utils as T

from cachelib.plan import arch_from_config, preset, trace

SEQUENCES = 25
UPDATES = 40
ARCH = arch_from_config(
    {
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
    },
    name="ref",
)


def _sizes(rng: random.Random, big: int) -> list[int]:
    return [1 if rng.random() < 0.75 else rng.randint(2, big) for _ in range(UPDATES)]


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(x) for x in obj)
    return 0


def _layer_bytes(layer) -> int:
    total = _tensor_bytes(layer.keys) + _tensor_bytes(layer.values)
    for name in ("_quantized_keys", "_quantized_values"):
        total += _tensor_bytes(getattr(layer, name, None))
    return total


def _replay_reference(make, sizes, batch, dtype):
    layer, out = make(), []
    for n in sizes:
        k = torch.randn(batch, ARCH.kv_heads, n, ARCH.key_dim, dtype=dtype)
        v = torch.randn(batch, ARCH.kv_heads, n, ARCH.value_dim, dtype=dtype)
        layer.update(k, v)
        out.append(_layer_bytes(layer))
    return out


class PackedQuantizedLayer(T.QuantizedLayer):
    """transformers' KIVI bookkeeping with a group-wise quantizer that stores what ours stores:
    ``D * bits / 8`` packed bytes per token-head plus one scale and one zero point per group of
    the head dim, in the input dtype."""

    def _quantize(self, tensor, axis):
        bits, group = self.nbits, self.q_group_size
        *lead, d = tensor.shape
        g = tensor.reshape(*lead, d // group, group).float()
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        scale = (hi - lo).clamp(min=1e-8) / (2**bits - 1)
        q = ((g - lo) / scale).round().clamp(0, 2**bits - 1).to(torch.uint8)
        q = q.reshape(*lead, d // (8 // bits), 8 // bits)  # 8 // bits codes per byte
        packed = torch.zeros(q.shape[:-1], dtype=torch.uint8)
        for i in range(8 // bits):
            packed |= q[..., i] << (bits * i)
        return packed, scale.squeeze(-1).to(tensor.dtype), lo.squeeze(-1).to(tensor.dtype)

    def _dequantize(self, q_tensor):
        packed, scale, lo = q_tensor
        bits, group = self.nbits, self.q_group_size
        parts = [(packed >> (bits * i)) & (2**bits - 1) for i in range(8 // bits)]
        q = torch.stack(parts, -1).reshape(*packed.shape[:-1], -1).float()
        g = q.reshape(*q.shape[:-1], -1, group) * scale.float()[..., None] + lo.float()[..., None]
        return g.reshape(*q.shape).to(scale.dtype)


CASES = {
    "concat": (T.DynamicLayer, 300),
    "sliding:window=50": (lambda: T.DynamicSlidingWindowLayer(50), 80),
    "sliding:window=2": (lambda: T.DynamicSlidingWindowLayer(2), 5),
    "static:max_len=5000": (lambda: T.StaticLayer(5000), 200),
    "kivi:bits=4,group_size=64,residual=128": (
        lambda: PackedQuantizedLayer(4, q_group_size=64, residual_length=128),
        300,
    ),
    "kivi:bits=2,group_size=32,residual=16": (lambda: PackedQuantizedLayer(2, q_group_size=32, residual_length=16), 40),
    "kivi:bits=8,group_size=64,residual=1": (lambda: PackedQuantizedLayer(8, q_group_size=64, residual_length=1), 10),
}


@pytest.mark.parametrize("spec", list(CASES))
def test_layers_match_transformers(spec):
    make, big = CASES[spec]
    rng = random.Random(spec)
    for _ in range(SEQUENCES):
        sizes, batch = _sizes(rng, big), rng.choice([1, 2])
        dtype = rng.choice(["float32", "float16"])
        ours = trace(ARCH, spec, "torch", updates=sizes, batch=batch, dtype=dtype)
        ref = _replay_reference(make, sizes, batch, getattr(torch, dtype))
        assert [s.bytes_allocated for s in ours.steps] == ref, (spec, sizes)


def test_window_of_one_holds_nothing_in_cachelib_unlike_transformers():
    """transformers' slice [-0:] keeps every token at window 1; cachelib's layer keeps none."""
    from cachelib.torch import DynamicSlidingWindowLayer

    ours, theirs = DynamicSlidingWindowLayer(1), T.DynamicSlidingWindowLayer(1)
    for _ in range(3):
        k = torch.randn(1, 1, 2, 64)
        ours.update(k, k)
        theirs.update(k, k)
    assert (
        ours.introspect().bytes_allocated
        == 0
        == trace(ARCH, "sliding:window=1", "torch", updates=[2, 2, 2]).steps[-1].bytes_allocated
    )
    assert theirs.keys.shape[-2] == 6


@pytest.mark.parametrize("max_len, window", [(40, 16), (10, 16), (300, 64)])
def test_static_sliding_window_layer_matches_transformers(max_len, window):
    """A gemma-style sliding layer inside a static cache: StaticSlidingWindowLayer."""
    arch = arch_from_config(
        {
            "model_type": "llama",
            "num_hidden_layers": 2,
            "hidden_size": 128,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": window,
        },
        name="s",
    )
    rng = random.Random(max_len)
    for _ in range(SEQUENCES):
        sizes, total = [], 0
        while True:  # the static layers refuse more than max_len
            n = 1 if rng.random() < 0.7 else rng.randint(2, 30)
            if total + n > max_len or len(sizes) == UPDATES:
                break
            sizes.append(n)
            total += n
        if not sizes:
            continue
        ours = trace(arch, f"static:max_len={max_len}", "torch", updates=sizes, dtype="float32")
        layer, ref = T.StaticSlidingWindowLayer(max_len, window), []
        for n in sizes:
            layer.update(torch.randn(1, 1, n, 64), torch.randn(1, 1, n, 64))
            ref.append(_layer_bytes(layer))
        assert [s.layer_bytes[0] for s in ours.steps] == ref, sizes


def test_kivi_residual_never_reaches_residual_length():
    steps = trace(ARCH, "kivi:bits=4,residual=8", "torch", updates=[20] + [1] * 30, dtype="float16").steps
    fp_token = 2 * 2 * 64 * 2
    q_token = 2 * 2 * (64 * 4 // 8 + 2 * 2)
    for s in steps:
        residual = (s.bytes_allocated - s.offset * q_token) // (fp_token - q_token)
        assert 0 <= residual <= 7
    assert steps[0].bytes_allocated == 20 * q_token  # the prompt is quantized whole


def _torch_model_run(loaded, cache, sizes):
    out = []
    with torch.inference_mode():
        for n in sizes:
            loaded.model(input_ids=torch.full((1, n), 5), cache=cache, use_cache=True)
            row = []
            for layer in cache.layers:
                if isinstance(layer, T.LinearAttentionLayer):
                    states = [*layer.conv_states.values(), *layer.recurrent_states.values()]
                    row.append(_tensor_bytes(states))
                else:
                    row.append(_layer_bytes(layer))
            out.append(row)
    return out


@pytest.mark.parametrize(
    "name, spec",
    [
        ("tiny-gemma3", "concat"),  # DynamicCache(config): DynamicLayer + DynamicSlidingWindowLayer
        ("tiny-gemma3", "static:max_len=100"),  # StaticCache: StaticLayer + StaticSlidingWindowLayer
        ("tiny-mamba", "concat"),  # LinearAttentionLayer: conv (B, C, K) + float32 SSM state
        ("tiny-llama", "static:max_len=100"),
    ],
)
def test_real_models_match_per_layer_after_every_forward(load_model, name, spec):
    loaded = load_model(name, "torch")
    config = loaded.model.config
    if spec.startswith("static"):
        cache = T.StaticCache(config=config, max_cache_len=100)
    else:
        cache = T.DynamicCache(config=config)
    sizes = [40, 1, 1, 1, 20, 1, 1]
    ours = trace(preset(name), spec, "torch", updates=sizes, dtype="float32")
    assert [list(s.layer_bytes) for s in ours.steps] == _torch_model_run(loaded, cache, sizes)
