"""Ada-KV's per-head budgets as a SnapKV option (``snapkv:adaptive=1,safeguard=P``): a layer
keeps ``budget x kv_heads`` tokens, each KV head at least its window and ``P``% of ``budget``,
the rest going to the best scores across the layer's heads. Heads then hold different counts:
storage is padded per head, the padding is masked out of attention by the capture hook on both
backends, both backends keep the same positions, the used bytes are the planner's exactly and
the allocated (padded) bytes stay within the planner's bound."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from cachelib.core.importance import policy_of, select, select_heads
from cachelib.mlx import hooks as mlx_hooks
from cachelib.mlx.factory import make_cache as mlx_make_cache
from cachelib.mlx.importance import ImportanceKVCache
from cachelib.plan import arch_from_model_info, trace
from cachelib.profile import Probes, run_profile
from cachelib.spec import SpecError, parse_spec
from cachelib.torch import hooks as torch_hooks
from cachelib.torch.factory import make_cache as torch_make_cache
from cachelib.torch.importance import ImportanceLayer

PROMPT = (
    "Summarise the rules of chess in a few short sentences, please, and then list the pieces "
    "with how each of them moves on the board."
)
ADAPTIVE = "snapkv:budget=12,window=2,adaptive=1,safeguard=20"
EVEN = "snapkv:budget=12,window=2,adaptive=1,safeguard=100"  # every head its budget: plain SnapKV
PLAIN = "snapkv:budget=12,window=2"


@pytest.mark.parametrize("seed", range(4))
def test_heads_share_the_budget_each_keeping_its_window_and_safeguard(seed):
    rng = np.random.default_rng(seed)
    B, H, T, keep, protect, safe = 2, 4, 30, 8, 2, 3
    scores = rng.standard_normal((B, H, T)).astype(np.float32) * rng.uniform(0.1, 5, (1, H, 1)).astype(np.float32)
    slots, counts = select_heads(scores, keep, protect, safe)
    assert counts.sum(-1).tolist() == [keep * H] * B and counts.min() >= safe
    assert slots.shape == (B, H, counts.max())
    for b in range(B):
        for h in range(H):
            kept = slots[b, h, : counts[b, h]]
            assert (slots[b, h, counts[b, h] :] == -1).all() and (np.diff(kept) > 0).all()
            assert {T - 2, T - 1} <= set(kept.tolist())  # the window
    # the heads' extra slots are the row's best scores left after each head's safe ones
    b = 0
    safe_sets = select(scores[b : b + 1], safe, protect)[0]
    extra = [(scores[b, h, s], h, s) for h in range(H) for s in range(T - protect) if s not in safe_sets[h]]
    best = sorted(extra, key=lambda x: -x[0])[: (keep - safe) * H]
    for _, h, s in best:
        assert s in slots[b, h]


def test_a_full_safeguard_is_plain_snapkv_selection():
    scores = np.random.default_rng(5).standard_normal((1, 3, 20)).astype(np.float32)
    slots, counts = select_heads(scores, 7, 2, 7)
    np.testing.assert_array_equal(slots, select(scores, 7, 2))
    assert counts.tolist() == [[7, 7, 7]]


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("snapkv:budget=32,safeguard=10", "give adaptive=1"),
        ("snapkv:budget=32,adaptive=1,safeguard=101", "must be <= 100"),
        ("snapkv:budget=32,adaptive=1,safeguard=-1", "must be >= 0"),
        ("snapkv:budget=32,adaptive=2", "allowed: 0, 1"),
        ("snapkv:budget=8,adaptive=1", "allowed budget: 17.."),
    ],
)
def test_bad_adaptive_knobs_name_the_allowed_range(text, fragment):
    with pytest.raises(SpecError, match=fragment.replace(".", r"\.")):
        parse_spec(text)


def _reference(q, k, v, valid, scale):
    """Per query head, softmax attention over its KV head's valid slots only (numpy, float64)."""
    B, h_q, L, _ = q.shape
    h_kv, S = k.shape[1], k.shape[2]
    out = np.zeros((B, h_q, L, v.shape[-1]))
    for b in range(B):
        for h in range(h_q):
            g = h // (h_q // h_kv)
            for i in range(L):
                seen = valid[b, g] & (np.arange(S) <= S - L + i)
                logits = (k[b, g, seen] @ q[b, h, i]) * scale
                w = np.exp(logits - logits.max())
                out[b, h, i] = (w / w.sum()) @ v[b, g, seen]
    return out


