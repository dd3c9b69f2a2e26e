"""One entry point for every model source: HF folder, GGUF file, or the embedded default."""

from __future__ import annotations

from pathlib import Path

from .config import LoadedModel, ModelError
from .embedded import embedded_model_path
from .hf_loader import load_hf_folder


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
    from .gguf_loader import load_gguf

    path = resolve_source(source)
    if path.is_dir():
        return load_hf_folder(path)
    if path.suffix.lower() == ".gguf":
        return load_gguf(path)
    raise ModelError(f"{path} is neither a model folder nor a .gguf file; give one of those")
