"""Write an artifact directory (the format is described in runtime/artifact.py).

The directory is assembled under a temporary name next to the target and renamed into place at
the end, so an interrupted compile never leaves a half-written artifact behind.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from llmc.compiler.ir import Graph, print_graph
from llmc.models.config import LoadedModel
from llmc.models.provenance import file_sha256
from llmc.runtime.artifact import (ENTRY_FILES, FORMAT, FORMAT_VERSION, MANIFEST, REPORT_FILE,
                                   TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE, ArtifactError)


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _graph_weights(graphs: dict[str, Graph], weights: dict[str, torch.Tensor],
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights the graphs reference, cast to the compute dtype, contiguous and unshared."""
    names = sorted({n.name[2:] for g in graphs.values() for n in g.weights()})
    return {name: weights[name].to(dtype).contiguous().clone() for name in names}


def check_target(out: Path) -> None:
    """Refuse an -o that is a file or a non-empty folder that is not an artifact (its files stay)."""
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"{out} exists and is not a directory; choose another -o directory")
    if out.exists() and not (out / MANIFEST).is_file() and any(out.iterdir()):
        raise ArtifactError(f"{out} exists and is not an llmc artifact; choose another -o directory")


def _prepare_target(out: Path) -> Path:
    check_target(out)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def write_artifact(out: Path, model: LoadedModel, graphs: dict[str, Graph], dtype: torch.dtype,
                   compile_info: dict[str, Any], report: dict[str, Any],
                   weights: dict[str, torch.Tensor] | None = None) -> Path:
    """Write graphs, weights, tokenizer, report and a manifest hashing them all.

    `weights` (default: the model's) holds every tensor the graphs name, including those that
    fold_weights computed."""
    staging = _prepare_target(out)
    for entry, graph in graphs.items():
        (staging / ENTRY_FILES[entry]).write_text(print_graph(graph))
    save_file(_graph_weights(graphs, model.weights if weights is None else weights, dtype),
              str(staging / WEIGHTS_FILE))
    (staging / TOKENIZER_FILE).write_text(model.tokenizer.tokenizer_json)
    (staging / TOKENIZER_CONFIG_FILE).write_text(json.dumps(model.tokenizer.config_dict(), indent=2))
    (staging / REPORT_FILE).write_text(json.dumps(report, indent=2))
    files = {p.name: {"sha256": file_sha256(p), "bytes": p.stat().st_size}
             for p in sorted(staging.iterdir())}
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"llmc": package_version("llmc"), "torch": torch.__version__,
                     "triton": package_version("triton")},
        "model": model.config.to_dict(),
        "source": {"format": model.source_format, "files": model.source_files, "path": model.source_path},
        "compile": compile_info,
        "backends": ["torch"],
        "entries": ENTRY_FILES,
        "files": files,
    }
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out
