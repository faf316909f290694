"""The on-disk cache of a GGUF's weights as loaded: a second cold load reads it instead of
dequantizing, gives the very same model, and a damaged, stale or switched-off cache never
breaks a load. Runs on a tiny llama GGUF written here (Q8_0 embeddings, Q4_1 projections)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from cachelib.models import gguf, weights_cache


def write_tiny_gguf(path, seed=0, hidden=64, layers=2, heads=2, kv_heads=1, ffn=96, vocab=128):
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)

    def tensor(name, shape, qtype=None):
        a = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if qtype is None:
            w.add_tensor(name, a)
        else:
            q = quantize(a, qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)

    kv = kv_heads * hidden // heads
    tensor("token_embd.weight", (vocab, hidden), Q.Q8_0)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", (hidden,))
        tensor(f"blk.{i}.ffn_norm.weight", (hidden,))
        for part, shape in [
            ("attn_q", (hidden, hidden)),
            ("attn_k", (kv, hidden)),
            ("attn_v", (kv, hidden)),
            ("attn_output", (hidden, hidden)),
            ("ffn_gate", (ffn, hidden)),
            ("ffn_up", (ffn, hidden)),
            ("ffn_down", (hidden, ffn)),
        ]:
            tensor(f"blk.{i}.{part}.weight", shape, Q.Q4_1)
    tensor("output_norm.weight", (hidden,))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHELIB_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(weights_cache.ENV, raising=False)
    return tmp_path / "home"


@pytest.fixture
def tiny(tmp_path):
    return write_tiny_gguf(tmp_path / "tiny.gguf")


IDS = [[1, 5, 7, 9, 11]]


def build(path, backend, quantized=False):
    """(last-position logits, the stages reported) of a fresh build of ``path`` on ``backend``."""
    stages = []

    def progress(stage, fraction):
        stages.append((stage, fraction))

    if backend == "mlx":
        import mlx.core as mx

        model, _, _ = gguf.build_mlx(path, "float32", quantized, progress=progress)
        logits = np.array(model(mx.array(IDS))[0, -1])
    else:
        import torch

        model, _ = gguf.build_torch(path, "float32", "cpu", progress=progress)
        with torch.no_grad():
            logits = model(torch.tensor(IDS)).logits[0, -1].numpy()
    return logits, [s for s, _ in stages], [f for _, f in stages]


def cache_files(home):
    return sorted((home / "weights").glob("*.safetensors"))


@pytest.mark.parametrize("backend, quantized", [("mlx", False), ("mlx", True), ("torch", False)])
def test_second_build_reads_the_cache_and_gives_the_same_model(home, tiny, backend, quantized):
    first, stages1, fractions = build(tiny, backend, quantized)
    assert "reading the GGUF" in stages1 and "writing the weights cache" in stages1
    assert "reading cached weights" not in stages1
    assert fractions == sorted(fractions) and all(0 <= f <= 1 for f in fractions)
    (path,) = cache_files(home)
    assert backend in path.name and ("quantized-float32" if quantized else "dequantized-float32") in path.name
    second, stages2, _ = build(tiny, backend, quantized)
    assert "reading cached weights" in stages2
    assert "reading the GGUF" not in stages2 and "dequantizing" not in stages2
    np.testing.assert_array_equal(first, second)


def test_each_backend_and_variant_has_its_own_file(home, tiny):
    build(tiny, "mlx")
    build(tiny, "torch")
    build(tiny, "mlx", quantized=True)
    names = [p.name for p in cache_files(home)]
    assert len(names) == 3 and len({n.rsplit("-", 3)[-3] for n in names}) == 2  # mlx, torch


@pytest.mark.parametrize("backend", ["mlx", "torch"])
@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "other-format"])
def test_a_damaged_cache_file_is_rebuilt_not_a_crash(home, tiny, backend, damage):
    good, _, _ = build(tiny, backend)
    (path,) = cache_files(home)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(np.random.default_rng(1).integers(0, 256, len(data), dtype=np.uint8).tobytes())
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # a whole file written by another format version
        assert b'"cachelib_weights_format":"1"' in data[:100_000]
        path.write_bytes(data.replace(b'"cachelib_weights_format":"1"', b'"cachelib_weights_format":"0"', 1))
    assert weights_cache.lookup(tiny, backend, "dequantized-float32")[1] is None
    rebuilt, stages, _ = build(tiny, backend)
    assert "reading the GGUF" in stages
    np.testing.assert_array_equal(good, rebuilt)
    assert weights_cache.lookup(tiny, backend, "dequantized-float32")[1] is not None  # whole again


def test_a_changed_gguf_gets_its_own_cache_entry(home, tiny, tmp_path):
    before, _, _ = build(tiny, "torch")
    write_tiny_gguf(tiny, seed=1)  # same size, other weights
    after, stages, _ = build(tiny, "torch")
    assert "reading the GGUF" in stages
    assert not np.array_equal(before, after)
    assert len(cache_files(home)) == 2


def test_digest_is_the_files_sha256_and_follows_its_content(home, tiny):
    assert weights_cache.file_digest(tiny) == hashlib.sha256(tiny.read_bytes()).hexdigest()
    write_tiny_gguf(tiny, seed=2)
    assert weights_cache.file_digest(tiny) == hashlib.sha256(tiny.read_bytes()).hexdigest()


def test_switched_off_cache_neither_reads_nor_writes(home, tiny, monkeypatch):
    build(tiny, "mlx")
    monkeypatch.setenv(weights_cache.ENV, "0")
    _, stages, _ = build(tiny, "mlx")
    assert "reading the GGUF" in stages and "reading cached weights" not in stages
    build(tiny, "torch")
    assert [p.name.split("-")[-3] for p in cache_files(home)] == ["mlx"]  # the torch build wrote none


def test_a_failed_write_leaves_no_file(home, tiny):
    target = weights_cache.path_for(tiny, "torch", "dequantized-float32")

    def save(tmp):
        tmp.write_bytes(b"half a file")
        raise OSError("disk full")

    assert weights_cache.store(target, save, nbytes=10) is False
    assert not target.exists() and not list(target.parent.glob("*.safetensors"))


def test_clear_removes_every_cached_file(home, tiny):
    build(tiny, "mlx")
    build(tiny, "torch")
    sizes = sum(p.stat().st_size for p in cache_files(home))
    assert weights_cache.clear() >= sizes > 0
    assert cache_files(home) == []
    _, stages, _ = build(tiny, "torch")
    assert "reading the GGUF" in stages


@pytest.mark.bundled
@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_load_reports_its_progress_and_ends_loaded(backend):
    from cachelib.models import load

    seen = []
    loaded = load("smollm2", backend, progress=lambda stage, fraction: seen.append((stage, fraction)))
    stages = [s for s, _ in seen]
    fractions = [f for _, f in seen]
    assert stages[0] == "loading the tokenizer" and seen[-1] == ("loaded", 1.0)
    assert "building the model" in stages
    assert ("reading cached weights" in stages) != ("dequantizing" in stages)
    assert fractions == sorted(fractions)
    assert loaded.info.num_layers == 30
