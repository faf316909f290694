"""The strategy table is the one place that knows a strategy: every entry's builders resolve on
the backends it names, its facts drive the planner, and a strategy added to the table alone
(plus one builder per backend, here in this file) runs end to end: both backends' caches, the
profiler, the planner's exact bytes, the sweep grid and the app's strategy editor."""

from __future__ import annotations

import pytest

from cachelib.core.layout import LayerLayout
from cachelib.core.units import BACKENDS
from cachelib.plan import arch_from_model_info, cache_layout, preset, trace
from cachelib.profile import Probes, run_profile
from cachelib.spec import STRATEGIES, Knob, SpecError, Strategy, mlx_flags, parse_spec, spec_from_mlx_flags
from cachelib.sweep import parse_grid

EXAMPLES = {
    "standard": "standard",
    "concat": "concat",
    "rotating": "rotating:max_size=64,keep=4",
    "quantized": "quantized:bits=4",
    "kivi": "kivi",
    "chunked": "chunked:chunk_size=64",
    "static": "static:max_len=256",
    "sliding": "sliding:window=64",
    "offloaded": "offloaded",
    "knorm": "knorm:budget=256",
    "snapkv": "snapkv:budget=256,window=32",
    "pyramidkv": "pyramidkv:budget=640,window=32,beta=20",
    "tova": "tova:budget=256",
    "h2o": "h2o:budget=256,recent=32",
    "fp8": "fp8",
    "q8_0": "q8_0",
    "q4_0": "q4_0",
}


def test_every_strategy_has_an_example_here():
    assert set(EXAMPLES) == set(STRATEGIES)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_plans_on_every_backend_it_runs_on(name):
    """A hybrid model (sliding and full layers) planned through the table, per backend."""
    arch = preset("gemma-3-27b")
    spec = parse_spec(EXAMPLES[name])
    for backend in spec.strategy.backends:
        layout = cache_layout(arch, spec, backend)
        assert len(layout) == len(arch.layer_kinds)
        run = trace(arch, spec, backend, updates=[100] + [1] * 10)
        assert run.steps[-1].bytes_allocated > 0


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_builder_the_table_names_resolves(name):
    strategy = STRATEGIES[name]
    assert strategy.backends, f"{name} runs on no backend"
    for backend in BACKENDS:
        if backend in strategy.backends:
            assert callable(strategy.builder(backend))
        else:
            with pytest.raises(SpecError, match=f"not available on {backend}"):
                strategy.builder(backend)


def test_facts_come_from_the_table():
    spec = parse_spec
    assert spec("rotating:max_size=512").window == 512
    assert spec("sliding:window=100").window == 100
    assert spec("chunked:chunk_size=256").window == 256
    assert spec("standard").window is None and spec("quantized").window is None
    assert spec("static:max_len=300").max_context == 300 and spec("standard").max_context is None
    assert [n for n, s in STRATEGIES.items() if s.lossless] == ["standard", "concat", "static", "offloaded"]
    assert STRATEGIES["offloaded"].backends == ("torch",)


def test_runtime_and_importance_facts_come_from_the_table():
    spec = parse_spec
    assert [n for n, s in STRATEGIES.items() if s.reference] == ["standard"]
    assert spec("static:max_len=300").transformers_cache == "StaticCache(config=model.config, max_cache_len=300)"
    assert spec("kivi").transformers_cache is None
    importance = {n: s.importance for n, s in STRATEGIES.items() if s.importance is not None}
    assert set(importance) == {"knorm", "snapkv", "pyramidkv", "tova", "h2o"}
    assert [n for n, m in importance.items() if not m.needs_queries] == ["knorm"]
    assert [n for n, m in importance.items() if m.compress_once] == ["snapkv", "pyramidkv"]
    assert spec("pyramidkv:budget=640,window=32,beta=20").smallest_window == 32
    assert spec("snapkv:budget=640").smallest_window == 640 == spec("snapkv:budget=640").window
    # mlx_flags inverts spec_from_mlx_flags; a spec no flags build has none
    for flags in ({}, {"max_kv_size": 512}, {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 7}):
        built = spec_from_mlx_flags(**flags)
        assert spec_from_mlx_flags(**mlx_flags(built)).key == built.key
    assert mlx_flags("rotating:max_size=64,keep=0") is None and mlx_flags("kivi") is None


