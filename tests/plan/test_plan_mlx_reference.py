"""The planner's bytes equal mlx-lm's own caches byte for byte: random arrays of an arch's
shapes are fed to the installed ``mlx_lm.models.cache`` classes with random update sizes, and
``nbytes`` is compared after every update; then real models (toy presets) run through mlx-lm's
own ``make_prompt_cache`` and every layer is compared after every forward."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.models import cache as C

from cachelib.plan import arch_from_config, preset, trace

SEQUENCES = 25  # random update sequences per case
UPDATES = 40


def _arch(kv_heads=2, head_dim=64, latent=False):
    config = {
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
    }
    if latent:
        config |= {"model_type": "deepseek_v3", "kv_lora_rank": 128, "qk_rope_head_dim": 64}
    return arch_from_config(config, name="ref")


def _sizes(rng: random.Random, big: int) -> list[int]:
    """Mostly 1-token decode steps, with multi-token updates (prefills, chunks) mixed in."""
    return [1 if rng.random() < 0.75 else rng.randint(2, big) for _ in range(UPDATES)]


def _replay_reference(arch, make, sizes, batch, dtype, before_update=None, after_update=None):
    """nbytes of the reference cache after every update (a hook may return a replacement cache)."""
    cache, out = make(), []
    for n in sizes:
        if before_update:
            cache = before_update(cache) or cache
        keys = mx.random.normal((batch, arch.kv_heads, n, arch.key_dim)).astype(dtype)
        values = mx.random.normal((batch, arch.kv_heads, n, arch.value_dim)).astype(dtype)
        cache.update_and_fetch(keys, values)
        if after_update:
            cache = after_update(cache)
        out.append(cache.nbytes)
    return out


CASES = {
    # spec: (reference factory, update-size bound, hooks)
    "standard": (C.KVCache, 300, None, None),
    "concat": (C.ConcatenateKVCache, 300, None, None),
    "rotating:max_size=100,keep=4": (lambda: C.RotatingKVCache(100, 4), 300, None, None),
    "rotating:max_size=300,keep=0": (lambda: C.RotatingKVCache(300, 0), 120, None, None),
    "rotating:max_size=7,keep=2": (lambda: C.RotatingKVCache(7, 2), 12, None, None),
    "sliding:window=50": (lambda: C.RotatingKVCache(50, 0), 80, None, None),
    "chunked:chunk_size=100": (lambda: C.ChunkedKVCache(100), 300, lambda c: c.maybe_trim_front(), None),
    "chunked:chunk_size=300": (lambda: C.ChunkedKVCache(300), 120, lambda c: c.maybe_trim_front(), None),
}


@pytest.mark.parametrize("spec", list(CASES))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_full_precision_caches_match_mlx_lm(spec, dtype):
    make, big, before, after = CASES[spec]
    arch, rng = _arch(), random.Random(spec + dtype)
    for _ in range(SEQUENCES):
        sizes, batch = _sizes(rng, big), rng.choice([1, 2])
        ours = trace(arch, spec, "mlx", updates=sizes, batch=batch, dtype=dtype)
        ref = _replay_reference(arch, make, sizes, batch, getattr(mx, dtype), before, after)
        assert [s.bytes_allocated for s in ours.steps] == ref, (spec, sizes)


def test_rotating_prefill_concat_holds_max_size_plus_s_minus_1_and_then_wraps():
    arch = _arch()
    sizes = [70, 1, 1, 90, 1, 1, 1]  # prefill past max_size=64, decode wraps, a 90-token update, decode
    ours = trace(arch, "rotating:max_size=64,keep=4", "mlx", updates=sizes, dtype="float32")
    ref = _replay_reference(arch, lambda: C.RotatingKVCache(64, 4), sizes, 1, mx.float32)
    assert [s.bytes_allocated for s in ours.steps] == ref
    per_token = 2 * 2 * 64 * 4  # K+V, 2 kv heads, head_dim 64, float32
    assert ours.steps[0].bytes_allocated == 70 * per_token  # a prompt is held whole
    assert ours.steps[1].bytes_allocated == 64 * per_token  # the first decode step trims to max_size
    assert ours.steps[3].bytes_allocated == (64 - 1 + 90) * per_token  # max_size + S - 1
    assert ours.steps[4].bytes_allocated == 64 * per_token


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64])
def test_quantized_cache_matches_mlx_lm(bits, group_size):
    arch, rng = _arch(), random.Random(bits * 100 + group_size)
    spec = f"quantized:bits={bits},group_size={group_size}"
    for _ in range(SEQUENCES // 2):
        sizes, batch = _sizes(rng, 300), rng.choice([1, 2])
        dtype = rng.choice(["float32", "float16"])
        ours = trace(arch, spec, "mlx", updates=sizes, batch=batch, dtype=dtype)
        ref = _replay_reference(arch, lambda: C.QuantizedKVCache(group_size, bits), sizes, batch, getattr(mx, dtype))
        assert [s.bytes_allocated for s in ours.steps] == ref, (spec, sizes)


@pytest.mark.parametrize("start", [1, 100, 700])
def test_quantize_after_start_matches_kvcache_then_to_quantized(start):
    """cachelib's QuantizedKVCache(start=N) converts (with mlx-lm's to_quantized) at the first
    update that begins with offset >= N; mlx-lm's generate does it right after the previous
    model call, which is the same moment seen from the next step."""
    arch, rng = _arch(), random.Random(start)

    def convert(cache):
        if isinstance(cache, C.KVCache) and cache.offset >= start:
            return cache.to_quantized(group_size=64, bits=4)
        return cache

    for _ in range(SEQUENCES // 2):
        sizes = _sizes(rng, 300)
        ours = trace(arch, f"quantized:bits=4,start={start}", "mlx", updates=sizes, dtype="float16")
        ref = _replay_reference(arch, C.KVCache, sizes, 1, mx.float16, before_update=convert)
        assert [s.bytes_allocated for s in ours.steps] == ref, sizes


def test_custom_step_matches_kvcache_with_that_step():
    arch, rng = _arch(), random.Random(7)

    def make():
        cache = C.KVCache()
        cache.step = 64
        return cache

    for _ in range(SEQUENCES // 2):
        sizes = _sizes(rng, 200)
        ours = trace(arch, "standard:step=64", "mlx", updates=sizes, dtype="float32")
        assert [s.bytes_allocated for s in ours.steps] == _replay_reference(arch, make, sizes, 1, mx.float32)


@pytest.mark.parametrize(
    "spec, make",
    [
        ("standard", C.KVCache),
        ("quantized:bits=4,group_size=64", lambda: C.QuantizedKVCache(64, 4)),
        ("rotating:max_size=40,keep=4", lambda: C.RotatingKVCache(40, 4)),
    ],
)
def test_latent_attention_shapes_match_mlx_lm(spec, make):
    """MLA caches one latent (keys, 128 wide here) and one RoPE key (values, 64 wide) per token."""
    arch, rng = _arch(latent=True), random.Random(spec)
    assert (arch.kv_heads, arch.key_dim, arch.value_dim) == (1, 128, 64)
    for _ in range(SEQUENCES // 3):
        sizes = _sizes(rng, 100)
        ours = trace(arch, spec, "mlx", updates=sizes, dtype="float16")
        assert [s.bytes_allocated for s in ours.steps] == _replay_reference(arch, make, sizes, 1, mx.float16)


def _model_run(loaded, sizes):
    """Per-layer nbytes of mlx-lm's own cache after each forward of a real model."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(loaded.model)
    out = []
    for n in sizes:
        loaded.model(mx.array([[5] * n]), cache=cache)
        mx.eval([c.state for c in cache])
        out.append([c.nbytes for c in cache])
    return out


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-mamba", "tiny-llama"])
def test_real_models_match_per_layer_after_every_forward(load_model, name):
    """Sliding layers (gemma3: RotatingKVCache(window, keep=0)) and recurrent layers
    (ArraysCache: conv + SSM state) are sized from the architecture."""
    loaded = load_model(name, "mlx")
    sizes = [40, 1, 1, 1, 30, 1, 1]  # past gemma's 32-token window, then a second prompt
    ours = trace(preset(name), "standard", "mlx", updates=sizes, dtype="float32")
    assert [list(s.layer_bytes) for s in ours.steps] == _model_run(loaded, sizes)
