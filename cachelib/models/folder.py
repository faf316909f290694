"""A local model folder (config.json + safetensors, as mlx-lm and Hugging Face write them)."""

from __future__ import annotations

import json
from pathlib import Path


def read_folder_config(path: Path) -> dict:
    cfg = path / "config.json"
    if not path.is_dir():
        raise ValueError(f"model folder {str(path)!r} does not exist")
    if not cfg.is_file():
        raise ValueError(f"model folder {str(path)!r} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"model folder {str(path)!r} has no *.safetensors weights")
    try:
        config = json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg}: not valid JSON ({e})") from None
    if "model_type" not in config:
        raise ValueError(f"{cfg}: missing 'model_type'")
    return config


def mlx_architectures() -> list[str]:
    import pkgutil

    import mlx_lm.models as models

    skip = {"base", "cache", "rope_utils", "switch_layers", "activations", "pipeline", "ssm", "gated_delta", "bitlinear_layers"}
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
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, **kwargs)
    model.to(device)
    model.eval()
    return model, config


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"model folder {str(path)!r} has no usable tokenizer ({e})") from None
