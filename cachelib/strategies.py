"""The one strategy table: :data:`STRATEGIES`, every cache strategy cachelib knows, each a
:class:`Strategy` carrying everything the rest of cachelib knows about it: its knobs
(:class:`Knob`), its facts (which knob bounds what it keeps, whether it is lossless, which
backends run it, what a runtime calls it, an importance method's facts and scorers) and its
builders: the MLX layer cache, the PyTorch cache, and the planner's layer descriptor (whose byte
rule lives in :mod:`cachelib.core.rules`). The backend builders are named as
``"module:function"`` and imported only when a backend asks for them, so that reading the table
never imports MLX or PyTorch. Adding a strategy is one entry here plus one builder per backend
(see docs/adding-a-strategy.md); no other module compares a strategy's name
(tests/test_no_name_switches.py). Specs naming these strategies are parsed in :mod:`cachelib.spec`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from typing import Any, Callable

from .core.importance import Method, pyramid_layer_budget, pyramid_smallest_budget
from .core.layout import EACH_STEP, ONCE, LayerLayout
from .core.units import BACKENDS, INDEX_MAX, STEP, check_backend

QUANT_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize supports; torch supports TORCH_QUANT_BITS
TORCH_QUANT_BITS = (2, 4, 8)
GROUP_SIZES = (32, 64, 128)


class SpecError(ValueError):
    """A bad strategy spec. ``knob`` names the knob at fault (None when the fault is the
    strategy's name or the spec's form), so callers can point at it without reading the text."""

    def __init__(self, message: str, knob: str | None = None):
        super().__init__(message)
        self.knob = knob


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

        def fail(message: str) -> SpecError:
            return SpecError(message, self.name)

        if isinstance(value, bool):
            raise fail(f"{where} must be an integer, got {value!r}")
        if isinstance(value, str):
            try:
                value = int(value.strip().replace("_", ""))
            except ValueError:
                raise fail(f"{where} must be an integer, got {value!r}") from None
        elif isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            raise fail(f"{where} must be an integer, got {value!r}")
        if self.choices is not None and value not in self.choices:
            allowed = ", ".join(map(str, self.choices))
            raise fail(f"{where} = {value} is not supported; allowed: {allowed}")
        if self.min is not None and value < self.min:
            raise fail(f"{where} = {value} must be >= {self.min}")
        if self.max is not None and value > self.max:
            why = " (the int32 range MLX indexes arrays with)" if self.max == INDEX_MAX else ""
            raise fail(f"{where} = {value} must be <= {self.max}{why}")
        return value

    @property
    def range_text(self) -> str:
        if self.choices:
            return "{" + ", ".join(map(str, self.choices)) + "}"
        lo = "" if self.min is None else f">= {self.min}"
        hi = "" if self.max is None else f"<= {self.max}"
        return " and ".join(x for x in (lo, hi) if x) or "any integer"


# The planner's descriptor of what a strategy puts on one layer: (spec, backend) -> LayerLayout,
# and for a model's own sliding-window layers (spec, backend, model window) -> LayerLayout or
# None (None: the layer keeps the window cache the model gives it).
PlanLayer = Callable[["Spec", str], LayerLayout]
PlanSlidingLayer = Callable[["Spec", str, int], "LayerLayout | None"]


@dataclass(frozen=True)
class Strategy:
    """One cache strategy: its knobs, its facts and its builders.

    ``mlx`` names the function building the MLX cache of one full-attention layer,
    ``(spec) -> layer cache``; ``torch`` the function building the whole transformers cache,
    ``(spec, config) -> Cache``; both as ``"module:function"``. ``plan`` gives the planner's
    descriptor of a full-attention layer and ``plan_sliding`` that of a model's own
    sliding-window layers (default: they keep the model's window).
    """

    name: str
    summary: str
    knobs: tuple[Knob, ...]
    plan: PlanLayer
    mlx: str | None = None
    torch: str | None = None
    plan_sliding: PlanSlidingLayer | None = None
    window: str | None = None  # the knob bounding what attention sees: older tokens are evicted
    max_context: str | None = None  # the knob bounding the run itself: a longer run is refused
    lossless: bool = False  # keeps every token at full precision: quality exact by construction
    every_attention_layer: bool = False  # also replaces the model's own sliding-window caches
    # its full-attention layers differ by depth (PyramidKV's budgets): the `mlx` builder and `plan`
    # also take layer= (the layer's index among the model's full-attention layers) and layers=
    # (their count); the `torch` builder reads both from the config
    layered: bool = False
    check: Callable[[Spec], None] | None = None  # relations between knobs, beyond each knob's range
    # the full cache every strategy is measured against; a runtime's own cache plans as it
    reference: bool = False
    # transformers' own cache that this strategy is, as its constructor reads ({knob}: the knob's value)
    transformers_cache: str | None = None
    # the knob counting the leading tokens held at full precision before quantizing
    full_precision_first: str | None = None
    # an importance-based eviction (cachelib.core.importance): its facts and its scorer per backend
    importance: Method | None = None
    # the mlx-lm generate flags (keyword names) that build a spec of it, None where none do
    mlx_lm_flags: Callable[[Spec], dict[str, int] | None] | None = None

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(b for b in BACKENDS if self.builder_name(b) is not None)

    def builder_name(self, backend: str) -> str | None:
        return {"mlx": self.mlx, "torch": self.torch}.get(backend)

    def scorer(self, backend: str) -> type:
        """An importance strategy's scorer class on ``backend`` (imported on first use)."""
        name = None if self.importance is None else self.importance.scorer_name(backend)
        if name is None:
            raise SpecError(f"strategy {self.name!r} has no importance scorer on {backend}")
        return _resolve(name)

    def builder(self, backend: str) -> Callable:
        """The backend's builder function (imported on first use)."""
        name = self.builder_name(backend)
        if name is None:
            raise SpecError(
                f"strategy {self.name!r} is not available on {backend}; it runs on: " + ", ".join(self.backends)
            )
        return _resolve(name)

    def knob(self, name: str) -> Knob:
        for k in self.knobs:
            if k.name == name:
                return k
        allowed = ", ".join(k.name for k in self.knobs) or "none"
        raise SpecError(f"{self.name}: unknown knob {name!r}; allowed knobs: {allowed}", name)


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

    @property
    def window(self) -> int | None:
        """The token bound of an evicting strategy (ring size, window, chunk), else None."""
        knob = self.strategy.window
        return None if knob is None else self.get(knob)

    @property
    def max_context(self) -> int | None:
        """The longest run the strategy accepts (a static cache's max_len), else None."""
        knob = self.strategy.max_context
        return None if knob is None else self.get(knob)

    @property
    def smallest_window(self) -> int | None:
        """The bound of the layer that keeps least: :attr:`window`, except where an importance
        method's budgets differ by depth (PyramidKV's top layer keeps about budget/beta)."""
        method = self.strategy.importance
        if method is not None and method.smallest_budget is not None:
            return method.smallest_budget(self.values)
        return self.window

    @property
    def lossless(self) -> bool:
        return self.strategy.lossless

    @property
    def reference(self) -> bool:
        """Whether this is the full cache every strategy is measured against (``standard``)."""
        return self.strategy.reference

    @property
    def transformers_cache(self) -> str | None:
        """transformers' own cache that this spec is, as its constructor reads; None: none is."""
        text = self.strategy.transformers_cache
        return None if text is None else text.format(**self.values)

    def check_backend(self, backend: str) -> None:
        try:
            check_backend(backend)
        except ValueError as e:
            raise SpecError(str(e)) from None
        if not self.supports(backend):
            raise SpecError(
                f"strategy {self.name!r} is not available on {backend}; it runs on: {', '.join(self.strategy.backends)}"
            )
        if backend == "torch":
            for knob, b in (("key_bits", self.key_bits), ("value_bits", self.value_bits)):
                if b is not None and b not in TORCH_QUANT_BITS:
                    raise SpecError(
                        f"{self.name}: {knob}={b} is not supported on torch; allowed: "
                        + ", ".join(map(str, TORCH_QUANT_BITS)),
                        knob if knob in dict(self.params) else "bits",
                    )

    def __str__(self) -> str:
        if not self.params:
            return self.name
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in self.params)


