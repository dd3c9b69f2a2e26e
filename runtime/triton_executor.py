"""The `triton` executor: runs the artifact's generated Triton kernels, one launch per unit.

At build time it lowers the artifact's IR again (codegen is deterministic) to learn which kernel
module each unit launches, checks that the artifact's kernels/ folder holds exactly those
modules with exactly the text this llmc generates (the manifest's hashes already caught any edit;
this catches an artifact from another codegen), imports them, and calls each module's
`build(device)` once: constants such as RoPE frequencies go to the device here, not per step.
Weights move to the device once. A step launches every unit's kernel in graph order; nothing in
it synchronises with the host, so the same launches can later be captured in a CUDA graph.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType

import torch

from llmc.compiler.codegen import KernelUnit, Lowering, import_kernel_module, lower
from llmc.compiler.codegen.units import PROLOGUE_NORMS
from llmc.compiler.ops import OPS

from .artifact import KERNELS_DIR, Artifact, ArtifactError
from .executor import Executor, ExecutorOptions, GraphRun, KVCacheSpec
from .sampling_params import RequestError
from .slot_program import LaunchSpec, SlotProgram


def load_kernel_modules(artifact: Artifact, lowering: Lowering) -> dict[str, ModuleType]:
    """The artifact's kernel modules, after checking they are the ones its IR lowers to."""
    folder = artifact.path / KERNELS_DIR
    modules = {}
    for name, source in lowering.modules.items():
        path = folder / f"{name}.py"
        if not path.is_file():
            raise ArtifactError(f"{artifact.path} lacks kernel {KERNELS_DIR}/{name}.py that its IR needs; recompile it "
                                "with `llmc compile --target cuda`")
        if path.read_text() != source:
            raise ArtifactError(f"{KERNELS_DIR}/{name}.py differs from what this llmc generates for the artifact's "
                                "IR; recompile it with `llmc compile --target cuda`")
        modules[name] = import_kernel_module(path, name)
    return modules


def unit_kind(unit: KernelUnit) -> str:
    """The op kind a profile files the unit's launch under: its first op's, past a norm that codegen
    merged into a GEMM as its prologue (units.py triton_units), so a norm + GEMM unit counts as a GEMM;
    decode attention with the O projection that merges its splits (two launches) counts as attention."""
    nodes = [n for n in unit.nodes if n.op not in PROLOGUE_NORMS] or list(unit.nodes)
    return OPS[nodes[0].op].kind


def _launch(launcher):
    return lambda args, attrs: launcher(*args)


@dataclass(frozen=True)
class TritonOptions(ExecutorOptions):
    """Only what every executor takes: the capture of the decode step as CUDA graphs (cuda_graphs)."""


def has_triton_kernels(artifact: Artifact) -> bool:
    return "triton" in artifact.manifest.get("backends", [])


class TritonExecutor(Executor):
    backend = "triton"
    options_type = TritonOptions
    auto_rank = 10          # auto's first choice where it runs: a GPU and an artifact with kernels

    @classmethod
    def place(cls, artifact: Artifact, device: str) -> torch.device:
        """A GPU unless `device` is cpu; the CPU only with TRITON_INTERPRET=1 (Triton's interpreter)."""
        if not has_triton_kernels(artifact):
            raise RequestError(f"{artifact.path} has no Triton kernels; compile it with `llmc compile --target cuda` "
                               "or use --backend torch")
        if torch.cuda.is_available() and device != "cpu":
            return torch.device("cuda")
        if os.environ.get("TRITON_INTERPRET") == "1":
            return torch.device("cpu")
        raise RequestError("--backend triton needs a CUDA GPU (or TRITON_INTERPRET=1 to run its kernels slowly in "
                           "Triton's interpreter on the CPU); use --backend torch here")

    @classmethod
    def auto_picks(cls, artifact: Artifact, device: str) -> bool:
        return torch.cuda.is_available() and has_triton_kernels(artifact) and device != "cpu"

    def __init__(self, artifact: Artifact, device: torch.device, kv: KVCacheSpec, options: TritonOptions | None = None):
        super().__init__(artifact, device, kv, options)
        lowering = lower(artifact.graphs)
        modules = load_kernel_modules(artifact, lowering)
        launchers = {name: module.build(device) for name, module in modules.items()}
        weights = {name: w.to(device) for name, w in artifact.weights.items()}
        self.lowering = lowering
        self.programs = {
            entry: SlotProgram(graph, weights, [
                LaunchSpec(_launch(launchers[module]), {}, unit.inputs, unit.outputs, module, unit_kind(unit))
                for unit, module in zip(lowering.units[entry], lowering.plan[entry])])
            for entry, graph in artifact.graphs.items()}
        self.graph_runs = {entry: GraphRun(entry, False, "the triton backend launches one kernel per fusion unit")
                           for entry in artifact.graphs}
