"""The artifact directory: format constants, loading, and verification.

    manifest.json          format + version, model config, source hashes, pass list and options,
                           llmc / torch / triton versions, backends, sha256 + size of every file
    prefill.ir, decode.ir  the entry graphs in IR text
    weights.safetensors    every weight the graphs reference, by canonical name
    tokenizer.json         Hugging Face fast-tokenizer file
    tokenizer_config.json  chat template, bos/eos tokens, add_bos_token
    report.json            what each pass did (hits, node counts, seconds), op counts per graph and
                           per decoder layer, seconds per compile stage

`verify_artifact` turns every mismatch into an `ArtifactError` with one sentence that names the
file and the fix; nothing is trusted before its hash is checked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from llmc.compiler.ir import Graph, IRError, parse_graph
from llmc.compiler.ops import verify
from llmc.models.config import ModelConfig, ModelError, TokenizerFiles
from llmc.models.provenance import file_sha256

FORMAT = "llmc-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
ENTRY_FILES = {"prefill": "prefill.ir", "decode": "decode.ir"}
WEIGHTS_FILE = "weights.safetensors"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
REPORT_FILE = "report.json"


class ArtifactError(Exception):
    """An artifact that cannot be used as it is; the message names the file and the fix."""


@dataclass
class Artifact:
    """A loaded, verified artifact."""

    path: Path
    manifest: dict[str, Any]
    config: ModelConfig
    graphs: dict[str, Graph]
    weights: dict[str, torch.Tensor]
    tokenizer: TokenizerFiles


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest, after checking that it is one and that this llmc can read its version."""
    if not path.exists():
        raise ArtifactError(f"{path} does not exist; give the folder that `llmc compile -o` wrote")
    if not path.is_dir():
        raise ArtifactError(f"{path} is not a directory; give the folder that `llmc compile -o` wrote")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{path} has no {MANIFEST}; it is not an llmc artifact (run `llmc compile`)") from None
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{path / MANIFEST} is not valid JSON ({exc.msg}); recompile the artifact") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path / MANIFEST} is not an llmc artifact manifest; recompile the artifact")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ArtifactError(f"artifact format version {version} is newer than this llmc reads "
                            f"(version {FORMAT_VERSION}); upgrade llmc or recompile with this one")
    return manifest


def verify_files(path: Path, manifest: dict[str, Any]) -> None:
    """Check the size and sha256 of every file the manifest lists."""
    for name, entry in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            raise ArtifactError(f"artifact file {name} is missing from {path}; recompile the artifact")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise ArtifactError(f"{name} is {size} bytes but the manifest records {entry['bytes']}: "
                                "the file is truncated or replaced; recompile the artifact")
        if file_sha256(file) != entry["sha256"]:
            raise ArtifactError(f"{name} does not match its sha256 in the manifest: the file was edited "
                                "or corrupted; recompile the artifact")


def load_graph(path: Path, entry: str) -> Graph:
    """One entry graph of an artifact, parsed and verified (ArtifactError if it is not valid)."""
    try:
        graph = parse_graph((path / ENTRY_FILES[entry]).read_text())
        verify(graph)
    except IRError as exc:
        raise ArtifactError(f"{ENTRY_FILES[entry]} is not a valid llmc IR graph ({exc}); recompile") from None
    return graph


def _load_weights(path: Path, graphs: dict[str, Graph]) -> dict[str, torch.Tensor]:
    try:
        weights = load_file(str(path / WEIGHTS_FILE))
    except (SafetensorError, OSError) as exc:
        raise ArtifactError(f"{WEIGHTS_FILE} cannot be read ({exc}); recompile the artifact") from None
    for graph in graphs.values():
        for node in graph.weights():
            name = node.name[2:]
            if name not in weights:
                raise ArtifactError(f"{WEIGHTS_FILE} lacks weight {name!r} that {graph.name}.ir uses; recompile")
            if tuple(weights[name].shape) != node.type.shape:
                raise ArtifactError(f"weight {name!r} has shape {tuple(weights[name].shape)} but "
                                    f"{graph.name}.ir declares {node.type}; recompile")
    return weights


def _load_tokenizer(path: Path) -> TokenizerFiles:
    cfg = json.loads((path / TOKENIZER_CONFIG_FILE).read_text())
    return TokenizerFiles(tokenizer_json=(path / TOKENIZER_FILE).read_text(), **cfg)


def verify_artifact(path: str | Path) -> tuple[dict[str, Any], dict[str, Graph]]:
    """Verify manifest, file hashes and both graphs; return the manifest and the graphs."""
    path = Path(path)
    manifest = read_manifest(path)
    verify_files(path, manifest)
    return manifest, {entry: load_graph(path, entry) for entry in ENTRY_FILES}


def load_artifact(path: str | Path) -> Artifact:
    """Load and verify an artifact; any problem is an ArtifactError naming it."""
    path = Path(path)
    manifest = read_manifest(path)
    verify_files(path, manifest)
    try:
        config = ModelConfig.from_dict(manifest["model"])
    except (ModelError, TypeError, KeyError) as exc:
        raise ArtifactError(f"{MANIFEST} has an unreadable model config ({exc}); recompile") from None
    graphs = {entry: load_graph(path, entry) for entry in ENTRY_FILES}
    weights = _load_weights(path, graphs)
    return Artifact(path, manifest, config, graphs, weights, _load_tokenizer(path))
