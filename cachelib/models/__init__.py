"""Load a model and its tokenizer for a backend.

``load(name_or_path, backend, device=None)`` takes:

- ``"smollm2"``: the bundled SmolLM2-135M-Instruct GGUF (real weights, Q4_1 / Q8_0);
- a preset name (``"tiny-llama"``, ``"tiny-gemma3"``, ``"tiny-mamba"``): real model classes at
  toy sizes with random weights;
- a path to a local model folder (config.json + safetensors).

It returns a :class:`LoadedModel`: the backend's model object (an mlx-lm ``nn.Module`` or a
transformers ``PreTrainedModel``), a Hugging Face tokenizer (the same object for both backends)
and a :class:`ModelInfo`.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import folder as _folder
from . import gguf as _gguf
from . import presets as _presets
from .devices import BACKENDS, activate_mlx_device, available_devices, check_backend, resolve_device

BUNDLED = _gguf.BUNDLED_NAME
DTYPES = ("float32", "float16", "bfloat16")
WEIGHTS = ("auto", "quantized", "dequantized")

__all__ = ["load", "LoadedModel", "ModelInfo", "model_names", "available_devices", "BUNDLED", "BACKENDS"]


@dataclass(frozen=True)
class ModelInfo:
    name: str
    source: str  # file or folder the weights came from
    backend: str
    device: str
    dtype: str  # activation / KV dtype
    architecture: str  # model_type
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    weight_bytes: int
    weight_format: str
    random_weights: bool
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    max_position_embeddings: int | None = None
    load_seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    info: ModelInfo

    @property
    def backend(self) -> str:
        return self.info.backend


def model_names() -> list[str]:
    """Names ``load`` accepts besides folder paths."""
    return [BUNDLED, *_presets.preset_names()]


def load(
    name_or_path: str | os.PathLike = BUNDLED,
    backend: str = "mlx",
    device: str | None = None,
    dtype: str = "float32",
    weights: str = "auto",
    progress: Callable[[str, float], None] | None = None,
) -> LoadedModel:
    """Load a model + tokenizer for ``backend`` on ``device`` (default: the best available).

    ``weights`` applies to the bundled GGUF on MLX: ``"quantized"`` keeps its Q4_1/Q8_0 blocks as
    MLX quantized weights; ``"dequantized"`` expands them to ``dtype``; ``"auto"`` (default) keeps
    them quantized on a GPU and dequantizes on the CPU, where MLX's quantized kernels prefill
    ~20x and decode ~2x slower than float32 with OpenBLAS (measured, see README). PyTorch always
    runs the GGUF dequantized. The weight values are the same either way. The bundled model's
    weights, as loaded, are cached on disk (:mod:`cachelib.models.weights_cache`), so only the
    first load on a machine parses and dequantizes the GGUF.

    ``progress(stage, fraction)``, when given, is called as loading goes: ``stage`` says what it
    is doing (``"loading the tokenizer"``, ``"reading the GGUF"``, ``"dequantizing"``,
    ``"reading cached weights"``, ``"building the model"``, ...), ``fraction`` how far it is
    (0 to 1, ending with ``("loaded", 1.0)``).
    """
    check_backend(backend)
    _quiet_transformers()
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}; supported: {', '.join(WEIGHTS)}")
    device = resolve_device(backend, device)
    start = time.perf_counter()
    name = str(name_or_path)
    if name == BUNDLED:
        loaded = _load_bundled(backend, device, dtype, weights, progress or _no_progress)
    elif name in _presets.PRESETS:
        loaded = _load_folder(_presets.preset_folder(name), backend, device, dtype, name, progress or _no_progress)
    elif os.sep in name or name.startswith(".") or Path(name).exists():
        path = Path(name).expanduser()
        loaded = _load_folder(path, backend, device, dtype, path.name, progress or _no_progress)
    else:
        raise ValueError(f"unknown model {name!r}; use one of: {', '.join(model_names())}, or a path to a model folder")
    info = ModelInfo(**{**asdict(loaded.info), "load_seconds": round(time.perf_counter() - start, 3)})
    if progress is not None:
        progress("loaded", 1.0)
    return LoadedModel(loaded.model, loaded.tokenizer, info)


def _no_progress(stage: str, fraction: float) -> None:
    pass


def _quiet_transformers() -> None:
    """No per-tensor progress bars: loads happen inside apps and test logs."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def _weight_bytes(model, backend: str) -> int:
    if backend == "mlx":
        from mlx.utils import tree_flatten

        return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    seen, total = set(), 0
    for p in list(model.parameters()) + list(model.buffers()):
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def _info(config: dict, *, name, source, backend, device, dtype, weight_bytes, weight_format, random_weights):
    text = config.get("text_config", config)
    heads = text.get("num_attention_heads", 0) or 0
    hidden = text.get("hidden_size") or text.get("d_model") or 0
    layer_types = text.get("layer_types") or []
    return ModelInfo(
        name=name,
        source=str(source),
        backend=backend,
        device=device,
        dtype=dtype,
        architecture=text.get("model_type", config.get("model_type", "")),
        num_layers=int(text.get("num_hidden_layers") or text.get("n_layer") or 0),
        hidden_size=int(hidden),
        num_heads=int(heads),
        num_kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or (hidden // heads if heads else 0)),
        vocab_size=int(text.get("vocab_size", 0)),
        weight_bytes=int(weight_bytes),
        weight_format=weight_format,
        random_weights=random_weights,
        layer_types=tuple(layer_types),
        sliding_window=text.get("sliding_window"),
        max_position_embeddings=text.get("max_position_embeddings"),
    )


def _load_bundled(backend: str, device: str, dtype: str, weights: str, progress) -> LoadedModel:
    path = _gguf.bundled_path()
    progress("loading the tokenizer", 0.0)
    tokenizer = _gguf.load_tokenizer(str(path))

    def weights_progress(stage: str, fraction: float) -> None:  # the weights take 10-95%
        progress(stage, 0.1 + 0.85 * fraction)

    if backend == "mlx":
        activate_mlx_device(device)
        quantized = weights == "quantized" or (weights == "auto" and device != "cpu")
        model, config, quant = _gguf.build_mlx(path, dtype, quantized, weights_progress)
        if quantized:
            bits = sorted({q["bits"] for q in quant.values()})
            fmt = "GGUF Q4_1/Q8_0 as MLX affine " + "/".join(f"{b}-bit" for b in bits)
            fmt += f", group {_gguf.GGUF_GROUP_SIZE}"
        else:
            fmt = f"GGUF Q4_1/Q8_0 dequantized to {dtype}"
    else:
        if weights == "quantized":
            raise ValueError("weights='quantized' is for MLX; PyTorch runs the GGUF dequantized (use 'auto')")
        model, config = _gguf.build_torch(path, dtype, device, weights_progress)
        fmt = f"GGUF Q4_1/Q8_0 dequantized to {dtype}"
    info = _info(
        config,
        name="SmolLM2-135M-Instruct",
        source=path,
        backend=backend,
        device=device,
        dtype=dtype,
        weight_bytes=_weight_bytes(model, backend),
        weight_format=fmt,
        random_weights=False,
    )
    return LoadedModel(model, tokenizer, info)


def _load_folder(path: Path, backend: str, device: str, dtype: str, name: str, progress) -> LoadedModel:
    config = _folder.read_folder_config(path)
    progress("reading the weights", 0.1)
    if backend == "mlx":
        activate_mlx_device(device)
        model, config = _folder.build_mlx(path, dtype)
        fmt = "MLX quantized" if config.get("quantization") else dtype
    else:
        model, config = _folder.build_torch(path, dtype, device)
        fmt = dtype
    progress("loading the tokenizer", 0.9)
    tokenizer = _folder.load_tokenizer(path)
    info = _info(
        config,
        name=name,
        source=path,
        backend=backend,
        device=device,
        dtype=dtype,
        weight_bytes=_weight_bytes(model, backend),
        weight_format=fmt,
        random_weights=bool(config.get("cachelib_preset")),
    )
    return LoadedModel(model, tokenizer, info)
