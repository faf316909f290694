"""The bundled GGUF's weights, as a backend loads them, kept on disk so the next cold start
skips parsing and dequantizing the GGUF.

One safetensors file per (GGUF content, backend, variant): ``weights/<stem>-<sha256[:16]>-
<backend>-<variant>.safetensors`` under :func:`cachelib.core.home.cache_dir`. The variant
names what the tensors are (``dequantized-float32``, ``quantized-float16``, ...). The file's
metadata carries the model config (so the GGUF is not even opened on a hit), the GGUF's sha256,
the backend and the variant; a file whose header, size or metadata does not match is removed and
rebuilt. Files are written to a temporary name and renamed, so a crash mid-write leaves no file
that looks complete. Bit flips inside the tensor data are not detected (no checksum is read on
load: it would cost a second pass over 0.5 GB); a truncated or garbled file is.

``CACHELIB_WEIGHTS_CACHE=0`` turns the cache off (nothing read, nothing written);
:func:`clear` removes every cached file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

from ..core.home import cache_dir

FORMAT = "1"  # bump when what is stored changes: older files are then rebuilt
ENV = "CACHELIB_WEIGHTS_CACHE"
_DIGESTS: dict[tuple[str, int, int], str] = {}


def enabled() -> bool:
    """False when ``CACHELIB_WEIGHTS_CACHE`` is ``0``, ``off``, ``false`` or ``no``."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def folder() -> Path:
    return cache_dir() / "weights"


def file_digest(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes, computed once per (path, size, mtime): in this process, and
    across processes through a small note next to the cached weights."""
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_size, st.st_mtime_ns)
    if key in _DIGESTS:
        return _DIGESTS[key]
    note = folder() / "digests" / (hashlib.sha256(repr(key).encode()).hexdigest()[:24] + ".txt")
    try:
        digest = note.read_text().strip()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            digest = ""
    except OSError:
        digest = ""
    if not digest:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        digest = h.hexdigest()
        _write_atomic_text(note, digest)
    _DIGESTS[key] = digest
    return digest


def path_for(gguf_path: str | os.PathLike, backend: str, variant: str) -> Path:
    stem = Path(gguf_path).stem
    return folder() / f"{stem}-{file_digest(gguf_path)[:16]}-{backend}-{variant}.safetensors"


def _expected_meta(gguf_path, backend: str, variant: str) -> dict[str, str]:
    return {
        "cachelib_weights_format": FORMAT,
        "gguf_sha256": file_digest(gguf_path),
        "backend": backend,
        "variant": variant,
    }


def read_header(path: Path) -> dict[str, Any] | None:
    """The safetensors header of ``path`` when the file is whole (its size is what the header
    says), else None."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                return None
            (n,) = struct.unpack("<Q", raw)
            if n <= 0 or 8 + n > size or n > 100 << 20:
                return None
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(header, dict):
        return None
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            return None
        end = max(end, int(stop))
    return header if size == 8 + n + end else None


def lookup(gguf_path, backend: str, variant: str) -> tuple[Path, dict[str, Any] | None]:
    """Where the cached weights of ``gguf_path`` go, and the metadata (config and extras, parsed)
    when a whole, matching file is there. A file that does not match is removed."""
    path = path_for(gguf_path, backend, variant)
    if not enabled() or not path.exists():
        return path, None
    header = read_header(path)
    meta = (header or {}).get("__metadata__") or {}
    want = _expected_meta(gguf_path, backend, variant)
    try:
        ok = header is not None and all(meta.get(k) == v for k, v in want.items())
        extras = {k: json.loads(v) for k, v in meta.items() if k.startswith("json:")} if ok else None
    except ValueError:
        ok, extras = False, None
    if not ok:
        discard(path)
        return path, None
    return path, {k.removeprefix("json:"): v for k, v in extras.items()}


def metadata(gguf_path, backend: str, variant: str, **extras: Any) -> dict[str, str]:
    """What a cached file's metadata holds: the identity fields and ``extras`` as JSON."""
    return {**_expected_meta(gguf_path, backend, variant), **{f"json:{k}": json.dumps(v) for k, v in extras.items()}}


def store(path: Path, save, nbytes: int) -> bool:
    """Write the cache file through ``save(tmp_path)`` and rename it into place; False (and no
    file) when the cache is off, the disk lacks room for twice ``nbytes``, or writing fails."""
    if not enabled():
        return False
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}.safetensors")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(path.parent).free < 2 * nbytes:
            return False
        save(tmp)
        if read_header(tmp) is None:
            raise OSError("the written file does not read back whole")
        os.replace(tmp, path)
        return True
    except Exception:  # a read-only or full disk only costs the dequantization next time
        discard(tmp)
        return False


def discard(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def clear() -> int:
    """Remove every cached weights file (and digest note); returns the bytes freed."""
    root = folder()
    freed = 0
    if not root.exists():
        return 0
    for p in [*root.glob("*.safetensors"), *root.glob(".*.safetensors"), *root.glob("digests/*.txt")]:
        try:
            freed += p.stat().st_size
            p.unlink()
        except OSError:
            pass
    _DIGESTS.clear()
    return freed


def _write_atomic_text(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        pass