@pytest.fixture
def padded_layers(load_model):
    """An MLX and a torch layer fed the same arrays until the heads hold different counts (inside
    both capture hooks, which such layers require; the tiny model only opens the blocks)."""
    rng = np.random.default_rng(3)
    policy = policy_of(parse_spec("snapkv:budget=6,window=2,adaptive=1,safeguard=0"))
    B, h_kv, h_q, D = 2, 2, 4, 8
    ours, twin = ImportanceKVCache(policy), ImportanceLayer(policy)
    scale = np.array([[[[4.0]], [[0.3]]]], dtype=np.float32)  # head 0 peaked, head 1 flat
    mlx_model, torch_model = load_model("tiny-llama", "mlx").model, load_model("tiny-llama", "torch").model
    with mlx_hooks.capture(mlx_model), torch_hooks.capture(torch_model):
        for n in (20, 1, 1):
            k = rng.standard_normal((B, h_kv, n, D)).astype(np.float32) * scale
            v = rng.standard_normal((B, h_kv, n, D)).astype(np.float32)
            q = rng.standard_normal((B, h_q, n, D)).astype(np.float32)
            ka, va = ours.update_and_fetch(mx.array(k), mx.array(v))
            kb, vb = twin.update(torch.from_numpy(k), torch.from_numpy(v))
            ours.observe(mx.array(q), None)
            twin.observe(torch.from_numpy(q), None)
    return ours, twin, (np.array(ka), np.array(va), kb.numpy(), vb.numpy()), rng


def test_padded_heads_hold_the_same_slots_on_both_backends_and_count_bytes_honestly(padded_layers):
    ours, twin, (ka, va, kb, vb), _ = padded_layers
    np.testing.assert_array_equal(ours.positions, twin.positions)
    np.testing.assert_array_equal(ka, kb)
    np.testing.assert_array_equal(va, vb)
    valid = ours.positions >= 0
    assert not valid.all()  # the heads keep different counts
    assert (valid.sum((1, 2)) == 6 * 2 + 2 * 2).all()  # budget x heads per row, plus 2 appended on each head
    assert (ka[~valid] == 0).all()  # padding is zeros
    a, b = ours.introspect(), twin.introspect()
    assert a.tokens_held == b.tokens_held == 6 + 2 and a.capacity == b.capacity == ka.shape[2]
    assert a.bytes_allocated == b.bytes_allocated == ka.nbytes * 2
    assert a.bytes_used == b.bytes_used == 2 * ka.nbytes * valid.sum() // valid.size


@pytest.mark.parametrize("L", [1, 3])
def test_the_merged_mask_hides_each_heads_padding_on_both_backends(L, padded_layers):
    ours, twin, (ka, va, kb, vb), rng = padded_layers
    valid = ours.positions >= 0
    q = rng.standard_normal((2, 4, L, 8)).astype(np.float32)
    want = _reference(q, ka, va, valid, 8**-0.5)
    mask = mlx_hooks.merge_head_mask(None if L == 1 else "causal", ours.head_mask, mx.array(q))
    got = mx.fast.scaled_dot_product_attention(
        mx.array(q), mx.repeat(mx.array(ka), 2, axis=1), mx.repeat(mx.array(va), 2, axis=1), scale=8**-0.5, mask=mask
    )
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-5)
    qt = torch.from_numpy(q)
    kt, vt = torch.from_numpy(kb).repeat_interleave(2, 1), torch.from_numpy(vb).repeat_interleave(2, 1)
    S = ka.shape[2]
    causal = torch.arange(S)[None, :] <= torch.arange(S - L, S)[:, None]
    additive = torch.where(causal, 0.0, torch.finfo(torch.float32).min).expand(2, 1, L, S)
    for given in (None, causal.expand(2, 1, L, S), additive):  # sdpa's None or boolean, eager's additive
        mask = torch_hooks.merge_head_mask(given, twin.head_mask, qt)
        if mask.dtype == torch.bool:
            got = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
        else:
            got = torch.softmax(qt @ kt.transpose(-1, -2) * 8**-0.5 + mask, -1) @ vt
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5)