@cache
def _resolve(name: str) -> Callable:
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def _bits(name: str, help: str, default: int | None = None) -> Knob:
    return Knob(name, help, default=default, choices=QUANT_BITS)


_GROUP = Knob("group_size", "elements per quantization group (scale + bias each)", 64, choices=GROUP_SIZES)
_KEY_BITS = _bits("key_bits", "bits for keys (default: bits)")
_VALUE_BITS = _bits("value_bits", "bits for values (default: bits)")


def _layer(kind: str, *knobs: str, **renamed: str):
    """A planner descriptor builder: class ``kind`` with the spec's knobs (``renamed``: descriptor
    knob name -> spec knob name)."""

    def build(spec: Spec, backend: str) -> LayerLayout:
        pairs = [(k, spec.get(k)) for k in knobs] + [(k, spec.get(v)) for k, v in renamed.items()]
        return LayerLayout(kind, "full", tuple(pairs))

    return build


def _ring_flags(spec: Spec) -> dict[str, int] | None:
    """mlx-lm's ring (--max-kv-size): its 4 sink tokens, unquantized (mlx_lm/generate.py)."""
    if spec.get("keep") == 4 and spec.get("bits") is None:
        return {"max_kv_size": spec.get("max_size")}
    return None


def _quantized_flags(spec: Spec) -> dict[str, int] | None:
    """mlx-lm's quantized cache (--kv-bits ...): one bit width for keys and values."""
    if spec.get("key_bits") is None and spec.get("value_bits") is None:
        return {
            "kv_bits": spec.get("bits"),
            "kv_group_size": spec.get("group_size"),
            "quantized_kv_start": spec.get("start"),
        }
    return None


