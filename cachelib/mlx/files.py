"""Prompt caches on disk, in mlx-lm's safetensors layout, so that files move both ways between
mlx-lm's ``save_prompt_cache`` / ``load_prompt_cache`` and ours.

Layout: tensors are the flattened per-layer ``state`` trees (``"<layer>.<entry>[.<part>]"``);
non-array leaves are stored as small arrays and listed in the metadata: ``"0.<key>"`` holds the
user's metadata, ``"1.<layer>"`` each layer's class name, ``"2.0"`` an empty string and
``"2.<i>.0"`` / ``"2.<i>.1"`` the tensor name and kind (``scalar``, ``string``, ``none``) of the
i-th non-array leaf. Loading maps class names through :data:`~cachelib.mlx.registry.CACHE_CLASSES`;
an unknown class, a missing tensor or metadata that does not add up is a ValueError naming it.
A state mlx-lm itself loads and can run (e.g. one left_padding entry for every batch row) loads
with a warning naming the file and layer; what mlx-lm could not use is refused.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from ..core.units import clip_input
from .registry import cache_class
from .safetensors import read_safetensors

_KINDS = ("scalar", "string", "none")


def save_prompt_cache(file_name: str | os.PathLike, cache: list, metadata: dict[str, str] | None = None) -> None:
    """Write ``cache`` (a model's list of layer caches) and optional string ``metadata``."""
    metadata = metadata or {}
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"save_prompt_cache: metadata must map str to str, got {key!r}: {value!r}")
    tensors: dict[str, mx.array] = {}
    leaves: list[tuple[str, str]] = []
    for name, leaf in tree_flatten([c.state for c in cache]):
        if isinstance(leaf, mx.array):
            tensors[name] = leaf
        elif isinstance(leaf, (bool, int, float)):
            tensors[name] = mx.array(leaf)
            leaves.append((name, "scalar"))
        elif isinstance(leaf, str):
            tensors[name] = mx.array([ord(ch) for ch in leaf])
            leaves.append((name, "string"))
        elif leaf is None:
            tensors[name] = mx.array([])
            leaves.append((name, "none"))
        else:
            raise ValueError(f"save_prompt_cache: state entry {name} of type {type(leaf).__name__} cannot be stored")
    classes = [type(c).__name__ for c in cache]
    header = dict(tree_flatten([metadata, classes, [""] + leaves]))
    mx.save_safetensors(str(file_name), tensors, header)


def load_prompt_cache(file_name: str | os.PathLike, return_metadata: bool = False):
    """Read a prompt cache written by us or by mlx-lm: a list of our cache objects (and the
    metadata dict with ``return_metadata=True``). The file is checked before any array is made
    (:func:`cachelib.mlx.safetensors.read_safetensors`: a regular file, the safetensors magic
    and header, every tensor's dtype, shape and bytes; no native loader reads it), then every
    non-array entry and every layer's ranks and shapes: anything else is one ``ValueError``
    naming the file, the entry and what was expected."""
    where = f"load_prompt_cache({clip_input(os.fspath(file_name))!r})"
    tensors, header = read_safetensors(file_name, where)
    metadata, classes, leaves = _read_header(header, where)
    for name, kind in leaves:
        if name not in tensors:
            raise ValueError(
                f"{where}: the metadata lists tensor {clip_input(name)!r} ({kind}) but the file has no such tensor"
            )
        tensors[name] = _leaf(tensors[name], name, kind, where)
    states = _layer_states(tensors, classes, where)
    cache = []
    for i, (name, state) in enumerate(zip(classes, states)):
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                cache.append(cache_class(name).from_state(state))
        except (ValueError, TypeError, IndexError, KeyError, OverflowError, AttributeError, RuntimeError) as err:
            raise ValueError(f"{where}: layer {i} ({clip_input(name)}): {clip_input(str(err), 300)}") from None
        for w in caught:  # said again with the file and the layer
            warnings.warn(f"{where}: layer {i} ({name}): {w.message}", w.category, stacklevel=2)
    return (cache, metadata) if return_metadata else cache


MAX_STRING = 1_000_000  # characters of a string leaf (a class name, a mode: a few dozen in practice)


def _leaf(array: mx.array, name: str, kind: str, where: str):
    """The Python value a non-array entry stands for, checked: a scalar is one finite number, a
    string a 1-D array of Unicode code points, a none an empty array."""
    what = f"{where}: non-array entry {clip_input(name)!r} ({kind})"
    if kind == "scalar":
        if array.size != 1 or array.dtype == mx.complex64:
            raise ValueError(f"{what} must hold one number, got shape {tuple(array.shape)} {array.dtype}")
        value = array.item()
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{what} must be a finite number, got {value}")
        return value
    if kind == "string":
        integer = mx.issubdtype(array.dtype, mx.integer)
        if array.ndim != 1 or not integer or array.size > MAX_STRING:
            raise ValueError(
                f"{what} must be a 1-D integer array of at most {MAX_STRING:,} code points, got "
                f"shape {tuple(array.shape)} {array.dtype}"
            )
        codes = array.tolist()
        if codes and not 0 <= min(codes) <= max(codes) <= 0x10FFFF:
            raise ValueError(f"{what} holds {max(codes, key=abs)}, not a Unicode code point (0 to 1,114,111)")
        return "".join(map(chr, codes))
    if array.size:
        raise ValueError(f"{what} must be an empty array, got shape {tuple(array.shape)}")
    return None


