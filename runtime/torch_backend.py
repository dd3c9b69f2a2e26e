"""The `torch` backend: runs an IR graph op by op through torch (aten) calls.

It is the CPU runtime and the numeric reference for every pass (a pass test interprets the
graph before and after it). `TorchProgram` is the graph as a SlotProgram with one launch per
node: the op's torch function from an op table (kernels/native_ops.py's, say), else the op record's
reference; each takes the node's inputs by name (kernels/torch_ops.py binds them once per node).
"""

from __future__ import annotations

import torch

from llmc.compiler.ir import Graph
from llmc.compiler.ops import OPS
from llmc.kernels.torch_ops import OpImpl, bound

from .slot_program import LaunchSpec, MissingInputError, SlotProgram  # noqa: F401  (re-exported)


class TorchProgram(SlotProgram):
    """One IR graph bound to its weights, callable with a dict of input tensors. `impls` maps
    op to its torch function: the op's reference unless `impls` has a faster one."""

    def __init__(self, graph: Graph, weights: dict[str, torch.Tensor], impls: dict[str, OpImpl] | None = None):
        impls = impls or {}
        launches = [LaunchSpec(bound(impls.get(n.op) or OPS[n.op].reference, OPS[n.op], len(n.inputs), n.attrs),
                               n.attrs, n.inputs, tuple(n.value(i) for i in range(len(n.types))), n.op, OPS[n.op].kind)
                    for n in graph.nodes if n.op not in ("input", "weight")]
        super().__init__(graph, weights, launches)
        self.input_names = [n.name for n in graph.inputs()]


def interpret(graph: Graph, weights: dict[str, torch.Tensor], feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Run `graph` once with the torch backend (the reference semantics of the IR)."""
    with torch.inference_mode():
        return TorchProgram(graph, weights)(feeds)
