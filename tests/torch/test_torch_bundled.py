"""Real decodes of the bundled SmolLM2-135M (real weights), greedy, 128 tokens: our caches give
transformers' tokens, and our PyTorch ring buffer gives mlx-lm's ring-buffer tokens on MLX."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from transformers import cache_utils as tf

import cachelib.torch as ct
from cachelib.decode import encode_prompt, greedy_decode

pytestmark = pytest.mark.bundled

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."  # 46 tokens
TOKENS = 128


def _decode(loaded, cache):
    return greedy_decode(loaded, PROMPT, cache=cache, max_tokens=TOKENS, stop_at_eos=False).ids


@pytest.fixture(scope="module")
def reference(smollm2_torch):
    """transformers' own DynamicCache decode."""
    return _decode(smollm2_torch, tf.DynamicCache(config=smollm2_torch.model.config))


def test_dynamic_cache_decodes_like_transformers(smollm2_torch, reference):
    assert _decode(smollm2_torch, ct.DynamicCache(config=smollm2_torch.model.config)) == reference


def test_static_cache_decodes_like_transformers_static_cache(smollm2_torch):
    config = smollm2_torch.model.config
    size = len(encode_prompt(smollm2_torch.tokenizer, PROMPT)) + TOKENS
    want = _decode(smollm2_torch, tf.StaticCache(config, max_cache_len=size))
    assert _decode(smollm2_torch, ct.StaticCache(config, max_cache_len=size)) == want


def test_sliding_window_cache_decodes_like_transformers_sliding_layers(smollm2_torch):
    window = 48  # the prompt is 46 tokens: the window slides for most of the decode
    n = smollm2_torch.model.config.num_hidden_layers
    want = _decode(smollm2_torch, tf.Cache(layers=[tf.DynamicSlidingWindowLayer(window) for _ in range(n)]))
    got = _decode(smollm2_torch, ct.make_cache(smollm2_torch.model, f"sliding:window={window}"))
    assert got == want


def test_rotating_cache_on_torch_decodes_like_mlx_lm_rotating_cache_on_mlx(smollm2_torch, smollm2_mlx):
    """Same weights, same ring (max_size=64, keep=4; the 46-token prompt fits, 128 decoded
    tokens wrap it twice): token-for-token agreement between the backends."""
    from mlx_lm.models.cache import RotatingKVCache as MlxRotating

    torch_ids = _decode(smollm2_torch, ct.make_cache(smollm2_torch.model, "rotating:max_size=64,keep=4"))
    mlx_cache = [MlxRotating(max_size=64, keep=4) for _ in smollm2_mlx.model.layers]
    mlx_ids = _decode(smollm2_mlx, mlx_cache)
    agreement = float(np.mean(np.array(torch_ids) == np.array(mlx_ids)))
    first_diff = next((i for i, (a, b) in enumerate(zip(torch_ids, mlx_ids)) if a != b), None)
    print(f"torch vs mlx-lm rotating: agreement {agreement:.3f}, first difference at token {first_diff}")
    assert torch_ids == mlx_ids, f"agreement {agreement:.3f}, first difference at token {first_diff}"


def test_generate_with_step_grown_and_ring_caches_continues_like_transformers(smollm2_torch, reference):
    model, tok = smollm2_torch.model, smollm2_torch.tokenizer
    ids = torch.tensor([encode_prompt(tok, PROMPT)])
    for cache in (ct.KVCache(config=model.config), ct.RotatingKVCache(64, 4, config=model.config)):
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # a deprecated keyword (past_key_values=) fails
            out = model.generate(ids, max_new_tokens=12, do_sample=False, cache=cache)
        assert out[0, ids.shape[1] :].tolist() == reference[:12]
