"""Strategy specs: one string names a cache strategy and its knobs, on both backends.

Grammar::

    spec  := name [":" knob ("," knob)*]
    knob  := key "=" value

e.g. ``standard``, ``rotating:max_size=512,keep=4``, ``quantized:bits=4,group_size=64,start=256``.
Parsing and validation live here and only here; a bad spec raises ``ValueError`` naming the
strategy or knob at fault and what is allowed. Building a cache from a spec is the backends'
job (``cachelib.mlx.make_cache``, ``cachelib.torch.make_cache``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .core.units import BACKENDS, STEP
QUANT_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize supports; torch supports TORCH_QUANT_BITS
TORCH_QUANT_BITS = (2, 4, 8)
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class Knob:
    name: str
    help: str
    default: int | None = None  # None and not required: the knob is off unless given
    required: bool = False
    min: int | None = None
    max: int | None = None
    choices: tuple[int, ...] | None = None

    def check(self, strategy: str, value: Any) -> int:
        where = f"{strategy}: knob {self.name!r}"
        if isinstance(value, bool):
            raise ValueError(f"{where} must be an integer, got {value!r}")
        if isinstance(value, str):
            try:
                value = int(value.strip().replace("_", ""))
            except ValueError:
                raise ValueError(f"{where} must be an integer, got {value!r}") from None
        elif isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            raise ValueError(f"{where} must be an integer, got {value!r}")
        if self.choices is not None and value not in self.choices:
            allowed = ", ".join(map(str, self.choices))
            raise ValueError(f"{where} = {value} is not supported; allowed: {allowed}")
        if self.min is not None and value < self.min:
            raise ValueError(f"{where} = {value} must be >= {self.min}")
        if self.max is not None and value > self.max:
            raise ValueError(f"{where} = {value} must be <= {self.max}")
        return value

    @property
    def range_text(self) -> str:
        if self.choices:
            return "{" + ", ".join(map(str, self.choices)) + "}"
        lo = "" if self.min is None else f">= {self.min}"
        hi = "" if self.max is None else f"<= {self.max}"
        return " and ".join(x for x in (lo, hi) if x) or "any integer"


@dataclass(frozen=True)
class Strategy:
    name: str
    summary: str
    knobs: tuple[Knob, ...] = ()
    backends: tuple[str, ...] = BACKENDS
    bounded: bool = False  # holds at most a fixed number of tokens

    def knob(self, name: str) -> Knob:
        for k in self.knobs:
            if k.name == name:
                return k
        allowed = ", ".join(k.name for k in self.knobs) or "none"
        raise ValueError(f"{self.name}: unknown knob {name!r}; allowed knobs: {allowed}")


def _bits(name: str, help: str, default: int | None = None) -> Knob:
    return Knob(name, help, default=default, choices=QUANT_BITS)


_GROUP = Knob("group_size", "elements per quantization group (scale + bias each)", 64, choices=GROUP_SIZES)
_KEY_BITS = _bits("key_bits", "bits for keys (default: bits)")
_VALUE_BITS = _bits("value_bits", "bits for values (default: bits)")

STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy(
            "standard",
            "full cache, preallocated in steps of `step` tokens (mlx-lm KVCache)",
            (Knob("step", "tokens added per growth", STEP, min=1),),
        ),
        Strategy("concat", "full cache grown by concatenation every step (transformers DynamicCache)"),
        Strategy(
            "rotating",
            "ring buffer of max_size tokens, the first `keep` never evicted (mlx-lm RotatingKVCache)",
            (
                Knob("max_size", "tokens held at most (mlx-lm --max-kv-size)", required=True, min=1),
                Knob("keep", "leading tokens never evicted (attention sinks)", 4, min=0),
                _bits("bits", "quantize the ring (beyond mlx-lm); off unless given"),
                _GROUP,
                _KEY_BITS,
                _VALUE_BITS,
            ),
            bounded=True,
        ),
        Strategy(
            "quantized",
            "full cache stored group-wise quantized (mlx-lm QuantizedKVCache)",
            (
                _bits("bits", "bits per element (mlx-lm --kv-bits)", 8),
                _GROUP,
                Knob("start", "keep full precision for the first `start` tokens (--quantized-kv-start)", 0, min=0),
                _KEY_BITS,
                _VALUE_BITS,
            ),
        ),
        Strategy(
            "kivi",
            "KIVI-style: the newest `residual` tokens in full precision, older ones quantized (transformers QuantizedCache)",
            (
                Knob("bits", "bits per quantized element", 4, choices=TORCH_QUANT_BITS),
                _GROUP,
                Knob("residual", "tokens kept in full precision", 128, min=1),
            ),
        ),
        Strategy(
            "chunked",
            "keeps only the tokens of the current chunk of chunk_size (mlx-lm ChunkedKVCache)",
            (Knob("chunk_size", "tokens per attention chunk", required=True, min=1),),
            bounded=True,
        ),
        Strategy(
            "static",
            "preallocates max_len tokens up front (transformers StaticCache)",
            (Knob("max_len", "tokens preallocated; a longer run is refused", required=True, min=1),),
            bounded=True,
        ),
        Strategy(
            "sliding",
            "keeps the last `window` tokens on every attention layer (sliding-window attention)",
            (Knob("window", "tokens each query may attend to", required=True, min=1),),
            bounded=True,
        ),
        Strategy(
            "offloaded",
            "full cache kept on the CPU, each layer fetched to the device ahead of use (transformers offloading)",
            backends=("torch",),
        ),
    )
}


@dataclass(frozen=True)
class Spec:
    """A parsed, validated strategy spec. ``str(spec)`` is its canonical text."""

    name: str
    params: tuple[tuple[str, int], ...] = ()  # knobs given explicitly, in declaration order

    @property
    def strategy(self) -> Strategy:
        return STRATEGIES[self.name]

    def get(self, knob: str) -> int | None:
        """The knob's value: given, else its default (None for an off-by-default knob)."""
        for k, v in self.params:
            if k == knob:
                return v
        return self.strategy.knob(knob).default

    @property
    def values(self) -> dict[str, int | None]:
        """Every knob with its effective value."""
        return {k.name: self.get(k.name) for k in self.strategy.knobs}

    @property
    def key_bits(self) -> int | None:
        """Bits for keys; None when keys are stored at full precision."""
        return self._bits_for("key_bits")

    @property
    def value_bits(self) -> int | None:
        """Bits for values; None when values are stored at full precision."""
        return self._bits_for("value_bits")

    def _bits_for(self, knob: str) -> int | None:
        names = {k.name for k in self.strategy.knobs}
        if knob in names and self.get(knob) is not None:
            return self.get(knob)
        return self.get("bits") if "bits" in names else None

    @property
    def key(self) -> tuple:
        """What the spec means: its name and every knob's effective value. Two texts that differ
        only by knobs left at their defaults (``quantized:bits=4`` and
        ``quantized:bits=4,group_size=64``) have the same key."""
        return (self.name, tuple(sorted(self.values.items())))

    def supports(self, backend: str) -> bool:
        return backend in self.strategy.backends

    def check_backend(self, backend: str) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; supported: {', '.join(BACKENDS)}")
        if not self.supports(backend):
            raise ValueError(
                f"strategy {self.name!r} is not available on {backend}; "
                f"it runs on: {', '.join(self.strategy.backends)}"
            )
        if backend == "torch":
            for knob, b in (("key_bits", self.key_bits), ("value_bits", self.value_bits)):
                if b is not None and b not in TORCH_QUANT_BITS:
                    raise ValueError(
                        f"{self.name}: {knob}={b} is not supported on torch; allowed: "
                        + ", ".join(map(str, TORCH_QUANT_BITS))
                    )

    def __str__(self) -> str:
        if not self.params:
            return self.name
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in self.params)


