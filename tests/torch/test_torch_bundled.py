"""Real decodes of the bundled SmolLM2-135M (real weights), greedy: our caches give
transformers' logits bit for bit, and our PyTorch ring buffer gives mlx-lm's ring-buffer tokens on MLX."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from decode_helpers import lockstep
from transformers import cache_utils as tf

import cachelib.torch as ct
from cachelib.decode import encode_prompt, greedy_decode

pytestmark = pytest.mark.bundled

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."  # 46 tokens
# Against transformers' caches every step's logits are compared bit for bit, 64 steps: a cache
# that differs fails at its first step, where equal tokens could hide it for many. Nothing in
# these caches changes between 64 and 128 tokens (the static cache is sized to the run and filled
# to its end either way; the window of 48 has slid past the whole prompt by step 48). The ring
# against mlx-lm's on MLX compares tokens (two backends' logits differ by rounding), 128 of them:
# after the 46-token prompt its 64 slots (keep 4) wrap at offsets 64 and 124, twice.
TOKENS = 64
RING_TOKENS = 128


def _decode(loaded, cache, tokens=TOKENS):
    return greedy_decode(loaded, PROMPT, cache=cache, max_tokens=tokens, stop_at_eos=False).ids


def _lockstep(loaded, mine, theirs, tokens=TOKENS) -> list[int]:
    return lockstep(loaded, mine, theirs, PROMPT, tokens)


@pytest.fixture(scope="module")
def reference(smollm2_torch):
    """transformers' own DynamicCache decode (the 12 tokens generate() is compared with)."""
    return _decode(smollm2_torch, tf.DynamicCache(config=smollm2_torch.model.config), tokens=12)


@pytest.mark.slow
def test_dynamic_cache_decodes_like_transformers(smollm2_torch):
    config = smollm2_torch.model.config
    _lockstep(smollm2_torch, ct.DynamicCache(config=config), tf.DynamicCache(config=config))


@pytest.mark.slow
def test_static_cache_decodes_like_transformers_static_cache(smollm2_torch):
    config = smollm2_torch.model.config
    size = len(encode_prompt(smollm2_torch.tokenizer, PROMPT)) + TOKENS
    _lockstep(smollm2_torch, ct.StaticCache(config, max_cache_len=size), tf.StaticCache(config, max_cache_len=size))


@pytest.mark.slow
def test_sliding_window_cache_decodes_like_transformers_sliding_layers(smollm2_torch):
    window = 48  # the prompt is 46 tokens: the window slides for most of the decode
    n = smollm2_torch.model.config.num_hidden_layers
    mine = ct.make_cache(smollm2_torch.model, f"sliding:window={window}")
    _lockstep(smollm2_torch, mine, tf.Cache(layers=[tf.DynamicSlidingWindowLayer(window) for _ in range(n)]))


@pytest.mark.slow
def test_rotating_cache_on_torch_decodes_like_mlx_lm_rotating_cache_on_mlx(smollm2_torch, smollm2_mlx):
    """Same weights, same ring (max_size=64, keep=4; the 46-token prompt fits, 128 decoded
    tokens wrap it twice): token-for-token agreement between the backends."""
    from mlx_lm.models.cache import RotatingKVCache as MlxRotating

    torch_ids = _decode(smollm2_torch, ct.make_cache(smollm2_torch.model, "rotating:max_size=64,keep=4"), RING_TOKENS)
    mlx_cache = [MlxRotating(max_size=64, keep=4) for _ in smollm2_mlx.model.layers]
    mlx_ids = _decode(smollm2_mlx, mlx_cache, RING_TOKENS)
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
