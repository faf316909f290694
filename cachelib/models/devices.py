"""Which device each backend runs on: MLX's default device, PyTorch's cuda -> mps -> cpu."""

from __future__ import annotations

from ..core.units import BACKENDS, check_backend

__all__ = ["BACKENDS", "check_backend", "available_devices", "activate_mlx_device", "resolve_device"]


def available_devices(backend: str) -> list[str]:
    """Devices this machine offers the backend, best first."""
    check_backend(backend)
    if backend == "mlx":
        import mlx.core as mx

        out = []
        if mx.metal.is_available():
            out.append("metal")
        elif hasattr(mx, "cuda") and mx.cuda.is_available():
            out.append("cuda")
        return out + ["cpu"]
    import torch

    out = []
    if torch.cuda.is_available():
        out.append("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        out.append("mps")
    return out + ["cpu"]


def resolve_device(backend: str, device: str | None) -> str:
    """The device to use: the one asked for (checked), else the backend's best."""
    devices = available_devices(backend)
    if device is None:
        return devices[0]
    name = device.split(":")[0]
    if backend == "mlx" and name == "gpu":
        name = devices[0] if devices[0] != "cpu" else "gpu"
    if name not in devices:
        raise ValueError(
            f"device {device!r} is not available for {backend} on this machine; available: {', '.join(devices)}"
        )
    return device if backend == "torch" else name


def activate_mlx_device(device: str) -> None:
    """Make ``device`` MLX's default (MLX places arrays by default device, not per array)."""
    import mlx.core as mx

    mx.set_default_device(mx.cpu if device == "cpu" else mx.gpu)