def parse_spec(text: str | Spec) -> Spec:
    """Parse and validate a strategy spec such as ``rotating:max_size=512,keep=4``."""
    if isinstance(text, Spec):
        return text
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"empty strategy spec; choose one of: {', '.join(STRATEGIES)}")
    name, _, rest = text.strip().partition(":")
    name = name.strip()
    given: dict[str, str] = {}
    if rest.strip():
        for part in rest.split(","):
            key, eq, value = part.partition("=")
            key = key.strip()
            if not eq or not key or not value.strip():
                raise ValueError(f"{name}: malformed knob {part.strip()!r}; write key=value, e.g. bits=4")
            if key in given:
                raise ValueError(f"{name}: knob {key!r} given twice")
            given[key] = value
    elif _:
        raise ValueError(f"{name}: ':' must be followed by knobs, e.g. {name}:key=value")
    return make_spec(name, given)


def make_spec(name: str, knobs: Mapping[str, Any] | None = None) -> Spec:
    """Build a validated :class:`Spec` from a name and knob values (None values are dropped)."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")
    strategy = STRATEGIES[name]
    knobs = {k: v for k, v in (knobs or {}).items() if v is not None}
    values = {k: strategy.knob(k).check(name, v) for k, v in knobs.items()}
    for knob in strategy.knobs:
        if knob.required and knob.name not in values:
            raise ValueError(f"{name}: knob {knob.name!r} is required ({knob.help}), e.g. {name}:{knob.name}=512")
    params = tuple((k.name, values[k.name]) for k in strategy.knobs if k.name in values)
    spec = Spec(name, params)
    _check_relations(spec)
    return spec


def _check_relations(spec: Spec) -> None:
    if spec.name == "rotating":
        keep, max_size = spec.get("keep"), spec.get("max_size")
        if keep >= max_size:
            raise ValueError(f"rotating: keep={keep} must be < max_size={max_size} (allowed: 0..{max_size - 1})")
        quant = [k for k in ("bits", "key_bits", "value_bits") if dict(spec.params).get(k) is not None]
        if quant and dict(spec.params).get("bits") is None and len(quant) < 2:
            raise ValueError("rotating: a quantized ring needs bits=, or both key_bits= and value_bits=")


def spec_from_mlx_flags(
    max_kv_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    keep: int = 4,
) -> Spec:
    """The spec that mlx-lm's generate flags (--max-kv-size, --kv-bits, ...) describe."""
    if max_kv_size is not None:
        knobs = {"max_size": max_kv_size, "keep": keep}
        if kv_bits is not None:
            knobs |= {"bits": kv_bits, "group_size": kv_group_size}
        return make_spec("rotating", knobs)
    if kv_bits is not None:
        return make_spec("quantized", {"bits": kv_bits, "group_size": kv_group_size, "start": quantized_kv_start})
    return make_spec("standard")
