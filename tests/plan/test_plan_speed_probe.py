"""The CPU's attention probe in the speed model (cachelib.plan.hardware.AttentionProbe): a decode
step's attention charged by this CPU's attention kernel timed bare at each layer's length, scaled
by one constant fitted on the calibration contexts; published (GPU, Apple) plans never probe."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cachelib.plan import PlanRequest, preset
from cachelib.plan import cpu_probe as hw_mod
from cachelib.plan.hardware import HARDWARE, AttentionProbe, cpu_hardware
from cachelib.plan.speed import Efficiency, SpeedModel, efficiency, fit_pairs, published_efficiency

ARCH = preset("smollm2")
BW, FLOPS = 8e9, 40e9
ONE = Efficiency(1.0, 1.0, 0.0, 0.0, "whole peaks")


def knee(n: int) -> float:
    """A made-up kernel: 600 ns a key up to 2,048 keys, 400 ns past them (a second core joins)."""
    return 20e-6 + 600e-9 * min(n, 2048) + 400e-9 * max(0, n - 2048)


def probe_with(curve, lengths=(256, 512, 1024, 2048, 4096, 8192)) -> AttentionProbe:
    points = {(None, 64, n): curve(n) for n in lengths}
    return AttentionProbe("mlx", ARCH.num_heads, ARCH.kv_heads, ARCH.head_dim, ARCH.num_layers, points=points)


def model(rows: int, context: int, eff: Efficiency, attention=None, device=None) -> SpeedModel:
    r = PlanRequest(["standard"], context=context, batch=rows, backend="mlx", dtype="float32", device="cpu")
    return SpeedModel(ARCH, r, device or cpu_hardware(BW, FLOPS, "made up"), eff=eff, attention=attention)


def truth(rows: int, context: int, attention) -> float:
    """A step made from known terms: the weights at 45% of the bandwidth, the attention 1.3x the
    bare kernel's, 12 ms a row, 4 ms a step."""
    cost = model(rows, context, ONE, attention).decode("standard", rows)[1]
    return cost.bytes_besides_attention / (0.45 * BW) + 1.3 * cost.probed_attention_s + 12e-3 * rows + 4e-3


def fitted(attention, probed: bool) -> Efficiency:
    rows = []
    # batches 1 and 2: a batch's attention is probed at its rows' keys (2 x 2,048 = 4,096 at most), so
    # the calibration sees the kernel's slower rate past the knee over 2,048 keys only, not 8,192's
    for b in (1, 2):
        for c in (256, 2048):
            cost = model(b, c, ONE, attention).decode("standard", b)[1]
            x = (cost.bytes_besides_attention if probed else cost.bytes) / BW
            rows.append((x, cost.probed_attention_s if probed else cost.pairs, b, truth(b, c, attention)))
    return fit_pairs(rows, "made up", probed=probed)


def test_a_knee_in_the_probe_is_a_knee_in_the_prediction():
    attention = probe_with(knee)
    eff = fitted(attention, probed=True)
    assert eff.attention_scale == pytest.approx(1.3, rel=1e-6) and eff.pair_s == 0.0
    for rows, context in ((1, 512), (1, 1024), (1, 8192), (2, 8192), (4, 1024)):
        got = model(rows, context, eff, attention).decode("standard", rows)[0]
        assert got == pytest.approx(truth(rows, context, attention), rel=1e-6), (rows, context)
    # A constant cost per pair, fitted on the same steps, extrapolates the short contexts' rate past
    # the knee: it misses 8,192 tokens by more than the 15% the bench asks.
    before = fitted(attention, probed=False)
    miss = model(1, 8192, before).decode("standard", 1)[0] / truth(1, 8192, attention) - 1
    assert miss > 0.15
    # the same fit on a kernel without the knee predicts a straight line, not the knee
    line = probe_with(lambda n: 20e-6 + 600e-9 * n)
    slow = model(1, 8192, eff, line).decode("standard", 1)[0]
    assert slow > 1.15 * model(1, 8192, eff, attention).decode("standard", 1)[0]


def test_the_probe_charges_every_layer_at_its_own_length():
    ring = AttentionProbe("mlx", ARCH.num_heads, ARCH.kv_heads, ARCH.head_dim, ARCH.num_layers, points={})
    ring.points.update({(None, 64, n): knee(n) for n in (512, 516, 4096)})
    r = PlanRequest(["rotating:max_size=512"], context=4096, batch=1, backend="mlx", dtype="float32", device="cpu")
    cost = SpeedModel(ARCH, r, cpu_hardware(BW, FLOPS, "-"), eff=ONE, attention=ring).decode(
        "rotating:max_size=512", 1
    )[1]
    assert cost.probed_attention_s == pytest.approx(ARCH.num_layers * knee(512), rel=0.02)  # the ring holds 512


def test_a_length_past_the_probes_memory_takes_the_longest_rate(monkeypatch):
    monkeypatch.setattr(hw_mod, "ATTENTION_PROBE_LAYER_BYTES", 2 * 3 * 64 * 4 * 1000)  # 1,000 keys of float32
    p = AttentionProbe("torch", 9, 3, 64, 30, points={(None, 64, 512): 1e-4})
    assert p.seconds(2048) == pytest.approx(4e-4)  # halved to 512 keys, which fit, then scaled by length
    assert p.seconds(512) == 1e-4


