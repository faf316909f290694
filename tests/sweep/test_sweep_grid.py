"""The sweep file: how a TOML grid expands into runs, and which grids are refused (with the line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachelib.sweep import GridError, load_grid, parse_grid

REPO = Path(__file__).resolve().parents[2]

BASE = """\
models = ["smollm2"]
prompts = ["Explain a KV cache."]
"""


def grid(text: str, path: str = "grid.toml"):
    return parse_grid(text, path)


def test_knob_ranges_pair_up_so_each_run_holds_the_baseline_and_every_strategy_at_one_setting():
    g = grid(
        BASE
        + """
strategies = [
    { name = "rotating", max_size = [64, 128], keep = 4 },
    "quantized:bits=[4, 8],group_size=32",
    "sliding:window=16",
]
max_tokens = 16
"""
    )
    points = g.points({"mlx": "cpu"})
    assert [[str(s) for s in p.strategies] for p in points] == [
        ["standard", "rotating:max_size=64,keep=4", "quantized:bits=4,group_size=32", "sliding:window=16"],
        ["standard", "rotating:max_size=128,keep=4", "quantized:bits=8,group_size=32", "sliding:window=16"],
    ]
    assert [p.setting for p in points] == [0, 1]
    assert all(p.max_tokens == 16 and p.device == "cpu" and p.backend == "mlx" for p in points)


def test_axes_multiply_in_order_model_backend_device_input_tokens_setting():
    g = grid(
        """
models = ["tiny-llama", "tiny-gemma3"]
backends = ["mlx", "torch"]
devices = { mlx = ["cpu"], torch = ["cpu", "cuda"] }
baseline = "concat"
strategies = ["rotating:max_size=[8,16]"]
prompts = ["one", "two"]
max_tokens = [4, 8]
"""
    )
    points = g.points()
    assert len(points) == 2 * (1 + 2) * 2 * 2 * 2
    first = points[:3]
    assert [(p.model, p.backend, p.device, p.input.content, p.max_tokens, p.setting) for p in first] == [
        ("tiny-llama", "mlx", "cpu", "one", 4, 0),
        ("tiny-llama", "mlx", "cpu", "one", 4, 1),
        ("tiny-llama", "mlx", "cpu", "one", 8, 0),
    ]
    assert all(str(p.strategies[0]) == "concat" for p in points)
    assert len({p.id for p in points}) == len(points)


def test_a_point_keeps_its_id_across_edits_that_do_not_change_the_run():
    text = BASE + 'strategies = ["rotating:max_size=[64,128]"]\nmax_tokens = 16\n'
    ids = [p.id for p in grid(text).points({"mlx": "cpu"})]
    reformatted = "# a comment\n" + text.replace("[64,128]", "[64, 128]")
    assert [p.id for p in grid(reformatted).points({"mlx": "cpu"})] == ids
    # another token count or another probe set is another run, so another file
    assert grid(text.replace("16", "17")).points({"mlx": "cpu"})[0].id not in ids
    other_probes = grid(text + 'probes = "masks=0"\n').points({"mlx": "cpu"})[0].id
    assert other_probes not in ids
    assert ids[0].startswith("smollm2-mlx-cpu-explain-a-kv-cache-16t-")


def test_each_device_asks_for_the_dask_resource_that_keeps_it_to_one_run():
    g = grid(
        BASE
        + """