def test_spec_errors_name_the_knob_at_fault():
    for text, knob in [
        ("rotating:max_size=0", "max_size"),
        ("rotating:max_size=8,keep=8", "keep"),
        ("rotating:max_size=8,bogus=1", "bogus"),
        ("quantized:bits=7", "bits"),
        ("rotating", "max_size"),
    ]:
        with pytest.raises(SpecError) as e:
            parse_spec(text)
        assert e.value.knob == knob, text
        assert knob in str(e.value)


# --- a strategy added to the table alone ---------------------------------------------------------
# A ring without sink tokens, named by its size: the smallest strategy that needs its own knob.


def _mlx_build(spec):
    from cachelib.mlx.rotating import RotatingKVCache

    return RotatingKVCache(spec.get("size"), keep=0)


def _torch_build(spec, config):
    from cachelib.torch.rotating import RotatingKVCache

    return RotatingKVCache(spec.get("size"), 0, config=config)


ADDED = Strategy(
    "sinkless",
    "a ring of `size` tokens without attention sinks (test-only)",
    (Knob("size", "tokens held at most", required=True, min=1),),
    plan=lambda spec, backend: LayerLayout("RotatingKVCache", "full", (("max_size", spec.get("size")), ("keep", 0))),
    mlx=f"{__name__}:_mlx_build",
    torch=f"{__name__}:_torch_build",
    window="size",
)


@pytest.fixture
def added(monkeypatch):
    monkeypatch.setitem(STRATEGIES, ADDED.name, ADDED)
    return parse_spec("sinkless:size=16")


def test_an_added_strategy_parses_plans_and_joins_a_sweep_grid(added):
    assert added.window == 16 and not added.lossless
    arch = preset("llama-3.1-8b")
    layout = cache_layout(arch, added, "mlx")
    assert {c.describe() for c in layout} == {"RotatingKVCache(max_size=16, keep=0)"}
    grid = parse_grid('models = ["smollm2"]\nprompts = ["hi"]\nstrategies = ["sinkless:size=[8, 16]"]\n')
    assert [str(p.strategies[1]) for p in grid.points({"mlx": "cpu"})] == ["sinkless:size=8", "sinkless:size=16"]
    with pytest.raises(SpecError) as e:
        parse_spec("sinkless:size=0")
    assert e.value.knob == "size"


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_an_added_strategy_profiles_on_both_backends_with_exact_planned_bytes(added, backend, load_model):
    loaded = load_model("tiny-gemma3", backend)
    probes = Probes(memory=1, ring=1, quant_error=0, quality=1, masks=0, system=0)
    prompt = "Summarise the rules of chess in a few short sentences, please."
    profile = run_profile(loaded, ["standard", added], prompt=prompt, max_tokens=24, probes=probes)
    assert profile.complete, profile.meta["reason"]
    arch = arch_from_model_info(loaded.info)
    steps = profile.frame("steps")
    mine = steps[steps["strategy"] == str(added)]
    prompt_tokens = int(profile.meta["prompt_tokens"])
    planned = trace(arch, added, backend, updates=[prompt_tokens] + [1] * 23, dtype=loaded.info.dtype)
    assert mine["cache_bytes_allocated"].tolist() == [s.bytes_allocated for s in planned.steps]
    # the ring holds its size and no more, on the full-attention layers the strategy replaced
    layers = profile.frame("layers")
    last = layers[(layers["strategy"] == str(added)) & (layers["step"] == layers["step"].max())]
    full = [i for i, kind in enumerate(arch.layer_kinds) if kind == "full"]
    assert set(last[last["layer"].isin(full)]["tokens_held"]) == {16}


def test_the_app_strategy_editor_offers_an_added_strategy(added):
    from app import widgets

    rows = [{"name": "standard", "knobs": {}}, {"name": "sinkless", "knobs": {"size": 32}}]
    assert [str(s) for s in widgets.specs_of(rows, "torch")] == ["standard", "sinkless:size=32"]