def _check_ring(spec: Spec) -> None:
    keep, max_size = spec.get("keep"), spec.get("max_size")
    if keep >= max_size:
        raise SpecError(f"rotating: keep={keep} must be < max_size={max_size} (allowed: 0..{max_size - 1})", "keep")
    given = dict(spec.params)
    quant = [k for k in ("bits", "key_bits", "value_bits") if given.get(k) is not None]
    if quant and given.get("bits") is None and len(quant) < 2:
        raise SpecError("rotating: a quantized ring needs bits=, or both key_bits= and value_bits=", quant[0])


def _budget() -> Knob:
    return Knob(
        "budget",
        "tokens each full-attention layer keeps (a budget above the context evicts nothing)",
        required=True,
        min=1,
        max=INDEX_MAX,
    )


def _check_budget(spec: Spec, knob: str) -> None:
    budget, inner = spec.get("budget"), spec.get(knob)
    if inner >= budget:
        raise SpecError(
            f"{spec.name}: budget={budget} must be greater than {knob}={inner} (those tokens are always kept); "
            f"allowed budget: {inner + 1}..{INDEX_MAX}, or a {knob} of at most {budget - 1}",
            "budget",
        )


def _check_snapkv(spec: Spec) -> None:
    _check_budget(spec, "window")
    if "safeguard" in dict(spec.params) and not spec.get("adaptive"):
        raise SpecError("snapkv: safeguard applies to per-head budgets only; give adaptive=1 with it", "safeguard")


def importance_layer(spec: Spec, backend: str, layer: int = 0, layers: int = 1) -> LayerLayout:
    # the layer's own budget (by depth where the method says so); Ada-KV's heads: also the tokens each keeps
    from .core.importance import policy_of

    policy = policy_of(spec, layer, layers)
    knobs = (("budget", policy.budget),)
    if policy.adaptive:  # safe: the tokens every head keeps, its window included
        knobs += (("safe", policy.safe(policy.budget)),)
    return LayerLayout(spec.name, "full", knobs, evicts=ONCE if policy.compress_once else EACH_STEP)


