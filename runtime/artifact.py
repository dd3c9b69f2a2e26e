"""Loading an artifact for the runtime: verify it, then parse its graphs, weights and tokenizer.

The format itself (files, version, hashing, verification) is compiler/artifact_format.py, which
the writer uses too; this module re-exports its names for the runtime's callers. Nothing is
trusted before its hash is checked, and every problem is an `ArtifactError` with one sentence
that names the file and the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from llmc.compiler.artifact_format import (ALL_ENTRY_FILES, ENTRY_FILES, FORMAT, FORMAT_VERSION, KERNELS_DIR, MANIFEST,  # noqa: F401
                                           REPORT_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE,
                                           ArtifactError, artifact_entries, read_manifest, require_entry,
                                           verify_files)
from llmc.compiler.dtypes import to_torch
from llmc.compiler.ir import Graph, IRError, parse_graph
from llmc.compiler.tensor_parallel import TensorParallelPlan
from llmc.compiler.ops import verify
from llmc.models.config import ModelConfig, ModelError, TokenizerFiles


@dataclass
class Artifact:
    """A loaded, verified artifact."""

    path: Path
    manifest: dict[str, Any]
    config: ModelConfig
    graphs: dict[str, Graph]
    weights: dict[str, torch.Tensor]
    tokenizer: TokenizerFiles


def load_graph(path: Path, entry: str) -> Graph:
    """One entry graph of an artifact, parsed and verified (ArtifactError if it is not valid)."""
    try:
        graph = parse_graph((path / ALL_ENTRY_FILES[entry]).read_text())
        verify(graph)
    except IRError as exc:
        raise ArtifactError(f"{ALL_ENTRY_FILES[entry]} is not a valid llmc IR graph ({exc}); recompile") from None
    return graph


def _load_weights(path: Path, graphs: dict[str, Graph], plan: TensorParallelPlan) -> dict[str, torch.Tensor]:
    """The whole tensors; each graph weight checked as the graph declares it (a sharded graph: one
    rank's part, cut from its stored tensor as `plan` says)."""
    try:
        weights = load_file(str(path / WEIGHTS_FILE))
    except (SafetensorError, OSError) as exc:
        raise ArtifactError(f"{WEIGHTS_FILE} cannot be read ({exc}); recompile the artifact") from None
    for graph in graphs.values():
        for node in graph.weights():
            name = node.name[2:]
            stored = plan.source(name)
            if stored not in weights:
                raise ArtifactError(f"{WEIGHTS_FILE} lacks weight {stored!r} that {graph.name}.ir uses; recompile")
            if weights[stored].dtype != to_torch(node.type.dtype):
                raise ArtifactError(f"weight {name!r} is {weights[stored].dtype} but {graph.name}.ir declares "
                                    f"{node.type.dtype}; recompile")
            try:
                shape = plan.rank_shape(name, tuple(weights[stored].shape))
            except ValueError as exc:
                raise ArtifactError(f"weight {name!r} cannot be cut for {plan.size} ranks ({exc}); recompile") from None
            if shape != node.type.shape:
                ranks = f" on each of {plan.size} ranks" if plan.size > 1 else ""
                raise ArtifactError(f"weight {name!r} has shape {shape}{ranks} but "
                                    f"{graph.name}.ir declares {node.type}; recompile")
    return weights


def _load_tokenizer(path: Path) -> TokenizerFiles:
    cfg = json.loads((path / TOKENIZER_CONFIG_FILE).read_text())
    return TokenizerFiles(tokenizer_json=(path / TOKENIZER_FILE).read_text(), **cfg)


def verify_artifact(path: str | Path) -> tuple[dict[str, Any], dict[str, Graph]]:
    """Verify manifest, file hashes and every entry graph (prefill, decode and a draft if it has one);
    return the manifest and the graphs."""
    path = Path(path)
    manifest = read_manifest(path)
    verify_files(path, manifest)
    return manifest, {entry: load_graph(path, entry) for entry in artifact_entries(manifest)}


def load_artifact(path: str | Path) -> Artifact:
    """Load and verify an artifact; any problem is an ArtifactError naming it."""
    path = Path(path)
    manifest = read_manifest(path)
    verify_files(path, manifest)
    try:
        config = ModelConfig.from_dict(manifest["model"])
    except (ModelError, TypeError, KeyError) as exc:
        raise ArtifactError(f"{MANIFEST} has an unreadable model config ({exc}); recompile") from None
    graphs = {entry: load_graph(path, entry) for entry in artifact_entries(manifest)}
    weights = _load_weights(path, graphs, TensorParallelPlan.from_manifest(manifest))
    return Artifact(path, manifest, config, graphs, weights, _load_tokenizer(path))
