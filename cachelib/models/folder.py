"""A local model folder (config.json + safetensors, as mlx-lm and Hugging Face write them).

Weights are read from safetensors files only (the bundled model is GGUF, see :mod:`.gguf`).
Pickle checkpoints (``pytorch_model.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``, ``*.pkl``) can run
code when loaded, so they are never loaded: a folder with only those is refused, and next to
safetensors they are ignored (transformers is told ``use_safetensors=True``). Every safetensors
file's header is checked before a loader sees it, so a truncated, empty or foreign file is one
``ValueError`` naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def check_safetensors(path: Path) -> None:
    """ValueError naming ``path`` unless it is a well-formed safetensors file: a header the
    safetensors library accepts (every tensor's dtype, shape and bytes inside the file)."""
    from safetensors import safe_open

    def bad(why: str) -> ValueError:
        return ValueError(f"weights file {str(path)!r} is not a usable safetensors file ({why})")

    try:
        size = path.stat().st_size
    except OSError as e:
        raise bad(f"cannot be read: {e.strerror}") from None
    if size < 8:
        raise bad("it is empty" if size == 0 else f"{size} bytes, too short for a header")
    try:
        with safe_open(str(path), framework="numpy") as f:
            f.keys()
    except Exception as e:  # SafetensorError (a header it refuses), OSError: one line that names the file
        raise bad(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__) from None


def weight_files(path: Path) -> list[Path]:
    """The folder's safetensors files, each checked; ValueError when there are none (naming the
    pickle checkpoints found instead, which are never loaded)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
        if pickles:
            raise ValueError(
                f"model folder {str(path)!r} has only pickle weights ({', '.join(pickles)}); cachelib loads "
                "safetensors and GGUF only, never pickle files (loading one can run code). Convert them to "
                "safetensors (e.g. transformers' save_pretrained(..., safe_serialization=True))"
            )
        raise ValueError(f"model folder {str(path)!r} has no *.safetensors weights")
    for f in files:
        check_safetensors(f)
    return files


def read_folder_config(path: Path) -> dict:
    cfg = path / "config.json"
    if not path.is_dir():
        raise ValueError(f"model folder {str(path)!r} does not exist")
    if not cfg.is_file():
        raise ValueError(f"model folder {str(path)!r} has no config.json")
    weight_files(path)
    try:
        config = json.loads(cfg.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{cfg}: not a model config (a JSON object)")
    if "model_type" not in config:
        raise ValueError(f"{cfg}: missing 'model_type'")
    return config


def mlx_architectures() -> list[str]:
    import pkgutil

    import mlx_lm.models as models

    skip = {
        "base",
        "cache",
        "rope_utils",
        "switch_layers",
        "activations",
        "pipeline",
        "ssm",
        "gated_delta",
        "bitlinear_layers",
    }
    return sorted(m.name for m in pkgutil.iter_modules(models.__path__) if m.name not in skip)


def torch_architectures() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _unsupported(model_type: str, backend: str, supported: list[str]) -> ValueError:
    return ValueError(
        f"architecture {model_type!r} is not supported on {backend}; "
        f"supported ({len(supported)}): {', '.join(supported)}"
    )


def build_mlx(path: Path, dtype: str | None):
    """mlx-lm's own loader: model class chosen by model_type, quantization from the config."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes, load_model

    config = read_folder_config(path)
    try:
        _get_classes(config)
    except (ValueError, ImportError, ModuleNotFoundError):
        raise _unsupported(config["model_type"], "mlx", mlx_architectures()) from None
    model, config = load_model(path)
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))  # floating parameters only; packed weights stay
    mx.eval(model.parameters())
    model.eval()
    return model, config


def build_torch(path: Path, dtype: str | None, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    config = read_folder_config(path)
    if config["model_type"] not in torch_architectures():
        raise _unsupported(config["model_type"], "torch", torch_architectures())
    kwargs = {"dtype": getattr(torch, dtype)} if dtype else {"dtype": "auto"}
    # use_safetensors: a pytorch_model.bin next to the safetensors is never torch.load-ed
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, use_safetensors=True, **kwargs)
    model.to(device)
    model.eval()
    return model, config


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"model folder {str(path)!r} has no usable tokenizer ({e})") from None
