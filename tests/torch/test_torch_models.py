"""Our caches inside real transformers model code (tiny presets with random weights: llama,
gemma3 with sliding + global layers, mamba): ``model(..., cache=ours)`` and
``model.generate(..., cache=ours)`` run unchanged and give transformers' outputs;
the ring buffer computes exactly the attention its slot table promises; offloading, the
encoder-decoder cache and ``make_cache``'s layer choices."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import BartConfig, BartForConditionalGeneration
from transformers import cache_utils as tf

import cachelib.torch as ct

PRESETS = ["tiny-llama", "tiny-gemma3", "tiny-mamba"]
PROMPT = torch.tensor([[1, 523, 9001, 42, 7, 311, 8, 2048, 77, 5, 19, 600, 4000, 12, 13, 901]])


def _generate(model, cache, n=16, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # a deprecated keyword (past_key_values=) fails
        return model.generate(PROMPT, max_new_tokens=n, do_sample=False, cache=cache, **kw)


def _forward_logits(model, cache, steps=6):
    """Prefill the prompt, then decode ``steps`` tokens (teacher-forced): all logits."""
    out = []
    with torch.no_grad():
        out.append(model(PROMPT, cache=cache, use_cache=True).logits)
        for t in range(steps):
            out.append(model(torch.tensor([[100 + t]]), cache=cache, use_cache=True).logits)
    return out


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_forward_with_our_cache_gives_transformers_logits(tiny, preset, kind):
    model = tiny(preset)
    if kind == "dynamic":
        ours, theirs = ct.DynamicCache(config=model.config), tf.DynamicCache(config=model.config)
    else:
        ours, theirs = ct.StaticCache(model.config, max_cache_len=40), tf.StaticCache(model.config, max_cache_len=40)
    for a, b in zip(_forward_logits(model, ours), _forward_logits(model, theirs)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("preset", PRESETS)
def test_generate_with_our_caches_gives_transformers_tokens(tiny, preset):
    """Every strategy that keeps all tokens at full precision decodes what transformers'
    DynamicCache decodes, through generate(cache=ours)."""
    model = tiny(preset)
    want = model.generate(PROMPT, max_new_tokens=16, do_sample=False, cache=tf.DynamicCache(config=model.config))
    caches = {
        "DynamicCache": ct.DynamicCache(config=model.config),
        "StaticCache": ct.StaticCache(model.config, max_cache_len=64),
        "standard": ct.make_cache(model, "standard"),
        "rotating, never full": ct.make_cache(model, "rotating:max_size=64,keep=4"),
        "chunked, never full": ct.make_cache(model, "chunked:chunk_size=64"),
        "offloaded": ct.make_cache(model, "offloaded"),
    }
    for name, cache in caches.items():
        assert torch.equal(_generate(model, cache), want), name


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize(
    "spec",
    [
        "quantized:bits=8,group_size=32",
        "kivi:bits=4,group_size=32,residual=8",
        "rotating:max_size=8,keep=2,bits=4,group_size=32",
        "sliding:window=6",
    ],
)
def test_lossy_strategies_run_through_generate(tiny, preset, spec):
    model = tiny(preset)
    cache = ct.make_cache(model, spec)
    out = _generate(model, cache, n=12)
    assert out.shape == (1, PROMPT.shape[1] + 12)
    if preset != "tiny-mamba":
        assert cache.get_seq_length() == PROMPT.shape[1] + 11  # the last token is never fed back


def _ring_mask(total: int, n_new: int, max_size: int, keep: int) -> torch.Tensor:
    """(1, 1, n_new, total) boolean mask of what a RotatingKVCache(max_size, keep) lets the
    newest ``n_new`` of ``total`` tokens see, one token at a time: the sinks and the last
    ``max_size - keep`` tokens."""
    q = torch.arange(total - n_new, total).unsqueeze(-1)
    p = torch.arange(total).unsqueeze(0)
    return ((p <= q) & ((p < keep) | (p > q - (max_size - keep)))).view(1, 1, n_new, total)


def test_ring_buffer_attends_to_exactly_the_sinks_and_the_window(tiny):
    """Decoding far past max_size: our ring (slots out of temporal order, O(1) writes) gives
    the logits of a full cache whose mask shows only the sinks and the most recent tokens."""
    model = tiny("tiny-llama")
    max_size, keep = 12, 3
    ring = ct.RotatingKVCache(max_size, keep, config=model.config)
    full = tf.DynamicCache(config=model.config)
    prompt = PROMPT[:, :10]  # fits in the ring: no window inside the prefill
    with torch.no_grad():
        a = model(prompt, cache=ring).logits
        b = model(prompt, cache=full).logits
        torch.testing.assert_close(a, b)
        for t in range(40):
            x = torch.tensor([[200 + 7 * t]])
            a = model(x, cache=ring).logits
            total = full.get_seq_length() + 1
            b = model(x, cache=full, attention_mask=_ring_mask(total, 1, max_size, keep)).logits
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert ring.layers[0].introspect().tokens_held == max_size


def test_ring_buffer_on_gemma3_global_layers_with_sliding_layers_untouched(tiny):
    """gemma3: the ring replaces the global layers' cache, the sliding layers keep theirs;
    reference masks given per layer type."""
    model = tiny("tiny-gemma3")
    window = model.config.sliding_window
    max_size, keep = 20, 2
    ring = ct.make_cache(model, f"rotating:max_size={max_size},keep={keep}")
    full = tf.DynamicCache()
    with torch.no_grad():
        torch.testing.assert_close(model(PROMPT, cache=ring).logits, model(PROMPT, cache=full).logits)
        for t in range(45):
            x = torch.tensor([[300 + 5 * t]])
            total = full.get_seq_length() + 1
            q, p = total - 1, torch.arange(total)
            masks = {
                "full_attention": _ring_mask(total, 1, max_size, keep),
                "sliding_attention": ((p <= q) & (p > q - window)).view(1, 1, 1, total),
            }
            a = model(x, cache=ring).logits
            b = model(x, cache=full, attention_mask=masks).logits
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_ring_multi_token_chunk_sees_all_held_tokens_causally(tiny):
    """A multi-token update on a filled ring returns sinks + recent tokens + the new ones;
    its mask (from get_mask_sizes) lets each new token see all held ones and the new ones
    before it: equal to a full cache masked that way."""
    model = tiny("tiny-llama")
    max_size, keep = 10, 2
    ring = ct.RotatingKVCache(max_size, keep, config=model.config)
    full = tf.DynamicCache(config=model.config)
    with torch.no_grad():
        model(PROMPT[:, :8], cache=ring)
        model(PROMPT[:, :8], cache=full)
        for t in range(6):  # wrap the ring
            x = torch.tensor([[50 + t]])
            model(x, cache=ring)
            model(x, cache=full, attention_mask=_ring_mask(full.get_seq_length() + 1, 1, max_size, keep))
        chunk = PROMPT[:, 8:13]
        held_before = _ring_mask(full.get_seq_length() + 1, 1, max_size, keep)[0, 0, 0, :-1]
        total = full.get_seq_length() + chunk.shape[1]
        mask = torch.zeros(1, 1, chunk.shape[1], total, dtype=torch.bool)
        mask[..., : total - chunk.shape[1]] = held_before  # the held tokens (what the ring returns)
        mask[..., total - chunk.shape[1] :] = torch.ones(chunk.shape[1], chunk.shape[1]).tril().bool()
        torch.testing.assert_close(
            model(chunk, cache=ring).logits, model(chunk, cache=full, attention_mask=mask).logits, rtol=1e-4, atol=1e-4
        )


def test_make_cache_gives_each_layer_type_its_own_layer(tiny):
    gemma = tiny("tiny-gemma3")
    types = gemma.config.layer_types
    expect = {
        "standard": ct.KVCacheLayer,
        "concat": ct.DynamicLayer,
        "rotating:max_size=64": ct.RotatingKVCacheLayer,
        "quantized:bits=4,group_size=32": ct.QuantizedKVCacheLayer,
        "kivi:bits=2,group_size=32": ct.QuantizedLayer,
        "chunked:chunk_size=32": ct.ChunkedKVCacheLayer,
        "static:max_len=128": ct.StaticLayer,
        "offloaded": ct.DynamicLayer,
    }
    for spec, full_cls in expect.items():
        cache = ct.make_cache(gemma, spec)
        window_cls = ct.StaticSlidingWindowLayer if spec.startswith("static") else ct.DynamicSlidingWindowLayer
        got = [type(layer) for layer in cache.layers]
        assert got == [full_cls if t == "full_attention" else window_cls for t in types], spec
        for layer, t in zip(cache.layers, types):
            if t == "sliding_attention":
                assert layer.sliding_window == gemma.config.sliding_window
    sliding = ct.make_cache(gemma, "sliding:window=8")
    assert isinstance(sliding, ct.DynamicCache)
    assert all(isinstance(x, ct.DynamicSlidingWindowLayer) and x.sliding_window == 8 for x in sliding.layers)
    assert ct.make_cache(gemma, "offloaded").offloading
    mamba = tiny("tiny-mamba")
    for spec in expect:
        assert all(isinstance(x, ct.LinearAttentionLayer) for x in ct.make_cache(mamba, spec).layers), spec


def test_make_cache_rejects_a_group_size_that_does_not_divide_head_dim(tiny):
    model = tiny("tiny-llama")  # head_dim 64
    with pytest.raises(ValueError, match="group_size=128 must divide head_dim=64"):
        ct.make_cache(model, "quantized:bits=4,group_size=128")
    with pytest.raises(ValueError, match="key_bits=3 is not supported on torch; allowed: 2, 4, 8"):
        ct.make_cache(model, "quantized:bits=3")


def test_offloading_prefetches_the_next_layer_and_offloads_the_current_one(tiny, monkeypatch):
    """CPU path of offloading: transfers are no-ops, the call order is transformers' (prefetch
    layer i+1, update layer i, offload layer i), and the outputs do not change."""
    model = tiny("tiny-llama")
    cache = ct.DynamicCache(config=model.config, offloading=True)
    calls = []
    for i, layer in enumerate(cache.layers):
        for name in ("prefetch", "offload", "update"):
            real = getattr(layer, name)
            monkeypatch.setattr(layer, name, lambda *a, _r=real, _n=name, _i=i: (calls.append((_n, _i)), _r(*a))[1])
    got = _forward_logits(model, cache, steps=2)
    want = _forward_logits(model, tf.DynamicCache(config=model.config), steps=2)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    n = len(cache.layers)
    one_forward = [c for i in range(n) for c in (("prefetch", (i + 1) % n), ("update", i), ("offload", i))]
    assert calls == one_forward * 3
    assert all(t.device.type == "cpu" for layer in cache.layers for t in layer.held_arrays())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA prefetch-stream path needs a CUDA device")
def test_offloading_on_cuda_keeps_layers_on_the_host_between_uses(tiny):
    model = tiny("tiny-llama").to("cuda")
    try:
        cache = ct.DynamicCache(config=model.config, offloading=True)
        with torch.no_grad():
            a = model(PROMPT.cuda(), cache=cache).logits
            b = model(PROMPT.cuda(), cache=tf.DynamicCache(config=model.config)).logits
        torch.testing.assert_close(a, b)
        assert cache.prefetch_stream is not None
        devices = [layer.keys.device.type for layer in cache.layers]
        assert devices[1:] == ["cpu"] * (len(devices) - 1) and devices[0] == "cuda"  # layer 0 prefetched for next step
    finally:
        model.to("cpu")


def test_encoder_decoder_cache_drives_bart_generate_like_transformers():
    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=128,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
    )
    model = BartForConditionalGeneration(config).eval()
    src = torch.tensor([[0, 5, 17, 33, 9, 2]])
    kw = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False)
    want = model.generate(src, cache=tf.EncoderDecoderCache(tf.DynamicCache(), tf.DynamicCache()), **kw)
    ours = ct.EncoderDecoderCache(ct.DynamicCache(), ct.DynamicCache())
    got = model.generate(src, cache=ours, **kw)
    assert torch.equal(got, want) and want.shape[1] == 11
    assert ours.get_seq_length() == want.shape[1] - 1  # every decoder token but the last was fed back
    assert all(ours.is_updated.values())  # cross-attention K/V computed once, then reused
    views = ours.introspect()
    assert len(views) == 4 and views[2].tokens_held == src.shape[1]  # cross-attention holds the source


@pytest.mark.parametrize(
    "spec",
    [
        "concat",
        "standard",
        "static:max_len=64",
        "rotating:max_size=12,keep=2",
        "quantized:bits=4,group_size=32",
        "kivi:bits=4,group_size=32,residual=4",
    ],
)
def test_reset_makes_a_cache_decode_again_as_if_new(tiny, spec):
    model = tiny("tiny-gemma3")
    cache = ct.make_cache(model, spec)
    first = _forward_logits(model, cache, steps=8)
    cache.reset()
    assert cache.get_seq_length() == 0
    for a, b in zip(first, _forward_logits(model, cache, steps=8)):
        assert torch.equal(a, b)


def test_early_initialization_allocates_static_layers_before_the_first_forward(tiny):
    model = tiny("tiny-gemma3")
    text = model.config
    ours, theirs = ct.StaticCache(text, max_cache_len=32), tf.StaticCache(text, max_cache_len=32)
    for c in (ours, theirs):
        c.early_initialization(1, text.num_key_value_heads, text.head_dim, torch.float32, "cpu")
    assert ours.is_initialized and theirs.is_initialized
    assert ours.nbytes == sum(layer.keys.nbytes + layer.values.nbytes for layer in theirs.layers)
    for a, b in zip(_forward_logits(model, ours, steps=3), _forward_logits(model, theirs, steps=3)):
        assert torch.equal(a, b)


def test_dynamic_cache_round_trips_through_its_per_layer_tensors(tiny):
    """``DynamicCache(ddp_cache_data)``: the (keys, values, window) triples a cache iterates
    over rebuild an equal cache (what DDP gathering relies on)."""
    model = tiny("tiny-gemma3")
    cache = ct.DynamicCache(config=model.config)
    _forward_logits(model, cache, steps=2)
    rebuilt = ct.DynamicCache(list(cache))
    assert [type(x) for x in rebuilt.layers] == [type(x) for x in cache.layers]
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(rebuilt.layers, cache.layers))
    assert [rebuilt.get_mask_sizes(1, i) for i in range(len(cache))] == [
        cache.get_mask_sizes(1, i) for i in range(len(cache))
    ]


NEEDS_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="transformers' offloading=True cache needs a CUDA device to offload from"
)


@pytest.mark.parametrize("spec", ["standard", "static:max_len=64", pytest.param("offloaded", marks=NEEDS_CUDA)])
def test_the_plans_transformers_command_runs_as_printed(tiny, spec):
    """The planner's answer for transformers is a line of Python: run it as printed (its keyword
    is the installed transformers' own, so a deprecated one fails here) and check the cache it
    names held the tokens."""
    from cachelib.plan import PlanRequest
    from cachelib.plan.answer import runtime_command

    line = runtime_command(PlanRequest([spec], context=64, runtime="transformers"), spec, "m")
    model = tiny("tiny-llama")
    scope = {"model": model, "inputs": {"input_ids": PROMPT}, **vars(tf)}
    call = line.split("  #")[0].replace("model.generate(", "model.generate(max_new_tokens=4, do_sample=False, ", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = eval(call, scope)  # noqa: S307 (the tool's own output, run as its user would)
    assert out.shape == (1, PROMPT.shape[1] + 4)
    want = model.generate(PROMPT, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, want)
