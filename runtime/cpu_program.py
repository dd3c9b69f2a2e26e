"""The torch backend's CPU units (compiler/codegen/cpu_units.py): an artifact's generated C++ kernels,
checked and loaded, and a graph run op by op over its CPU units.

`load_cpu_kernels(artifact)` lowers the artifact's IR to C++ again (codegen is deterministic),
checks that the artifact's kernels/cpu/generated.cpp is exactly that text (as the triton
executor checks its modules: the manifest's hashes caught an edit, this catches an artifact from
another codegen; ArtifactError otherwise), and builds it once per machine (kernels/generated.py).
`CpuProgram` is a graph as a SlotProgram with one launch per CPU unit, producers first: a template
node (GEMM, attention, RoPE + KV write, gather) through the op table (kernels/native_ops.py, else
its reference), a generated unit through `torch.ops.llmc.run_generated` (kernels/cpu/
generated_call.cpp) calling its function. The step plan (step_plan.py) calls the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.compiler.artifact_format import CPU_KERNELS_FILE
from llmc.compiler.codegen.cpp import ColumnReads
from llmc.compiler.codegen.cpu_lowering import CpuLowering, lower_cpu
from llmc.compiler.codegen.cpu_units import unit_kind
from llmc.compiler.codegen.units import KernelUnit
from llmc.compiler.dtypes import to_torch
from llmc.compiler.ir import Graph
from llmc.compiler.ops import OPS
from llmc.kernels.generated import GeneratedLibrary, load_generated
from llmc.kernels.torch_ops import OpImpl, bound

from .artifact import Artifact, ArtifactError
from .slot_program import LaunchSpec, SlotProgram
from .torch_backend import TorchProgram

FIX = "recompile it with `llmc compile`"


@dataclass(frozen=True)
class CpuKernels:
    """An artifact's generated CPU kernels, built and loaded, with the lowering that names them."""

    graphs: dict[str, Graph]
    lowering: CpuLowering
    library: GeneratedLibrary

    def lowering_of(self, graph: Graph) -> CpuLowering:
        """The lowering naming `graph`'s functions: the artifact's, or `graph` lowered again (a graph
        other than the artifact's; its functions must be in the library)."""
        return self.lowering if self.graphs.get(graph.name) is graph else lower_cpu({graph.name: graph})

    def units(self, graph: Graph) -> list[tuple[KernelUnit, int | None]]:
        """`graph`'s CPU units in launch order, each with its generated function's address (None: a
        template node). A graph other than the artifact's is lowered again; its functions must be here."""
        lowering = self.lowering_of(graph)
        return [(unit, None if name is None else self.library.address(name))
                for unit, name in zip(lowering.units[graph.name], lowering.plan[graph.name])]

    def windows(self, graph: Graph) -> list[tuple[int, ColumnReads] | None]:
        """For each of `units(graph)`: its window function's address and what it reads (None: a
        template node, or a unit that is not column-local; compiler/codegen/cpp.py)."""
        lowering = self.lowering_of(graph)
        return [(self.library.address(name + "_cols"), lowering.windows[name]) if name in lowering.windows else None
                for name in lowering.plan[graph.name]]


def load_cpu_kernels(artifact: Artifact) -> CpuKernels:
    """The artifact's generated CPU kernels, after checking they are the ones its IR lowers to."""
    lowering = lower_cpu(artifact.graphs)
    path = artifact.path / CPU_KERNELS_FILE
    if not path.is_file():
        raise ArtifactError(f"{artifact.path} lacks {CPU_KERNELS_FILE}, the generated CPU kernels its IR needs; {FIX}")
    if path.read_text() != lowering.source():
        raise ArtifactError(f"{CPU_KERNELS_FILE} differs from what this llmc generates for the artifact's IR; {FIX}")
    return CpuKernels(artifact.graphs, lowering, load_generated(lowering.source()))


def generated_launch(address: int, unit: KernelUnit, graph: Graph):
    """A SlotProgram launch of a generated unit: run_generated over its inputs, returning its outputs."""
    in_dtypes = [to_torch(graph.type_of(v).dtype) for v in unit.inputs]
    widths = [graph.type_of(v).shape[-1] for v in unit.outputs]
    out_dtypes = [to_torch(graph.type_of(v).dtype) for v in unit.outputs]
    run = torch.ops.llmc.run_generated
    return lambda args, attrs: tuple(run(address, args, in_dtypes, widths, out_dtypes))


class CpuProgram(SlotProgram):
    """`graph` bound to its weights, one launch per CPU unit (see module docstring); `impls` maps an
    op to its torch function for the template nodes (its reference where it has none)."""

    def __init__(self, graph: Graph, weights: dict[str, torch.Tensor], impls: dict[str, OpImpl],
                 kernels: CpuKernels):
        launches = []
        for unit, address in kernels.units(graph):
            label = "+".join(n.op for n in unit.nodes)
            if address is not None:
                launches.append(LaunchSpec(generated_launch(address, unit, graph), {}, unit.inputs, unit.outputs,
                                           label, unit_kind(unit)))
                continue
            (node,) = unit.nodes
            record = OPS[node.op]
            launches.append(LaunchSpec(bound(impls.get(node.op) or record.reference, record, len(node.inputs),
                                             node.attrs), node.attrs, node.inputs,
                                       tuple(node.value(i) for i in range(len(node.types))), label, record.kind))
        super().__init__(graph, weights, launches)
        self.input_names = [n.name for n in graph.inputs()]
        self.kernels = kernels                  # keeps the generated library loaded while the program lives


def op_by_op_program(graph: Graph, weights: dict, impls: dict[str, OpImpl], kernels: CpuKernels | None) -> SlotProgram:
    """`graph` op by op: over its CPU units with the generated kernels, else node by node on `impls`."""
    return CpuProgram(graph, weights, impls, kernels) if kernels is not None else TorchProgram(graph, weights, impls)
