"""A safetensors file read in Python, every byte checked before an array is made.

Prompt-cache files come from anywhere. ``mx.load`` picks its native parser by the file's
extension (a crafted 52-byte ``x.gguf`` ended the process with a segmentation fault) and trusts
the header it parses, so :func:`read_safetensors` never hands a file to it. It follows the
format as the safetensors project specifies it (https://github.com/huggingface/safetensors,
"Format": an 8-byte little-endian header size N, N bytes of a UTF-8 JSON object mapping each
tensor name to ``dtype``, ``shape`` and ``data_offsets`` [begin, end) into the byte buffer after
the header, plus an optional ``__metadata__`` map of strings), and checks: a regular file (no
device or pipe), N within the file and a cap, the JSON object and its nesting, each dtype one
MLX holds, each shape a list of non-negative integers whose bytes equal ``end - begin``, offsets
within the buffer and not overlapping, and enough memory for the arrays. Any fault is one
``ValueError`` naming the file and the entry.
"""

from __future__ import annotations

import json
import math
import os

import mlx.core as mx
import numpy as np

from ..core.reader import check_nesting, file_kind, kind_at, label
from ..core.units import clip_input

MAX_HEADER = 100_000_000  # bytes of JSON header (the safetensors library's own limit is 100 MB)
MAX_RANK = 8
MAX_TENSORS = 1_000_000

# safetensors dtype -> (numpy dtype read from the bytes, MLX dtype it becomes)
DTYPES = {
    "F64": (np.float64, mx.float64),
    "F32": (np.float32, mx.float32),
    "F16": (np.float16, mx.float16),
    "BF16": (np.uint16, mx.bfloat16),
    "I64": (np.int64, mx.int64),
    "I32": (np.int32, mx.int32),
    "I16": (np.int16, mx.int16),
    "I8": (np.int8, mx.int8),
    "U64": (np.uint64, mx.uint64),
    "U32": (np.uint32, mx.uint32),
    "U16": (np.uint16, mx.uint16),
    "U8": (np.uint8, mx.uint8),
    "BOOL": (np.bool_, mx.bool_),
}


