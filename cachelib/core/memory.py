"""What memory a process may still allocate: the machine's (or a CUDA device's) and ``RLIMIT_AS``.

Used by every check made before allocating (the run guard, the prompt-cache reader). Under
``ulimit -v`` MLX ends with a segmentation fault when an allocation is refused, so the lower of
the two is what a check may count on.
"""

from __future__ import annotations


def available_memory(device: str) -> int:
    """Bytes this process may still allocate on ``device``: the GPU's free memory for a CUDA
    device; else the machine's available memory (psutil; MLX on Apple silicon shares it with the
    GPU), or what ``RLIMIT_AS`` (``ulimit -v``) leaves beside the process's mappings, whichever is
    lower (MLX ends with a segmentation fault when an allocation is refused, so it must not be)."""
    if str(device).startswith("cuda"):
        return _cuda_memory(device)[0]
    import psutil

    available = int(psutil.virtual_memory().available)
    room = address_space_room()
    return available if room is None else min(available, room)


def address_space_room() -> int | None:
    """What ``RLIMIT_AS`` leaves beside the process's mappings now; None when unlimited."""
    cap = address_space_limit()
    if cap is None:
        return None
    import psutil

    return max(0, cap - int(psutil.Process().memory_info().vms))


def machine_memory(device: str) -> int:
    """All the memory of ``device``: the GPU's for a CUDA device, else the machine's, or
    ``RLIMIT_AS`` when that is lower."""
    if str(device).startswith("cuda"):
        return _cuda_memory(device)[1]
    import psutil

    total = int(psutil.virtual_memory().total)
    cap = address_space_limit()
    return total if cap is None else min(total, cap)


def _cuda_memory(device: str) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device, as the driver reports them."""
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    return int(free), int(total)


def address_space_limit() -> int | None:
    """The soft ``RLIMIT_AS`` in bytes, None when unlimited (or where there is none)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else int(soft)


# A strategy batch's per-layer key/value buffers hold every row's keys and values as its attention
# reads them (a quantized row's dequantized): the bytes a runtime's own batch of those rows would
# hold as its cache. They may take this share of the memory available when they first need more
# than the floor (measured then), and never less than the floor.
BATCH_BUFFER_SHARE = 0.25
BATCH_BUFFER_FLOOR = 1 << 30


def batch_buffer_limit(available: int) -> int:
    """The most a strategy batch's key/value buffers may hold, all layers together, on a device
    with ``available`` bytes free (:func:`available_memory`): a quarter of it, at least 1 GiB."""
    return max(BATCH_BUFFER_FLOOR, int(available * BATCH_BUFFER_SHARE))


def check_buffer_bytes(value, where: str) -> int | None:
    """A strategy batch's ``buffer_bytes`` argument: an integer >= 0 (0: no buffers) or None (the
    limit :func:`settle_buffer_limit` measures); else a ValueError naming ``where``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{where}: buffer_bytes must be an integer >= 0 or None, got {value!r}")
    return value


def settle_buffer_limit(limit: int | None, need: int, device: str) -> tuple[int | None, bool]:
    """A strategy batch's buffer limit once its buffers ask for ``need`` bytes, and whether they
    may hold them: a ``limit`` given or measured before stands; None (the floor) stands while
    ``need`` is within :data:`BATCH_BUFFER_FLOOR`; past it the limit is measured, once, from what
    ``device`` has available now (:func:`batch_buffer_limit`)."""
    if limit is None and need > BATCH_BUFFER_FLOOR:
        limit = batch_buffer_limit(available_memory(device))
    return limit, need <= (BATCH_BUFFER_FLOOR if limit is None else limit)