def _check_pyramid(spec: Spec) -> None:
    from .core.importance import max_budget

    budget, window, beta = spec.get("budget"), spec.get("window"), spec.get("beta")
    if budget < window * beta:
        raise SpecError(
            f"pyramidkv: budget={budget} gives the top layer budget/beta = {budget / beta:g} tokens, fewer than "
            f"window={window} (every layer keeps its observation window); allowed budget: "
            f"{window * beta}..{max_budget(beta)}, or a beta of at most {max(1, budget // window)}",
            "budget",
        )
    if budget > max_budget(beta):
        raise SpecError(
            f"pyramidkv: budget={budget} gives the bottom layer 2*budget - budget/beta tokens, past {INDEX_MAX}; "
            f"allowed budget: {window * beta}..{max_budget(beta)}",
            "budget",
        )


def _snapkv_knobs(budget_help: str) -> tuple[Knob, ...]:
    return (
        Knob("budget", budget_help, required=True, min=1, max=INDEX_MAX),
        Knob("window", "last prompt queries whose attention scores the keys (always kept)", 16, min=1, max=INDEX_MAX),
        Knob("kernel", "width of the pooling kernel over key positions", 5, choices=(1, 3, 5, 7, 9, 11, 13, 15)),
        Knob("max_pool", "1: max pooling instead of average pooling", 0, choices=(0, 1)),
    )


def _format_layer(spec: Spec, backend: str) -> LayerLayout:
    # a runtime's storage format (the strategy's name is the format's), in KVCache's steps of 256
    return LayerLayout("FormatKVCache", "full", (("step", STEP),), kv_format=spec.name)


def _sliding_window(spec: Spec, backend: str) -> LayerLayout:
    if backend == "mlx":  # mlx-lm's sliding layers: a ring without sinks
        return LayerLayout("RotatingKVCache", "full", (("max_size", spec.get("window")), ("keep", 0)))
    return LayerLayout("DynamicSlidingWindowLayer", "full", (("window", spec.get("window")),))


def _static_sliding(spec: Spec, backend: str, window: int) -> LayerLayout | None:
    # transformers' StaticCache gives a model's sliding layers a static window of their own
    if backend != "torch":
        return None
    knobs = (("max_cache_len", spec.get("max_len")), ("window", window))
    return LayerLayout("StaticSlidingWindowLayer", "sliding", knobs)