backends = ["mlx", "torch"]
devices = { mlx = ["cpu", "metal"], torch = ["cpu", "cuda", "mps"] }
strategies = ["concat"]
"""
    )
    got = {(p.backend, p.device): p.resources for p in g.points()}
    assert got == {
        ("mlx", "cpu"): {},
        ("mlx", "metal"): {"MLX": 1},
        ("torch", "cpu"): {},
        ("torch", "cuda"): {"GPU": 1},
        ("torch", "mps"): {"MLX": 1},
    }


def test_the_local_cluster_gives_cpu_runs_their_processes_and_each_accelerator_one_worker():
    from cachelib.sweep.cluster import worker_specs

    devices = 'devices = { mlx = ["cpu", "metal"], torch = ["mps"] }\n'
    mixed = grid(BASE + 'backends = ["mlx", "torch"]\n' + devices + 'strategies = ["concat"]\n')
    specs = worker_specs(mixed.points(), workers=3)
    assert sorted(specs) == ["cpu-0", "cpu-1", "cpu-2", "mlx"]
    assert specs["mlx"]["options"]["resources"] == {"MLX": 1}  # MLX's metal and torch's mps share it
    assert specs["cpu-0"]["options"]["resources"] is None
    # one run per process, and Dask never pauses or kills a worker for a model's memory
    assert all(s["options"]["nthreads"] == 1 and s["options"]["memory_limit"] == 0 for s in specs.values())
    only_metal = grid(BASE + 'devices = ["metal"]\nstrategies = ["concat"]\n')
    assert sorted(worker_specs(only_metal.points())) == ["mlx"]


def test_texts_are_read_relative_to_the_grid_file(tmp_path):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "wiki.txt").write_text("The cache holds keys and values.", encoding="utf-8")
    path = tmp_path / "g.toml"
    path.write_text('models = ["tiny-llama"]\ntexts = ["texts/wiki.txt"]\nstrategies = ["concat"]\nprompt_tokens = 4\n')
    (point,) = load_grid(path).points({"mlx": "cpu"})
    kwargs = point.run_kwargs()
    assert kwargs["text"] == "The cache holds keys and values." and "prompt" not in kwargs
    assert kwargs["prompt_tokens"] == 4
    assert point.input.source == "texts/wiki.txt" and "-wiki-" in point.id


def test_run_kwargs_are_what_run_profile_takes():
    (point,) = grid(
        BASE + 'strategies = ["quantized:bits=4"]\nmax_tokens = 8\nmemory_limit = "1GB"\nchat = false\n'
    ).points({"mlx": "cpu"})
    kwargs = point.run_kwargs()
    assert kwargs["strategies"] == ["standard", "quantized:bits=4"]
    assert kwargs["memory_limit"] == 10**9 and kwargs["chat"] is False and kwargs["name"] == point.id
    assert kwargs["prompt"] == "Explain a KV cache."


def test_the_bundled_example_grid_is_valid():
    g = load_grid(REPO / "assets" / "sweeps" / "example.toml")
    points = g.points()
    assert {p.model for p in points} == {"smollm2"} and len(points) >= 2


# --- refused before anything runs, with the line and the reason ---------------------------------

BAD = {
    "unknown key": (BASE + 'strategies = ["concat"]\nmax_token = 16\n', 4, "unknown key 'max_token'"),
    "empty axis": ('models = []\nprompts = ["x"]\nstrategies = ["concat"]\n', 1, "'models' is an empty list"),
    "empty prompts": (
        'models = ["smollm2"]\nstrategies = ["concat"]\n\nprompts = []\n',
        4,
        "'prompts' is an empty list",
    ),
    "empty knob range": (BASE + 'strategies = ["rotating:max_size=[]"]\n', 3, "knob 'max_size' has an empty range"),
    "empty strategies": (BASE + "strategies = []\n", 3, "'strategies' is an empty list"),
    "unknown knob": (
        BASE + 'strategies = [\n    "quantized:bits=4",\n    "rotating:max_size=[64,128],kep=3",\n]\n',
        5,
        "unknown knob 'kep'",
    ),
    "bad knob value": (
        BASE + 'strategies = [\n  { name = "quantized", bits = [4, 7] },\n]\n',
        4,
        "'bits' = 7 is not supported",
    ),
    "unknown strategy": (BASE + 'strategies = ["rotatin:max_size=5"]\n', 3, "unknown strategy 'rotatin'"),
    "keep >= max_size": (BASE + 'strategies = ["rotating:max_size=[4, 8],keep=4"]\n', 3, "keep=4 must be < max_size=4"),
    "ranges of other lengths": (
        BASE + 'strategies = [\n  "rotating:max_size=[64,128]",\n  "quantized:bits=[2,4,8]",\n]\n',
        5,
        "knob 'bits' lists 3 values but strategies[0] max_size lists 2",
    ),
    "not on the backend": (BASE + 'strategies = ["offloaded"]\n', 3, "'offloaded' is not available on mlx"),
    "the baseline twice": (BASE + 'strategies = ["standard"]\n', 3, "standard is the baseline already"),
    "bad device": (
        BASE + 'strategies = ["concat"]\nbackends = ["torch"]\ndevices = ["metal"]\n',
        5,
        "'metal' is not a torch device",
    ),
    "unknown model": ('models = ["gpt-9"]\nprompts = ["x"]\nstrategies = ["concat"]\n', 1, "unknown model 'gpt-9'"),
    "prompts and texts": (BASE + 'texts = ["a.txt"]\nstrategies = ["concat"]\n', 3, "not both"),
    "missing text": (
        'models = ["smollm2"]\ntexts = ["nope.txt"]\nstrategies = ["concat"]\n',
        2,
        "text file 'nope.txt' not found",
    ),
    "free-running text": (
        'models = ["smollm2"]\ntexts = ["grid.toml"]\nstrategies = ["concat"]\nfree_running = true\n',
        4,
        "evaluation texts are teacher-forced",
    ),
    "bad probes": (BASE + 'strategies = ["concat"]\nprobes = "mem=1"\n', 4, "unknown probe 'mem'"),
    "bad max_tokens": (BASE + 'strategies = ["concat"]\nmax_tokens = [16, 0]\n', 4, "'max_tokens' must be >= 1"),
    "wrong type": (BASE + 'strategies = ["concat"]\nmax_tokens = "16"\n', 4, "expected integer values"),
    "bad memory limit": (BASE + 'strategies = ["concat"]\nmemory_limit = "lots"\n', 4, "is not a size"),
    "key after a table header": (
        'models = ["smollm2"]\n[[strategies]]\nname = "rotating"\nmax_size = 64\nprompts = ["x"]\n',
        5,
        "'prompts' is a grid key, not a knob",
    ),
    "not TOML": ('models = ["smollm2"\nstrategies = 3\n', 2, "not valid TOML"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_grid_is_refused_with_the_line_and_the_reason(case, tmp_path):
    text, line, reason = BAD[case]
    path = tmp_path / "grid.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(GridError) as err:
        load_grid(path)
    assert err.value.line == line, str(err.value)
    assert reason in str(err.value)
    assert str(err.value).startswith(f"{path}:{line}: ")


def test_a_missing_required_key_is_refused_naming_it():
    with pytest.raises(GridError, match="the grid needs 'strategies'"):
        grid(BASE)
    with pytest.raises(GridError, match="needs 'prompts'"):
        grid('models = ["smollm2"]\nstrategies = ["concat"]\n')


def test_a_missing_grid_file_is_refused(tmp_path):
    with pytest.raises(GridError, match="no such grid file"):
        load_grid(tmp_path / "nope.toml")