def _read_header(header: dict[str, str], where: str) -> tuple[dict, list[str], list[tuple[str, str]]]:
    metadata: dict[str, str] = {}
    classes: dict[int, str] = {}
    leaves: dict[int, dict[int, str]] = {}
    marker = None
    for key, value in header.items():
        top, _, rest = key.partition(".")
        if top == "0" and rest:
            metadata[rest] = value
        elif top == "1" and rest.isdigit():
            classes[int(rest)] = value
        elif top == "2" and rest == "0":
            marker = value
        elif top == "2" and rest.count(".") == 1 and all(p.isdigit() for p in rest.split(".")):
            i, j = map(int, rest.split("."))
            if j not in (0, 1):
                raise ValueError(f"{where}: malformed metadata key {key!r}")
            leaves.setdefault(i, {})[j] = value
        else:
            raise ValueError(f"{where}: unexpected metadata key {key!r}; is this a prompt cache file?")
    if marker is None and not classes:
        raise ValueError(f"{where}: no cache class names in the metadata; is this a prompt cache file?")
    if sorted(classes) != list(range(len(classes))):
        raise ValueError(f"{where}: class names are listed for layers {sorted(classes)}, not 0..{len(classes) - 1}")
    if sorted(leaves) != list(range(1, len(leaves) + 1)):
        raise ValueError(f"{where}: non-array entries are numbered {sorted(leaves)}, not 1..{len(leaves)}")
    out = []
    for i in sorted(leaves):
        entry = leaves[i]
        if set(entry) != {0, 1}:
            raise ValueError(f"{where}: non-array entry {i} needs a tensor name and a kind")
        if entry[1] not in _KINDS:
            raise ValueError(f"{where}: non-array entry {i} has kind {entry[1]!r}; allowed: {', '.join(_KINDS)}")
        out.append((entry[0], entry[1]))
    return metadata, [classes[i] for i in range(len(classes))], out


def _layer_states(tensors: dict[str, Any], classes: list[str], where: str) -> list:
    n_layers = len(classes)
    by_layer: dict[int, list] = {}
    for name, value in tensors.items():
        top, _, rest = name.partition(".")
        parts = name.split(".")
        if not top.isdigit() or not rest:
            raise ValueError(f"{where}: tensor {clip_input(name)!r} does not belong to a layer")
        # tree_unflatten fills index gaps and recurses per part: bounded before it runs
        if len(parts) > MAX_DEPTH or not all(_index(p, len(tensors)) for p in parts[1:]) or int(top) > n_layers:
            raise ValueError(
                f"{where}: tensor name {clip_input(name)!r} is not LAYER.INDEX[.INDEX...] with at most "
                f"{MAX_DEPTH} parts, each below the {len(tensors)} tensors in the file"
            )
        by_layer.setdefault(int(top), []).append((rest, value))
    if sorted(by_layer) != list(range(n_layers)):
        missing = sorted(set(range(n_layers)) - set(by_layer))
        extra = sorted(set(by_layer) - set(range(n_layers)))
        raise ValueError(
            f"{where}: the file names {n_layers} layer classes but holds tensors for layers {sorted(by_layer)}"
            + (f" (missing: {missing})" if missing else "")
            + (f" (unlisted: {extra})" if extra else "")
        )
    return [_unflatten(by_layer[i], where, f"{i} ({classes[i]})") for i in range(n_layers)]


MAX_DEPTH = 8  # parts of a tensor name: layer, entry, part (a CacheList nests two more)


def _index(part: str, count: int) -> bool:
    """Whether ``part`` is a list index a state of ``count`` tensors can have (no leading zeros)."""
    return part.isdigit() and part.isascii() and (part == "0" or not part.startswith("0")) and int(part) < count


def _unflatten(items: list, where: str, layer: str):
    """The state tree of one layer; list indices must run 0..n-1 at every level."""
    tree = tree_unflatten(items)
    _check_dense(tree, where, layer)
    return tree


def _check_dense(tree, where: str, layer: str) -> None:
    # tree_unflatten fills a gap in list indices with {}; no state holds a dict.
    if isinstance(tree, dict):
        raise ValueError(f"{where}: layer {layer} is missing state entries (gaps in its tensor numbering)")
    if isinstance(tree, list):
        for v in tree:
            _check_dense(v, where, layer)
