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

from types import ModuleType

import torch

from llmc.compiler.codegen import Lowering, import_kernel_module, lower
from llmc.compiler.ops import OPS

from .artifact import KERNELS_DIR, Artifact, ArtifactError
from .executor import Executor, KVCacheSpec
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


def _launch(launcher):
    return lambda args, attrs: launcher(*args)


class TritonExecutor(Executor):
    backend = "triton"

    def __init__(self, artifact: Artifact, device: torch.device, kv: KVCacheSpec):
        super().__init__(artifact, device, kv)
        lowering = lower(artifact.graphs)
        modules = load_kernel_modules(artifact, lowering)
        launchers = {name: module.build(device) for name, module in modules.items()}
        weights = {name: w.to(device) for name, w in artifact.weights.items()}
        self.lowering = lowering
        self.programs = {
            entry: SlotProgram(graph, weights, [
                LaunchSpec(_launch(launchers[module]), {}, unit.inputs, unit.outputs, module,
                           OPS[unit.nodes[0].op].kind)
                for unit, module in zip(lowering.units[entry], lowering.plan[entry])])
            for entry, graph in artifact.graphs.items()}
