"""What the default probes cost per step (issue #15): each cache is read once per step (the memory
guard and the next step's mask probe reuse the views the step ended with), and the fast paths
that build the probe rows give the text the rule gives."""

from __future__ import annotations

import numpy as np
import pytest
from decode_helpers import textbook_quality

from cachelib.core.masks import visible_held
from cachelib.profile import Probes, run_profile
from cachelib.profile.backends import probe_for
from cachelib.profile.divergence import Baseline, StepQuality, compare

BACKENDS = ["mlx", "torch"]
PROMPT = "Explain what a KV cache is, and why it matters for serving language models."
STRATEGIES = ["standard", "rotating:max_size=12,keep=2", "quantized:bits=4,group_size=32"]


@pytest.mark.parametrize("one_by_one", [False, True], ids=["strategy batch", "one by one"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_cache_is_read_once_per_step(backend, one_by_one, load_model, monkeypatch):
    loaded = load_model("tiny-llama", backend)
    probe_class = type(probe_for(loaded))
    reads: list[int] = []  # id of every whole-model cache the profiler took views of
    views_of = probe_class.views_of

    def counted_views(self, cache):
        reads.append(id(cache))
        return views_of(self, [cache])[0]

    def counted_views_of(self, caches):
        reads.extend(id(c) for c in caches)
        return views_of(self, caches)

    monkeypatch.setattr(probe_class, "views", counted_views)
    monkeypatch.setattr(probe_class, "views_of", counted_views_of)
    steps = 6
    caches: dict[str, int] = {}
    profile = run_profile(
        loaded,
        STRATEGIES,
        prompt=PROMPT,
        max_tokens=steps,
        one_by_one=one_by_one,
        probes=Probes(masks=1),
        memory_limit="1GiB",  # a guard that reads views before every step
        on_step=lambda e: caches.update({k: id(c) for k, c in e.caches.items()}),
    )
    assert profile.complete and len(profile.frame("masks")) > 0
    # once after every step, and once before the first (the guard); never twice for one step
    assert {label: reads.count(cache) for label, cache in caches.items()} == {s: steps + 1 for s in profile.strategies}


@pytest.mark.parametrize("backend", BACKENDS)
def test_mask_rows_show_the_causal_rule_over_their_key_positions(backend, load_model):
    loaded = load_model("tiny-llama", backend)
    profile = run_profile(loaded, STRATEGIES, prompt=PROMPT, max_tokens=20, probes=Probes(masks=1))
    masks = profile.frame("masks")
    assert set(masks["step"]) == set(range(20))
    linear = masks[~masks["strategy"].str.startswith("rotating")]  # (a ring's sinks and window: test_profile.py)
    assert set(linear["strategy"]) == {"standard", "quantized:bits=4,group_size=32"}
    for row in linear.itertuples():
        positions = [int(p) for p in row.key_positions.split()]
        expected = "".join("1" if visible_held(row.query_position, p) else "0" for p in positions)
        assert row.mask == expected, (row.strategy, row.step, row.layer, row.query)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ring_slot_tables_are_each_layers_own(backend, load_model):
    loaded = load_model("tiny-llama", backend)
    captured: list = []
    probe = probe_for(loaded)

    def on_step(e):
        cache = e.caches["rotating:max_size=12,keep=2"]
        captured.append(
            [" ".join(map(str, v.slot_positions().tolist())) for v in probe.views(cache) if v.layout == "ring"]
        )

    profile = run_profile(loaded, STRATEGIES, prompt=PROMPT, max_tokens=16, on_step=on_step)
    slots = profile.frame("slots")
    for step, texts in enumerate(captured):
        assert list(slots[slots["step"] == step]["positions"]) == texts


_textbook_compare = textbook_quality


def test_a_shared_baseline_gives_the_textbook_numbers_bit_for_bit():
    rng = np.random.default_rng(34)
    base = (rng.standard_normal(4096) * 4).astype(np.float32)
    shared = Baseline(base)
    for k in range(20):
        logits = base + (rng.standard_normal(4096) * 0.05 * k).astype(np.float32)
        expected = _textbook_compare(base, logits, k)
        assert compare(shared, logits, k) == expected == compare(base, logits, k)
    assert shared.logprob(7) == _textbook_compare(base, base, 7)[2]
    # a row with the baseline's very logits (compared without the arithmetic) gives the same numbers
    assert compare(shared, base.copy(), 7) == _textbook_compare(base, base.copy(), 7) == (0.0, True, shared.logprob(7))


@pytest.mark.parametrize("quality, expected_steps", [(1, 6), (4, 3)])  # period 4 over 6 steps: 0, 4 and the last
def test_the_quality_probe_computes_once_per_sampled_step(quality, expected_steps, load_model, monkeypatch):
    calls: list[int] = []  # rows of each computation
    compute = StepQuality.__call__

    def counted(self, rows, target, tops=None):
        calls.append(len(rows))
        assert tops == [int(np.argmax(r)) for r in rows]  # each row's argmax, taken once in the step
        return compute(self, rows, target, tops)

    monkeypatch.setattr(StepQuality, "__call__", counted)
    loaded = load_model("tiny-llama", "mlx")
    strategies = STRATEGIES + ["rotating:max_size=8,keep=0", "quantized:bits=8"]  # 5 rows, one baseline
    profile = run_profile(loaded, strategies, prompt=PROMPT, max_tokens=6, probes=Probes(quality=quality))
    steps = profile.frame("steps")
    assert calls == [len(strategies)] * expected_steps
    assert steps["kl"].notna().sum() == expected_steps * len(strategies)


@pytest.mark.parametrize("one_by_one", [False, True], ids=["strategy batch", "one by one"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("every", "stop_after"), [(1, None), (3, None), (1, 4)], ids=["every step", "every 3rd", "stopped"]
)
def test_the_error_switch_is_on_through_sampled_forwards_only(
    backend, one_by_one, every, stop_after, load_model, monkeypatch
):
    """The quantization-error switch is flipped once for a run of sampled steps (not on and off
    every step), is on in every forward whose error is recorded and off in every other, and is off
    in every cache when the run ends, complete or stopped early."""
    loaded = load_model("tiny-llama", backend)
    probe_class = type(probe_for(loaded))
    flips: list[bool] = []
    on: dict[int, bool] = {}  # id of a cache -> its switch, as the probe last set it
    forwards: list[tuple[int, bool]] = []  # (step, switch of the quantized strategy's cache) per forward
    set_track_error, pending = probe_class.set_track_error, probe_class.pending
    step = [0]

    def counted_switch(self, cache, value):
        flips.append(value)
        on[id(cache)] = value
        return set_track_error(self, cache, value)

    def seen_pending(self, caches):
        forwards.extend((step[0], on.get(id(c), False)) for c in caches if id(c) in quantized)
        return pending(self, caches)

    quantized: set[int] = set()
    make_cache = probe_class.make_cache

    def kept_make_cache(self, spec):
        cache = make_cache(self, spec)
        if "quantized" in str(spec):
            quantized.add(id(cache))
        return cache

    def on_step(event):
        step[0] = event.step + 1

    monkeypatch.setattr(probe_class, "set_track_error", counted_switch)
    monkeypatch.setattr(probe_class, "pending", seen_pending)
    monkeypatch.setattr(probe_class, "make_cache", kept_make_cache)
    steps = 8
    profile = run_profile(
        loaded,
        STRATEGIES,
        prompt=PROMPT,
        max_tokens=steps,
        one_by_one=one_by_one,
        probes=Probes(quant_error=every),
        on_step=on_step,
        should_stop=(lambda: step[0] >= stop_after) if stop_after else None,
    )
    ran = stop_after or steps
    assert len(profile.frame("steps")) == ran * len(STRATEGIES)
    sampled = {s for s in range(ran) if Probes(quant_error=every).on("quant_error", s, s == steps - 1)}
    assert sampled and sampled != set(range(ran)) or every == 1
    assert {s for s, switched in forwards if switched} == sampled  # on exactly where sampled
    assert {s for s, _ in forwards} == set(range(ran))
    assert not any(on.values())  # off in every cache once the run is over
    # every 3rd step: each sampled step switches on and off; every step: once on, once off a cache
    assert flips.count(True) == flips.count(False) == (len(STRATEGIES) * len(sampled) if every > 1 else len(STRATEGIES))
    layers = profile.frame("layers")
    with_error = layers[layers["key_rel_rms"].notna()]
    assert set(with_error["step"]) == sampled