def read_safetensors(path: str | os.PathLike, where: str | None = None) -> tuple[dict[str, mx.array], dict[str, str]]:
    """(tensors by name, the ``__metadata__`` strings) of the safetensors file ``path``; a
    ``ValueError`` starting with ``where`` (default: the file's name) for anything that is not
    a well-formed safetensors file, checked before any array is made."""
    where = where or label(path, "safetensors file")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except IsADirectoryError:
        raise ValueError(f"{where}: a folder, not a prompt cache file") from None
    except OSError as e:
        kind = kind_at(path)  # a socket cannot be opened at all: say what it is
        if kind:
            raise ValueError(f"{where}: {kind}, not a file; cachelib reads regular files only") from None
        raise ValueError(f"{where}: cannot read the file ({e.strerror or e})") from None
    with os.fdopen(fd, "rb", buffering=0) as f:
        st = os.fstat(fd)
        kind = file_kind(st.st_mode)
        if kind:
            raise ValueError(f"{where}: {kind}, not a file; cachelib reads regular files only")
        head = _read(f, 8)
        if len(head) < 8:
            raise ValueError(
                f"{where}: {len(head)} bytes, too short for a safetensors file (an 8-byte header size, "
                "then a JSON header)"
            )
        n = int.from_bytes(head, "little")
        if not 2 <= n <= min(MAX_HEADER, max(0, st.st_size - 8)):
            raise ValueError(
                f"{where}: not a safetensors file (its first 8 bytes give a header of {n:,} bytes; "
                f"allowed: 2 to {min(MAX_HEADER, max(0, st.st_size - 8)):,} in this "
                f"{st.st_size:,}-byte file)"
            )
        raw = _read(f, n)
        if len(raw) != n:
            raise ValueError(f"{where}: the file ends inside its {n:,}-byte header")
        entries, metadata = _header(raw, where)
        size = st.st_size - 8 - n
        spans = sorted((begin, end, name) for name, (_, _, begin, end) in entries.items())
        for (b0, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise ValueError(
                    f"{where}: tensors {clip_input(n0)!r} and {clip_input(n1)!r} overlap "
                    f"(bytes {b0:,}..{e0:,} and {b1:,}..)"
                )
        if spans and spans[-1][1] > size:
            end, name = spans[-1][1], spans[-1][2]
            raise ValueError(f"{where}: tensor {clip_input(name)!r} ends at byte {end:,} of a data buffer of {size:,}")
        _check_memory(sum(e - b for b, e, _ in spans), where)
        need = spans[-1][1] if spans else 0
        data = bytearray(need)  # one buffer, filled in place: no second copy of the data
        got = _read_into(f, data)
    if got != need:
        raise ValueError(f"{where}: the file ended after {got:,} data bytes; its header needs more")
    tensors = {}
    for name, (dtype, shape, begin, end) in entries.items():
        np_dtype, mx_dtype = DTYPES[dtype]
        array = np.frombuffer(data, dtype=np.dtype(np_dtype).newbyteorder("<"), count=math.prod(shape), offset=begin)
        array = mx.array(array.astype(np_dtype, copy=False).reshape(shape))
        tensors[name] = array.view(mx.bfloat16) if dtype == "BF16" else array
    return tensors, metadata


def _read_into(f, buffer: bytearray) -> int:
    """Fill ``buffer`` from ``f``; the bytes read (fewer when the file ends first)."""
    view, got = memoryview(buffer), 0
    while got < len(buffer):
        n = f.readinto(view[got : got + (1 << 26)])
        if not n:
            break
        got += n
    return got


def _read(f, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = f.read(min(n - got, 1 << 24))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _header(raw: bytes, where: str) -> tuple[dict[str, tuple], dict[str, str]]:
    """The checked header: name -> (dtype, shape, begin, end), and the metadata strings."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not a safetensors file (its header is not UTF-8 text: byte {e.start})") from None
    if not text.lstrip().startswith("{"):
        raise ValueError(f"{where}: not a safetensors file (its header is not a JSON object)")
    check_nesting(text, where, 4)
    try:
        header = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        why = clip_input(str(e))
        raise ValueError(f"{where}: not a safetensors file (its header is not valid JSON: {why})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{where}: not a safetensors file (its header is not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    strings = isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    if not strings:
        raise ValueError(f"{where}: __metadata__ must map strings to strings")
    if len(header) > MAX_TENSORS:
        raise ValueError(f"{where}: {len(header):,} tensors; at most {MAX_TENSORS:,} are allowed")
    entries = {}
    for name, entry in header.items():
        what = f"{where}: tensor {clip_input(name)!r}"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"{what} must be an object with dtype, shape and data_offsets, got {clip_input(entry)}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPES:
            raise ValueError(f"{what}: dtype {clip_input(dtype)!r} is not one MLX holds; allowed: {', '.join(DTYPES)}")
        if not _ints(shape) or len(shape) > MAX_RANK:
            raise ValueError(
                f"{what}: shape must be a list of at most {MAX_RANK} integers >= 0, got {clip_input(shape)}"
            )
        if not _ints(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
            raise ValueError(
                f"{what}: data_offsets must be [begin, end] with 0 <= begin <= end, got {clip_input(offsets)}"
            )
        nbytes = math.prod(shape) * np.dtype(DTYPES[dtype][0]).itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise ValueError(
                f"{what}: shape {tuple(shape)} of {dtype} needs {nbytes:,} bytes but data_offsets span "
                f"{offsets[1] - offsets[0]:,}"
            )
        entries[name] = (dtype, [int(d) for d in shape], int(offsets[0]), int(offsets[1]))
    return entries, metadata


def _ints(values) -> bool:
    return isinstance(values, list) and all(type(v) is int and 0 <= v < 2**62 for v in values)


def _check_memory(nbytes: int, where: str) -> None:
    """Refuse arrays the machine cannot hold before reading them (twice: the bytes and the arrays)."""
    from ..core.memory import available_memory  # the lower of available memory and RLIMIT_AS

    available = available_memory("cpu")
    if 2 * nbytes > available:
        raise ValueError(
            f"{where}: its arrays need {nbytes:,} bytes, more than half the {available:,} bytes of memory available"
        )
