"""Strategy specs: one string names a cache strategy of the table (:mod:`cachelib.strategies`)
and its knobs, on both backends.

Grammar::

    spec  := name [":" knob ("," knob)*]
    knob  := key "=" value

e.g. ``standard``, ``rotating:max_size=512,keep=4``, ``quantized:bits=4,group_size=64,start=256``.
Parsing and validation live here and only here; a bad spec raises :class:`SpecError` (a
``ValueError``) naming the strategy or knob at fault and what is allowed. The table's names are
importable from here too (``from cachelib.spec import STRATEGIES``).
"""

from __future__ import annotations

from typing import Any, Mapping

from .strategies import (  # noqa: F401  (the table's names, importable from here)
    GROUP_SIZES,
    QUANT_BITS,
    STRATEGIES,
    TORCH_QUANT_BITS,
    Knob,
    Spec,
    SpecError,
    Strategy,
    importance_layer,
)


def split_spec(text: str, *, ranges: bool = False) -> tuple[str, dict[str, str | list[str]]]:
    """The grammar, without validation: ``"rotating:max_size=512,keep=4"`` ->
    ``("rotating", {"max_size": "512", "keep": "4"})``. With ``ranges`` a value may be a
    bracketed list, ``max_size=[64,128]`` -> ``["64", "128"]`` (the sweep grid's knob ranges)."""
    if not isinstance(text, str) or not text.strip():
        raise SpecError(f"empty strategy spec; choose one of: {', '.join(STRATEGIES)}")
    name, colon, rest = text.strip().partition(":")
    name = name.strip()
    if colon and not rest.strip():
        raise SpecError(f"{name}: ':' must be followed by knobs, e.g. {name}:key=value")
    given: dict[str, str | list[str]] = {}
    for part in _split_outside_brackets(rest) if colon else ():
        key, eq, value = (x.strip() for x in part.partition("="))
        if not eq or not key or not value:
            form = "key=value or key=[v1, v2]" if ranges else "key=value, e.g. bits=4"
            raise SpecError(f"{name}: malformed knob {part.strip()!r}; write {form}", key or None)
        if key in given:
            raise SpecError(f"{name}: knob {key!r} given twice", key)
        if ranges and (value.startswith("[") or value.endswith("]")):
            if not (value.startswith("[") and value.endswith("]")):
                raise SpecError(f"{name}: knob {key!r}: unbalanced brackets in {value!r}", key)
            items = [x.strip() for x in value[1:-1].split(",")]
            if items != [""] and any(not x for x in items):
                raise SpecError(f"{name}: knob {key!r}: empty value in range {value!r}", key)
            given[key] = [] if items == [""] else items
        else:
            given[key] = value
    return name, given


def _split_outside_brackets(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts


def parse_spec(text: str | Spec) -> Spec:
    """Parse and validate a strategy spec such as ``rotating:max_size=512,keep=4``."""
    if isinstance(text, Spec):
        return text
    name, given = split_spec(text)
    return make_spec(name, given)


def strategy(name: str) -> Strategy:
    """The table entry of ``name``; a :class:`SpecError` naming the choices otherwise."""
    if name not in STRATEGIES:
        raise SpecError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def make_spec(name: str, knobs: Mapping[str, Any] | None = None) -> Spec:
    """Build a validated :class:`Spec` from a name and knob values (None values are dropped)."""
    entry = strategy(name)
    knobs = {k: v for k, v in (knobs or {}).items() if v is not None}
    values = {k: entry.knob(k).check(name, v) for k, v in knobs.items()}
    for knob in entry.knobs:
        if knob.required and knob.name not in values:
            raise SpecError(
                f"{name}: knob {knob.name!r} is required ({knob.help}), e.g. {name}:{knob.name}=512", knob.name
            )
    params = tuple((k.name, values[k.name]) for k in entry.knobs if k.name in values)
    spec = Spec(name, params)
    if entry.check is not None:
        entry.check(spec)
    return spec


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


def mlx_flags(spec: str | Spec) -> dict[str, int] | None:
    """The inverse of :func:`spec_from_mlx_flags`: the mlx-lm generate flags (by their keyword
    names) that build ``spec``, or None when no flags do. ``rotating`` is mlx-lm's only with its
    4 sink tokens and unquantized; ``quantized`` only with one bit width for keys and values."""
    spec = parse_spec(spec)
    if spec.reference:
        return {}
    flags = spec.strategy.mlx_lm_flags
    return None if flags is None else flags(spec)
