"""The `torch` backend: runs an IR graph op by op through torch (aten) calls.

It is the CPU runtime and the numeric reference for every pass (a pass test interprets the
graph before and after it). `TorchProgram` resolves the graph once into a list of steps (the
op's torch function, where its inputs live, when each value dies), so a call does no lookups
by name and frees every intermediate right after its last reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from llmc.compiler.dtypes import to_torch
from llmc.compiler.ir import Graph
from llmc.kernels.attention import (attention_ref, kv_write_ref, paged_attention_ref,
                                    paged_decode_attention_ref)
from llmc.kernels.rmsnorm import rmsnorm_ref
from llmc.kernels.rope import rope_ref

OpImpl = Callable[[list[torch.Tensor], dict[str, Any]], torch.Tensor]

OP_IMPLS: dict[str, OpImpl] = {
    "embedding": lambda x, a: F.embedding(x[1], x[0]),
    "rmsnorm": lambda x, a: rmsnorm_ref(x[0], x[1], a["eps"]),
    "linear": lambda x, a: F.linear(*x),
    "add": lambda x, a: x[0] + x[1],
    "mul": lambda x, a: x[0] * x[1],
    "silu": lambda x, a: F.silu(x[0]),
    "cast": lambda x, a: x[0].to(to_torch(a["dtype"])),
    "rope": lambda x, a: rope_ref(x[0], x[1], a["head_dim"], a["theta"], a["scaling"]),
    "attention": lambda x, a: attention_ref(*x, a["head_dim"], a["scale"]),
    "index_select": lambda x, a: torch.index_select(x[0], 0, x[1]),
    "kv_write": lambda x, a: kv_write_ref(*x, a["layer"]),
    "paged_attention": lambda x, a: paged_attention_ref(*x, a["layer"], a["head_dim"], a["scale"]),
    "paged_decode_attention": lambda x, a: paged_decode_attention_ref(*x, a["layer"], a["head_dim"], a["scale"]),
}


class MissingInputError(KeyError):
    """A graph input was not fed."""


@dataclass(frozen=True)
class _Step:
    impl: OpImpl
    attrs: dict[str, Any]
    args: tuple[int, ...]       # slots read
    out: int                    # slot written (single-result ops)
    free: tuple[int, ...]       # slots whose last reader is this step


class TorchProgram:
    """One IR graph bound to its weights, callable with a dict of input tensors."""

    def __init__(self, graph: Graph, weights: dict[str, torch.Tensor]):
        self.graph = graph
        self.input_names = [n.name for n in graph.inputs()]
        slot = {n.name: i for i, n in enumerate(graph.nodes)}
        self._constants = {slot[n.name]: weights[n.name[2:]] for n in graph.weights()}
        self._input_slots = {n.name: slot[n.name] for n in graph.inputs()}
        self._outputs = [slot[v.node] for v in graph.outputs]
        self._steps = self._plan(graph, slot)
        self._num_slots = len(graph.nodes)

    @staticmethod
    def _plan(graph: Graph, slot: dict[str, int]) -> list[_Step]:
        last_use: dict[int, int] = {}
        ops = [n for n in graph.nodes if n.op not in ("input", "weight")]
        for i, node in enumerate(ops):
            for v in node.inputs:
                last_use[slot[v.node]] = i
        keep = {slot[v.node] for v in graph.outputs} | {slot[n.name] for n in graph.weights()}
        steps = []
        for i, node in enumerate(ops):
            assert len(node.types) == 1, f"torch backend: {node.op} has {len(node.types)} results"
            reads = tuple(slot[v.node] for v in node.inputs)
            dying = tuple(s for s in set(reads) if last_use[s] == i and s not in keep)
            steps.append(_Step(OP_IMPLS[node.op], node.attrs, reads, slot[node.name], dying))
        return steps

    def __call__(self, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        env: list[Any] = [None] * self._num_slots
        for s, t in self._constants.items():
            env[s] = t
        for name, s in self._input_slots.items():
            if name not in feeds:
                raise MissingInputError(f"graph {self.graph.name} needs input {name!r}")
            env[s] = feeds[name]
        for step in self._steps:
            env[step.out] = step.impl([env[s] for s in step.args], step.attrs)
            for s in step.free:
                env[s] = None
        return [env[s] for s in self._outputs]


def interpret(graph: Graph, weights: dict[str, torch.Tensor], feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Run `graph` once with the torch backend (the reference semantics of the IR)."""
    with torch.inference_mode():
        return TorchProgram(graph, weights)(feeds)
