"""One entry point for every model source: HF folder, GGUF file, or the embedded default."""

from __future__ import annotations

from pathlib import Path

import json

from .config import LoadedModel, ModelConfig, ModelError
from .embedded import embedded_model_path
from .gguf_loader import load_gguf, read_gguf_config
from .hf_loader import config_from_hf, load_hf_folder


def resolve_source(source: str | Path | None) -> Path:
    """The path a model argument names (None: the embedded default)."""
    if source is None:
        return embedded_model_path()
    path = Path(source)
    if not path.exists():
        raise ModelError(f"model path {path} does not exist; give a Hugging Face folder or a .gguf file")
    return path


def load_model(source: str | Path | None) -> LoadedModel:
    """Load a Hugging Face folder, a .gguf file, or (None) the embedded SmolLM2 default."""
    path = resolve_source(source)
    if path.is_dir():
        model = load_hf_folder(path)
    elif path.suffix.lower() == ".gguf":
        model = load_gguf(path)
    else:
        raise ModelError(f"{path} is neither a model folder nor a .gguf file; give one of those")
    model.source_path = str(path.resolve())
    return model


def load_config(source: str | Path | None) -> ModelConfig:
    """Only the architecture: from a config.json file, an HF folder, or a .gguf (no weights read)."""
    path = resolve_source(source)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ModelError(f"{path.parent} has no config.json; give a config.json, a model folder or a .gguf")
    if path.suffix.lower() == ".gguf":
        return read_gguf_config(path)
    try:
        return config_from_hf(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ModelError(f"{path} is not a JSON config file; give a config.json, a model folder or a .gguf") from None