def _profile(loaded):
    probes = Probes(memory=1, ring=1, quant_error=0, quality=1, masks=0, system=0)
    profile = run_profile(loaded, ["standard", ADAPTIVE, EVEN, PLAIN], prompt=PROMPT, max_tokens=6, probes=probes)
    assert profile.complete, profile.meta["reason"]
    return profile


@pytest.fixture(scope="module")
def profiles(smollm2_mlx, smollm2_torch):
    return {"mlx": (smollm2_mlx, _profile(smollm2_mlx)), "torch": (smollm2_torch, _profile(smollm2_torch))}


def _kept(profile):
    slots = profile.frame("slots")
    slots = slots[slots["head"].notna()]
    return slots[["strategy", "step", "layer", "head", "positions"]].reset_index(drop=True)


def test_both_backends_keep_the_same_positions_per_head_and_heads_differ(profiles):
    mine, theirs = _kept(profiles["mlx"][1]), _kept(profiles["torch"][1])
    assert len(mine) == len(theirs) > 0
    assert mine.equals(theirs), mine[mine.positions != theirs.positions].head()
    last = mine[(mine.step == mine.step.max()) & (mine.strategy == ADAPTIVE)]
    counts = [sum(p != "-1" for p in text.split()) for text in last.positions]
    assert len(set(counts)) > 1
    even = mine[mine.strategy == EVEN].drop(columns="strategy").reset_index(drop=True)
    plain = mine[mine.strategy == PLAIN].drop(columns="strategy").reset_index(drop=True)
    assert even.equals(plain)  # a 100% safeguard is plain SnapKV


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_used_bytes_are_the_planners_and_allocated_bytes_within_its_bound(profiles, backend):
    loaded, profile = profiles[backend]
    arch, info = arch_from_model_info(loaded.info), loaded.info
    prompt = int(profile.meta["prompt_tokens"])
    steps = profile.frame("steps")
    for label in (ADAPTIVE, EVEN):
        planned = trace(arch, label, info.backend, updates=[prompt] + [1] * 5, dtype=info.dtype).steps
        mine = steps[steps["strategy"] == label]
        assert mine["cache_bytes_used"].tolist() == [s.bytes_used for s in planned], label
        allocated = mine["cache_bytes_allocated"].tolist()
        assert all(u <= a <= p.bytes_allocated for u, a, p in zip(mine["cache_bytes_used"], allocated, planned))
    padded = steps[steps["strategy"] == ADAPTIVE]
    assert (padded["cache_bytes_allocated"] > padded["cache_bytes_used"]).iloc[1:].all()  # padding is counted


def test_padded_heads_refuse_to_run_without_the_hook(smollm2_mlx, smollm2_torch):
    ids = smollm2_mlx.tokenizer.encode(PROMPT)
    model = smollm2_mlx.model
    cache = mlx_make_cache(model, ADAPTIVE)
    with mlx_hooks.capture(model):
        model(mx.array([ids]), cache=cache)
    with pytest.raises(ValueError, match="hooks.capture"):
        model(mx.array([[5]]), cache=cache)
    model = smollm2_torch.model
    cache = torch_make_cache(model, ADAPTIVE)
    with torch.inference_mode():
        with torch_hooks.capture(model):
            model(input_ids=torch.tensor([ids]), cache=cache)
        with pytest.raises(ValueError, match="hooks.capture"):
            model(input_ids=torch.tensor([[5]]), cache=cache)