def _offloaded_sliding(spec: Spec, backend: str, window: int) -> LayerLayout:
    # transformers' DynamicCache(offloading=True) offloads every layer, sliding ones too
    return LayerLayout("DynamicSlidingWindowLayer", "sliding", (("window", window),), offloaded=True)


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy(
            "standard",
            "full cache, preallocated in steps of `step` tokens (mlx-lm KVCache)",
            (Knob("step", "tokens added per growth", STEP, min=1, max=INDEX_MAX),),
            plan=_layer("KVCache", "step"),
            mlx="cachelib.mlx.kv:build_standard",
            torch="cachelib.torch.mlx_style:build_standard",
            lossless=True,
            reference=True,
            transformers_cache="DynamicCache(config=model.config)",  # generate()'s default
        ),
        Strategy(
            "concat",
            "full cache grown by concatenation every step (transformers DynamicCache)",
            (),
            plan=lambda spec, backend: LayerLayout(
                "ConcatenateKVCache" if backend == "mlx" else "DynamicLayer", "full"
            ),
            mlx="cachelib.mlx.kv:build_concat",
            torch="cachelib.torch.cache:build_concat",
            lossless=True,
            transformers_cache="DynamicCache(config=model.config)",
        ),
        Strategy(
            "rotating",
            "ring buffer of max_size tokens, the first `keep` never evicted (mlx-lm RotatingKVCache)",
            (
                Knob("max_size", "tokens held at most (mlx-lm --max-kv-size)", required=True, min=1, max=INDEX_MAX),
                Knob("keep", "leading tokens never evicted (attention sinks)", 4, min=0, max=INDEX_MAX),
                _bits("bits", "quantize the ring (beyond mlx-lm); off unless given"),
                _GROUP,
                _KEY_BITS,
                _VALUE_BITS,
            ),
            plan=_layer("RotatingKVCache", "max_size", "keep"),
            mlx="cachelib.mlx.rotating:build_rotating",
            torch="cachelib.torch.rotating:build_rotating",
            window="max_size",
            check=_check_ring,
            mlx_lm_flags=_ring_flags,
        ),
        Strategy(
            "quantized",
            "full cache stored group-wise quantized (mlx-lm QuantizedKVCache)",
            (
                _bits("bits", "bits per element (mlx-lm --kv-bits)", 8),
                _GROUP,
                Knob(
                    "start",
                    "keep full precision for the first `start` tokens (--quantized-kv-start)",
                    0,
                    min=0,
                    max=INDEX_MAX,
                ),
                _KEY_BITS,
                _VALUE_BITS,
            ),
            plan=_layer("QuantizedKVCache", "start"),
            mlx="cachelib.mlx.quantized:build_quantized",
            torch="cachelib.torch.mlx_style:build_quantized",
            full_precision_first="start",
            mlx_lm_flags=_quantized_flags,
        ),
        Strategy(
            "kivi",
            "KIVI-style: the newest `residual` tokens in full precision, older ones quantized (transformers "
            "QuantizedCache)",
            (
                Knob("bits", "bits per quantized element", 4, choices=TORCH_QUANT_BITS),
                _GROUP,
                Knob("residual", "tokens kept in full precision", 128, min=1, max=INDEX_MAX),
            ),
            plan=_layer("QuantizedLayer", "residual"),
            mlx="cachelib.mlx.kivi:build_kivi",
            torch="cachelib.torch.cache:build_kivi",
        ),
        Strategy(
            "chunked",
            "keeps only the tokens of the current chunk of chunk_size (mlx-lm ChunkedKVCache)",
            (Knob("chunk_size", "tokens per attention chunk", required=True, min=1, max=INDEX_MAX),),
            plan=_layer("ChunkedKVCache", "chunk_size"),
            mlx="cachelib.mlx.kv:build_chunked",
            torch="cachelib.torch.mlx_style:build_chunked",
            window="chunk_size",
        ),
        Strategy(
            "static",
            "preallocates max_len tokens up front (transformers StaticCache)",
            (Knob("max_len", "tokens preallocated; a longer run is refused", required=True, min=1, max=INDEX_MAX),),
            plan=_layer("StaticLayer", "max_len"),
            plan_sliding=_static_sliding,
            mlx="cachelib.mlx.kv:build_static",
            torch="cachelib.torch.cache:build_static",
            max_context="max_len",
            lossless=True,
            transformers_cache="StaticCache(config=model.config, max_cache_len={max_len})",
        ),
        Strategy(
            "sliding",
            "keeps the last `window` tokens on every attention layer (sliding-window attention)",
            (Knob("window", "tokens each query may attend to", required=True, min=1, max=INDEX_MAX),),
            plan=_sliding_window,
            mlx="cachelib.mlx.rotating:build_sliding",
            torch="cachelib.torch.cache:build_sliding",
            window="window",
            every_attention_layer=True,
        ),
        Strategy(
            "offloaded",
            "full cache kept on the CPU, each layer fetched to the device ahead of use (transformers offloading)",
            (),
            plan=lambda spec, backend: LayerLayout("DynamicLayer", "full", offloaded=True),
            plan_sliding=_offloaded_sliding,
            torch="cachelib.torch.cache:build_offloaded",
            lossless=True,
            transformers_cache="DynamicCache(config=model.config, offloading=True)",
        ),
        # The runtimes' own KV formats, stored bit for bit as they store them (cachelib/*/formats.py).
        Strategy(
            "fp8",
            "keys and values as float8 e4m3, per-tensor scale 1.0 (vLLM --kv-cache-dtype fp8)",
            (),
            plan=_format_layer,
            mlx="cachelib.mlx.formats:build_format",
            torch="cachelib.torch.formats:build_format",
        ),
        Strategy(
            "q8_0",
            "keys and values in ggml q8_0 blocks: 32 int8 codes + an fp16 scale (llama.cpp -ctk/-ctv q8_0)",
            (),
            plan=_format_layer,
            mlx="cachelib.mlx.formats:build_format",
            torch="cachelib.torch.formats:build_format",
        ),
        Strategy(
            "q4_0",
            "keys and values in ggml q4_0 blocks: 32 4-bit codes + an fp16 scale (llama.cpp -ctk/-ctv q4_0)",
            (),
            plan=_format_layer,
            mlx="cachelib.mlx.formats:build_format",
            torch="cachelib.torch.formats:build_format",
        ),
        # Importance-based eviction (docs/importance.md): a token budget per full-attention layer.
        Strategy(
            "knorm",
            "keeps the `budget` keys of lowest L2 norm, evicting every step (no attention needed)",
            (_budget(),),
            plan=importance_layer,
            mlx="cachelib.mlx.importance:build_importance",
            torch="cachelib.torch.importance:build_importance",
            window="budget",
            importance=Method("cachelib.mlx.importance:KNorm", "cachelib.torch.importance:KNorm", needs_queries=False),
        ),
        Strategy(
            "snapkv",
            "keeps `budget` prompt tokens chosen once by an observation window's attention (SnapKV)",
            (
                *_snapkv_knobs(_budget().help),
                Knob(
                    "adaptive",
                    "1: Ada-KV: the layer's KV heads share budget x heads unevenly, by score",
                    0,
                    choices=(0, 1),
                ),
                Knob(
                    "safeguard",
                    "with adaptive=1: percent of budget every head keeps by its own scores",
                    20,
                    min=0,
                    max=100,
                ),
            ),
            plan=importance_layer,
            mlx="cachelib.mlx.importance:build_importance",
            torch="cachelib.torch.importance:build_importance",
            window="budget",
            check=_check_snapkv,
            importance=Method(
                "cachelib.mlx.importance:SnapKV",
                "cachelib.torch.importance:SnapKV",
                compress_once=True,
                window="window",
                per_head=True,
            ),
        ),
        Strategy(
            "pyramidkv",
            "SnapKV with per-layer budgets shrinking with depth, averaging `budget` (PyramidKV)",
            (
                *_snapkv_knobs("mean tokens per full-attention layer; the bottom layer keeps the most"),
                Knob(
                    "beta",
                    "the top layer keeps budget/beta tokens, the bottom 2*budget - budget/beta",
                    20,
                    min=1,
                    max=INDEX_MAX,
                ),
            ),
            plan=importance_layer,
            mlx="cachelib.mlx.importance:build_importance",
            torch="cachelib.torch.importance:build_importance",
            window="budget",
            layered=True,
            check=_check_pyramid,
            importance=Method(  # SnapKV's scores
                "cachelib.mlx.importance:SnapKV",
                "cachelib.torch.importance:SnapKV",
                compress_once=True,
                window="window",
                layer_budget=pyramid_layer_budget,
                smallest_budget=pyramid_smallest_budget,
            ),
        ),
        Strategy(
            "tova",
            "keeps `budget` tokens, evicting the one the current query attends to least, every step (TOVA)",
            (_budget(),),
            plan=importance_layer,
            mlx="cachelib.mlx.importance:build_importance",
            torch="cachelib.torch.importance:build_importance",
            window="budget",
            importance=Method("cachelib.mlx.importance:TOVA", "cachelib.torch.importance:TOVA", protect_newest=1),
        ),
        Strategy(
            "h2o",
            "keeps `budget` tokens: heavy hitters of accumulated attention plus the `recent` newest (H2O)",
            (
                _budget(),
                Knob("recent", "newest tokens never evicted", 8, min=0, max=INDEX_MAX),
            ),
            plan=importance_layer,
            mlx="cachelib.mlx.importance:build_importance",
            torch="cachelib.torch.importance:build_importance",
            window="budget",
            check=lambda spec: _check_budget(spec, "recent"),
            importance=Method("cachelib.mlx.importance:H2O", "cachelib.torch.importance:H2O", window="recent"),
        ),
    )
}
