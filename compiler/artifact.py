"""Write an artifact directory (the format: compiler/artifact_format.py).

The directory is assembled in a fresh hidden folder next to the target and renamed into place at
the end, so an interrupted compile never leaves a half-written artifact behind. An existing
target is replaced only if it is an llmc artifact holding nothing but the files its manifest
lists: it is renamed aside, the new one renamed in, and only then is the old one removed, so at
every moment one complete artifact sits under one of the two names. Any other folder is refused
and left as it is.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from llmc.compiler.dtypes import to_torch
from llmc.compiler.ir import Graph, print_graph
from llmc.models.config import LoadedModel

from .artifact_format import (ALL_ENTRY_FILES, CPU_KERNELS_FILE, FORMAT, FORMAT_VERSION, KERNELS_DIR, MANIFEST,
                              REPORT_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE, ArtifactError,
                              check_file_list, file_entries, is_artifact_manifest)
from .tensor_parallel import TensorParallelPlan


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


COMPILER_PACKAGES = ("llmc.compiler", "llmc.passes", "llmc.models", "llmc.kernels")   # what makes an artifact


def compiler_code_hash() -> str:
    """A short hash of the Python sources that make an artifact (frontend, passes, model families,
    formats and kernel templates): two artifacts compiled by the same code from the same model are
    the same, so a cached artifact whose hash differs was made by other code."""
    digest = hashlib.sha256()
    for package in COMPILER_PACKAGES:
        root = Path(importlib.util.find_spec(package).submodule_search_locations[0])
        for source in sorted(root.rglob("*.py")):
            digest.update(source.relative_to(root).as_posix().encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:16]


def stale_code(manifest: dict) -> str | None:
    """Why an artifact's figures would not be this code's (it was compiled by other llmc code), or None."""
    made_by, this = manifest.get("versions", {}).get("compiler_code"), compiler_code_hash()
    if made_by == this:
        return None
    return (f"the artifact was compiled by other llmc code ({made_by or 'before code hashes'}, this is "
            f"{this}); compile it again for figures of this code")


def graph_weights(graphs: dict[str, Graph], weights: dict[str, torch.Tensor],
                  plan: TensorParallelPlan = TensorParallelPlan()) -> dict[str, torch.Tensor]:
    """The weights the graphs reference, each in the element type its weight node declares (the
    compute dtype for float weights; quantized codes stay integers), contiguous and unshared; of a
    sharded graph, the whole tensors each rank's part is cut from (`plan`)."""
    declared = {plan.source(n.name[2:]): n.type.dtype for g in graphs.values() for n in g.weights()}
    return {name: weights[name].to(to_torch(declared[name])).contiguous().clone() for name in sorted(declared)}


def _listed_files(out: Path) -> dict | None:
    """The `files` section of `out`'s manifest if `out` holds an llmc artifact manifest, else None."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    files = manifest.get("files") if is_artifact_manifest(manifest) else None
    return files if isinstance(files, dict) else None


def check_target(out: Path) -> None:
    """Refuse an -o that is a file, or a non-empty folder that is not an llmc artifact made only of
    the files its manifest lists (such a folder and its files stay as they are)."""
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"{out} exists and is not a directory; choose another -o directory")
    if not out.exists() or not any(out.iterdir()):
        return
    listed = _listed_files(out)
    if listed is None:
        raise ArtifactError(f"{out} exists and is not an llmc artifact; choose another -o directory")
    try:
        check_file_list(out, listed)
    except ArtifactError as exc:
        raise ArtifactError(f"{out} is an llmc artifact with other files in it, so it is not replaced "
                            f"({str(exc).split(';')[0]}); move those files or choose another -o directory") from None


def _sibling(out: Path, role: str) -> Path:
    """A fresh hidden name next to `out` (never an existing folder of the user's)."""
    return out.with_name(f".{out.name}.{role}-{uuid.uuid4().hex[:12]}")


def _replace(out: Path, staging: Path) -> None:
    """Put the finished `staging` folder at `out`, moving a checked old artifact aside first."""
    if out.exists() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        staging.rename(out)
        return
    old = _sibling(out, "old")
    out.rename(old)
    staging.rename(out)
    shutil.rmtree(old)


def write_artifact(out: Path, model: LoadedModel, graphs: dict[str, Graph],
                   compile_info: dict[str, Any], report: dict[str, Any],
                   weights: dict[str, torch.Tensor] | None = None, kernels: dict[str, str] | None = None,
                   cpu_kernels: str | None = None, plan: TensorParallelPlan = TensorParallelPlan()) -> Path:
    """Write graphs, weights, tokenizer, report and a manifest hashing them all.

    `weights` (default: the model's) holds every tensor the graphs name, including those that
    fold_weights computed. `kernels` (cuda target) maps kernel module names to their generated
    source, written as kernels/<name>.py; the artifact then lists the triton backend too.
    `cpu_kernels` (every target) is the generated C++ of the CPU units, kernels/cpu/generated.cpp.
    `plan` (a --tp compile's) goes into the manifest as "tensor_parallel"."""
    check_target(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = _sibling(out, "partial")
    staging.mkdir()
    try:
        _write_files(staging, model, graphs, compile_info, report, weights, kernels, cpu_kernels, plan)
        check_target(out)          # again: the folder may have changed during the compile
        _replace(out, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _write_files(staging: Path, model: LoadedModel, graphs: dict[str, Graph],
                 compile_info: dict[str, Any], report: dict[str, Any], weights: dict[str, torch.Tensor] | None,
                 kernels: dict[str, str] | None, cpu_kernels: str | None, plan: TensorParallelPlan) -> None:
    if kernels:
        (staging / KERNELS_DIR).mkdir()
        for name, source in kernels.items():
            (staging / KERNELS_DIR / f"{name}.py").write_text(source)
    if cpu_kernels is not None:
        (staging / CPU_KERNELS_FILE).parent.mkdir(parents=True, exist_ok=True)
        (staging / CPU_KERNELS_FILE).write_text(cpu_kernels)
    for entry, graph in graphs.items():
        (staging / ALL_ENTRY_FILES[entry]).write_text(print_graph(graph))
    save_file(graph_weights(graphs, model.weights if weights is None else weights, plan),
              str(staging / WEIGHTS_FILE))
    (staging / TOKENIZER_FILE).write_text(model.tokenizer.tokenizer_json)
    (staging / TOKENIZER_CONFIG_FILE).write_text(json.dumps(model.tokenizer.config_dict(), indent=2))
    (staging / REPORT_FILE).write_text(json.dumps(report, indent=2))
    files = file_entries(staging)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"llmc": package_version("llmc"), "compiler_code": compiler_code_hash(),
                     "torch": torch.__version__, "triton": package_version("triton")},
        "model": model.config.to_dict(),
        "source": {"format": model.source_format, "files": model.source_files, "path": model.source_path},
        "compile": compile_info,
        "backends": ["torch", "triton"] if kernels else ["torch"],
        "entries": {entry: ALL_ENTRY_FILES[entry] for entry in graphs},
        "files": files,
    }
    if plan.size > 1:
        manifest["tensor_parallel"] = plan.to_manifest()
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
