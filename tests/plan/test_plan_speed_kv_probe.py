"""The K/V a CPU decode step's attention runs over, as the attention probe charges it
(cachelib.plan.cpu_probe.AttentionProbe, issue 31): a batch's attention measured as the batch
(the kernel over its rows at once), and torch's quantized caches with their
whole-cache decode inside the probe (codes decoded each step, then SDPA), so those bytes are not
charged a second time at the bandwidth. Counts and keys only: no timing is asserted."""

from __future__ import annotations

import json

import pytest

from cachelib.plan import PlanRequest, preset
from cachelib.plan import cpu_probe as hw_mod
from cachelib.plan.hardware import AttentionProbe, cpu_hardware
from cachelib.plan.speed import Efficiency, SpeedModel

ARCH = preset("smollm2")
LAYERS = ARCH.num_layers
EFF = Efficiency(0.5, 0.5, 0.0, 0.1, "made up", attention_scale=1.0)


class Counts(AttentionProbe):
    """A probe whose kernel takes 1 us a key, recording what it was asked to measure."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.asked = []

    def measure(self, length, bits=None, group_size=64, queries=1, batch=1):
        self.asked.append((bits, group_size, length, queries) + ((batch,) if batch > 1 else ()))
        return 1e-6 * length * queries * batch


def model(backend: str, spec: str, sessions: int, context: int, probe: AttentionProbe | None) -> SpeedModel:
    r = PlanRequest([spec], context=context, batch=sessions, backend=backend, dtype="float32", device="cpu")
    return SpeedModel(ARCH, r, cpu_hardware(8e9, 40e9, "made up"), eff=EFF, attention=probe)


def counts(backend: str) -> Counts:
    return Counts(backend, ARCH.num_heads, ARCH.kv_heads, ARCH.head_dim, LAYERS)


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_a_batch_is_probed_as_the_batch(backend):
    probe = counts(backend)
    cost = model(backend, "standard", 4, 1024, probe).decode("standard", 4)[1]
    assert probe.asked == [(None, 64, 1024, 1, 4)]  # the kernel over 4 rows of 1,024 keys at once
    assert cost.probed_attention_s == pytest.approx(LAYERS * 4096e-6)
    model(backend, "standard", 4, 1024, probe).decode("standard", 4)
    one = model(backend, "standard", 1, 4096, probe).decode("standard", 1)[1]
    assert probe.asked[1:] == [(None, 64, 4096, 1)]  # the batch's point kept; one row is a point of its own
    assert one.probed_attention_s == pytest.approx(LAYERS * 4096e-6)
    # a batch whose K/V passes one layer's budget: its rows halved, then its keys, and scaled back
    rows_fit = int(hw_mod.ATTENTION_PROBE_LAYER_BYTES // probe._bytes(8192, None))
    big = 4 * rows_fit
    assert probe.seconds(8192, rows=big) == pytest.approx(big * 8192e-6)
    bits_, group, length, queries, batch = probe.asked[-1]
    assert (
        (length, queries) == (8192, 1)
        and 1 < batch <= rows_fit
        and probe._bytes(8192, None) * batch <= hw_mod.ATTENTION_PROBE_LAYER_BYTES
    )
    # a chunk's attention (queries > 1) stays rows x one row's
    assert probe.seconds(512, queries=128, rows=3) == pytest.approx(3 * probe.seconds(512, queries=128))
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="rows must be an int >= 1"):
            probe.seconds(512, rows=bad)


def test_a_torch_quantized_cache_is_probed_with_its_decode():
    probe = counts("torch")
    m = model("torch", "quantized:bits=4", 1, 2048, probe)
    cost = m.decode("quantized:bits=4", 1)[1]
    assert probe.asked == [(4, 64, 2048, 1)]  # the codes decoded inside the probe, then SDPA
    assert cost.decoded_bytes > 0 and cost.probed_decode
    assert cost.bytes_besides_attention == cost.weight_bytes  # the decode is the probe's, not the bandwidth's
    # unprobed (a fit without attention_scale), the same step charges the decode by its bytes
    plain = SpeedModel(m.arch, m.r, m.hw, eff=Efficiency(0.5, 0.5, 0.0, 0.1, "made up")).decode("quantized:bits=4", 1)
    assert not plain[1].probed_decode and plain[1].bytes_besides_attention > plain[1].weight_bytes
    # keys and values of different widths: SDPA over dense K/V is probed, the decode stays bytes
    mixed = "quantized:key_bits=4,value_bits=8"
    cost = model("torch", mixed, 1, 2048, probe).decode(mixed, 1)[1]
    assert probe.asked[-1] == (None, 64, 2048, 1) and not cost.probed_decode
    assert cost.bytes_besides_attention > cost.weight_bytes
    # MLX reads the codes in its attention: never a whole-cache decode
    cost = model("mlx", "quantized:bits=4", 1, 2048, counts("mlx")).decode("quantized:bits=4", 1)[1]
    assert cost.decoded_bytes == 0 and not cost.probed_decode


def test_the_torch_probe_decodes_every_layers_codes_each_run(monkeypatch):
    from cachelib.torch import storage

    decoded = []
    real = storage.QuantizedCodec.decode
    monkeypatch.setattr(storage.QuantizedCodec, "decode", lambda self, s, dt: decoded.append(1) or real(self, s, dt))
    run = hw_mod._attention_torch(9, 3, 64, 128, 3, 4, 64, "float32", 2)
    run()
    assert len(decoded) == 2 * 3  # K and V of each of the 3 layers
    dense = hw_mod._attention_torch(9, 3, 64, 128, 3, None, 64, "float32", 2)
    dense()
    assert len(decoded) == 6  # dense K/V: nothing decoded
    p = AttentionProbe("torch", 9, 3, 64, 3)
    assert p._bytes(128, 4) > p._bytes(128, None) > p._bytes(128, 8) - p._bytes(128, None)  # codes and their decode


def test_a_torch_quantized_point_is_kept_under_its_bits(tmp_path, monkeypatch):
    path = tmp_path / "cpu_probe.json"
    monkeypatch.setattr(hw_mod, "_REPROBE", [False])
    monkeypatch.setattr(AttentionProbe, "measure", lambda self, n, bits=None, group_size=64, queries=1: 1e-6 * n)
    p = AttentionProbe("torch", 9, 3, 64, 30, cache=path)
    p.seconds(1024, 4)
    p.seconds(1024)
    kept = json.loads(path.read_text())["attention"][p.cache_key()]
    assert set(kept) == {json.dumps([4, 64, 1024]), json.dumps([None, 64, 1024])}
    again = AttentionProbe("torch", 9, 3, 64, 30, cache=path)
    assert again.points == {(4, 64, 1024): 1.024e-3, (None, 64, 1024): 1.024e-3}
