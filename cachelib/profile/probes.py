"""Which probes a run takes, and how often.

Each probe is a sampling period in steps: 1 = every step, k = steps 0, k, 2k, ... and the last
step, 0 = off. Text form (CLI, sweep files): ``memory=1,quality=1,masks=16``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

PROBE_HELP = {
    "memory": "per step x layer: tokens held, bytes used/allocated, capacity (cheap)",
    "ring": "per layer: write index, keep, evicted; and the slot -> position table of ring caches",
    "quant_error": "relative RMS / max abs error of the K/V quantized each step (costs a dequantize)",
    "quality": "KL, top-1 agreement and target log-prob against the baseline",
    "masks": "the boolean attention mask each layer cache produced (query x key)",
    "system": "step time, tokens/s, device and process memory",
}


@dataclass(frozen=True)
class Probes:
    memory: int = 1
    ring: int = 1
    quant_error: int = 1
    quality: int = 1
    masks: int = 16
    system: int = 1

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"probe {f.name!r}: sampling period must be an integer >= 0 (0 = off), got {v!r}")

    def on(self, probe: str, step: int, last: bool = False) -> bool:
        every = getattr(self, probe)
        return every > 0 and (step % every == 0 or last)

    @classmethod
    def none(cls) -> "Probes":
        return cls(**{f.name: 0 for f in fields(cls)})

    @classmethod
    def every_step(cls) -> "Probes":
        return cls(**{f.name: 1 for f in fields(cls)})

    def sampled(self, every: int) -> "Probes":
        """The same probes with the costly ones (slots, masks, quantization error) every ``every`` steps."""
        return replace(self, **{k: every for k in ("quant_error", "masks") if getattr(self, k)})

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def parse(cls, text: str, base: "Probes | None" = None) -> "Probes":
        """``"memory=1,masks=0"`` on top of ``base`` (default probes). ``"none"`` turns all off."""
        base = base or cls()
        text = text.strip()
        if text in ("", "default"):
            return base
        if text == "none":
            return cls.none()
        values = {}
        names = [f.name for f in fields(cls)]
        for part in text.split(","):
            key, eq, val = part.partition("=")
            key = key.strip()
            if key not in names:
                raise ValueError(f"unknown probe {key!r}; probes: {', '.join(names)}")
            if not eq:
                values[key] = 1
                continue
            try:
                values[key] = int(val)
            except ValueError:
                raise ValueError(f"probe {key!r}: sampling period must be an integer, got {val.strip()!r}") from None
        return replace(base, **values)