def test_published_devices_never_probe_and_their_fits_have_no_probe_term():
    class Refuses(AttentionProbe):
        def measure(self, *a, **k):
            raise AssertionError("a published device must not probe")

    refuses = Refuses("mlx", 9, 3, 64, 30)
    arch = preset("llama-3.1-8b")
    for name, runtime, backend in (("h100-sxm", "vllm", "torch"), ("m4-max", "mlx-lm", "mlx")):
        r = PlanRequest(["standard"], context=8192, batch=2, backend=backend, runtime=runtime)
        plain = SpeedModel(arch, r, name).decode("standard", 2)
        probed = SpeedModel(arch, r, name, attention=refuses).decode("standard", 2)
        assert probed == plain and plain[1].probed_attention_s == 0.0
        assert efficiency(runtime, backend, HARDWARE[name]).attention_scale == 0.0
    for runtime, kind in (("llama.cpp", "cuda"), ("llama.cpp", "apple"), ("vllm", "cuda"), ("mlx-lm", "apple")):
        assert published_efficiency(runtime, kind).attention_scale == 0.0


def test_the_probe_measures_each_backends_attention_once():
    for backend in ("mlx", "torch"):
        p = AttentionProbe(backend, 9, 3, 64, 2, seconds=0.01)
        for bits in (None, 4):
            s = p.seconds(128, bits)
            assert s > 0 and p.points[(bits, 64, 128)] == s
            assert p.seconds(256, bits) > 0 and len(p.points) <= 4
    with pytest.raises(ValueError, match="allowed: mlx, torch"):
        AttentionProbe("cuda", 9, 3, 64, 2)


def test_a_prefill_chunk_of_mlx_on_the_cpu_is_charged_its_probed_attention():
    """MLX on the CPU materialises a chunk's scores: the chunk's attention is the probe's causal
    attention of its queries over each layer's keys (the bare kernel, scale 1), the rest its weights'
    FLOPs; torch's SDPA (no scores array) keeps the FLOPs."""
    chunk_s = {(None, 64, 128, 128): 20e-3, (None, 64, 256, 128): 50e-3}  # one layer, a 128-token chunk
    probe = AttentionProbe("mlx", ARCH.num_heads, ARCH.kv_heads, ARCH.head_dim, ARCH.num_layers, points=chunk_s)
    eff = Efficiency(0.5, 0.25, 0.0, 0.1, "made up", attention_scale=0.7)
    r = PlanRequest(["standard"], context=256, batch=1, backend="mlx", dtype="float32", device="cpu", prefill_chunk=128)
    m = SpeedModel(ARCH, r, cpu_hardware(BW, FLOPS, "-"), eff=eff, attention=probe)
    no_attention = SpeedModel(ARCH, r, cpu_hardware(BW, FLOPS, "-"), eff=replace(eff, attention_scale=0.0))
    got = m.prefill("standard", prompt=256)
    free = AttentionProbe("mlx", 9, 3, 64, 30, points={k: 1e-15 for k in chunk_s})  # an attention that costs nothing
    rest = SpeedModel(ARCH, r, cpu_hardware(BW, FLOPS, "-"), eff=eff, attention=free).prefill("standard", prompt=256)
    attention = ARCH.num_layers * (20e-3 + 50e-3)
    assert got == pytest.approx(rest + attention, rel=1e-6)
    flops_model = no_attention.prefill("standard", prompt=256)  # the attention as FLOPs and scores' bytes
    assert rest < flops_model < got  # the probed attention (2.1 s) is far above its FLOPs' share
    # scaled by the probe's seconds, not by the decode's fitted scale
    doubled = AttentionProbe("mlx", 9, 3, 64, 30, points={k: 2 * v for k, v in chunk_s.items()})
    m2 = SpeedModel(ARCH, r, cpu_hardware(BW, FLOPS, "-"), eff=eff, attention=doubled)
    assert m2.prefill("standard", prompt=256) - got == pytest.approx(attention, rel=1e-6)
    # torch: no scores array, the chunk's attention stays FLOPs (the probe is not asked)
    rt = PlanRequest(
        ["standard"], context=256, batch=1, backend="torch", dtype="float32", device="cpu", prefill_chunk=128
    )

    class Refuses(AttentionProbe):
        def measure(self, *a, **k):
            raise AssertionError("torch's chunk attention is not probed")

    refuses = Refuses("torch", 9, 3, 64, 30)
    hw = cpu_hardware(BW, FLOPS, "-")
    assert SpeedModel(ARCH, rt, hw, eff=eff, attention=refuses).prefill("standard") == pytest.approx(
        SpeedModel(ARCH, rt, hw, eff=eff).prefill("standard")
    )


def test_a_chunk_past_the_probes_memory_is_measured_smaller_and_scaled_by_pairs(monkeypatch):
    monkeypatch.setattr(hw_mod, "ATTENTION_PROBE_LAYER_BYTES", 4 * 2**20)
    asked = []

    class Counts(AttentionProbe):
        def measure(self, length, bits=None, group_size=64, queries=1):
            asked.append((length, queries))
            return 1e-9 * length * queries

    p = Counts("mlx", 32, 8, 128, 32)
    s = p.seconds(32768, queries=2048)  # keys halved to the chunk's 2,048, then both halved
    ((length, queries),) = asked
    assert length == queries and p._bytes(length, None, queries) <= 4 * 2**20 < p._bytes(2 * length, None, 2 * queries)
    assert s == pytest.approx(1e-9 * 32768 * 2048)
    assert p.seconds(32768, queries=2048) == s and len(asked) == 1  # measured once
    assert p.seconds(64, queries=512) == p.seconds(64, queries=64)  # never more queries than keys
