"""Real decodes of the bundled SmolLM2 (mlx-lm's llama code, real weights): our caches give
the logits (bit for bit) and tokens of mlx-lm's own classes with the same settings."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm.models.cache as ref
import pytest
from decode_helpers import lockstep
from mlx_lm.generate import generate_step

import cachelib.mlx as ours
from cachelib.decode import encode_prompt, greedy_decode

pytestmark = pytest.mark.bundled

PROMPT = "Write a short story about a robot who learns to paint, in three paragraphs."

SETTINGS = {
    "KVCache": (ours.KVCache, ref.KVCache),
    "RotatingKVCache(max_size=64, keep=4)": (
        lambda: ours.RotatingKVCache(max_size=64, keep=4),
        lambda: ref.RotatingKVCache(max_size=64, keep=4),
    ),
    "QuantizedKVCache(bits=8)": (lambda: ours.QuantizedKVCache(bits=8), lambda: ref.QuantizedKVCache(bits=8)),
    "QuantizedKVCache(bits=4)": (lambda: ours.QuantizedKVCache(bits=4), lambda: ref.QuantizedKVCache(bits=4)),
}


# Tokens decoded per setting. The ring of 64 (keep 4) after the 46-token prompt wraps at offsets
# 64 and 124: 128 tokens (offset 173) wrap it twice. The growing and quantized caches have nothing
# that changes between 64 and 128 tokens (mlx-lm allocates them in steps of 256 slots, and
# quantizes in groups along the head dimension, not along the sequence): 64 tokens reach every
# state 128 reach, and every step's logits are compared bit for bit, which a cache that differs
# fails at its first step, where equal tokens could still hide it for many.
TOKENS = {setting: 128 if "Rotating" in setting else 64 for setting in SETTINGS}


def _lockstep(loaded, mine, theirs, tokens: int) -> list[int]:
    return lockstep(loaded, mine, theirs, PROMPT, tokens)


@pytest.mark.slow  # 25-60 s each on the 2-core CI machine
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_decode_matches_mlx_lm_logit_for_logit(smollm2_mlx, setting):
    make_ours, make_theirs = SETTINGS[setting]
    layers = len(smollm2_mlx.model.layers)
    mine = [make_ours() for _ in range(layers)]
    theirs = [make_theirs() for _ in range(layers)]
    tokens = TOKENS[setting]
    ids = _lockstep(smollm2_mlx, mine, theirs, tokens)
    assert len(ids) == tokens
    assert [c.nbytes for c in mine] == [c.nbytes for c in theirs]
    view = mine[0].introspect()
    assert view.offset == len(encode_prompt(smollm2_mlx.tokenizer, PROMPT)) + tokens - 1
    if "Rotating" in setting:
        assert view.tokens_held == 64 and view.evicted == view.offset - 64


@pytest.mark.slow  # ~22 s of CPU
def test_quantize_after_start_decodes_like_mlx_lm_quantized_kv_start(smollm2_mlx):
    """Our QuantizedKVCache(start=N) inside mlx-lm's own generate_step gives the tokens that
    generate_step gives with kv_bits and quantized_kv_start=N on its default caches."""
    model = smollm2_mlx.model
    prompt = mx.array(encode_prompt(smollm2_mlx.tokenizer, PROMPT))
    start = prompt.size + 12
    steps = 40
    theirs = generate_step(
        prompt,
        model,
        max_tokens=steps,
        kv_bits=4,
        kv_group_size=64,
        quantized_kv_start=start,
        prompt_cache=ref.make_prompt_cache(model),
    )
    want = [int(t) for t, _ in theirs]
    mine = [ours.QuantizedKVCache(64, 4, start=start) for _ in model.layers]
    got = [int(t) for t, _ in generate_step(prompt, model, max_tokens=steps, prompt_cache=mine)]
    assert got == want
    assert all(c.quantized and c.bits == 4 for c in mine)


class _RoundTripKV(ref.KVCache):
    """Reference for mixed widths: mlx-lm's KVCache fed keys and values already passed
    through quantize/dequantize at 8 and 4 bits (test-only)."""

    def update_and_fetch(self, keys, values):
        def q(x, bits):
            return mx.dequantize(*mx.quantize(x, group_size=64, bits=bits), group_size=64, bits=bits)

        return super().update_and_fetch(q(keys, 8), q(values, 4))


def test_separate_key_and_value_bits_run_through_the_real_llama(smollm2_mlx):
    layers = len(smollm2_mlx.model.layers)
    mine = [ours.QuantizedKVCache(64, 8, value_bits=4) for _ in range(layers)]
    got = greedy_decode(smollm2_mlx, PROMPT, cache=mine, max_tokens=24, stop_at_eos=False)
    reference = [_RoundTripKV() for _ in range(layers)]
    want = greedy_decode(smollm2_mlx, PROMPT, cache=reference, max_tokens=24, stop_at_eos=False)
    assert got.ids == want.ids
    view = mine[0].introspect()
    assert (view.key_bits, view.value_bits, view.quantized_tokens) == (8, 4, view.tokens_held)
    assert mine[0].keys[0].dtype == mx.uint32  # stored quantized
