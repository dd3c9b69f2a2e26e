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
from llmc.compiler.ir import Graph, Value
from llmc.kernels.activation import silu_mul_ref
from llmc.kernels.attention import (attention_ref, kv_write_ref, paged_attention_ref,
                                    paged_decode_attention_ref)
from llmc.kernels.rmsnorm import add_rmsnorm_ref, rmsnorm_ref
from llmc.kernels.rope import rope_ref
from llmc.kernels.rope_kv_write import rope_kv_write_ref

OpImpl = Callable[[list[torch.Tensor], dict[str, Any]], "torch.Tensor | tuple[torch.Tensor, ...]"]
ROPE_KV_ATTRS = ("layer", "num_heads", "num_kv_heads", "head_dim", "theta", "scaling")

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
    "concat": lambda x, a: torch.cat(x, dim=a["dim"]),
    "split": lambda x, a: tuple(torch.split(x[0], a["sizes"], dim=-1)),
    "add_rmsnorm": lambda x, a: add_rmsnorm_ref(*x, a["eps"]),
    "silu_mul": lambda x, a: silu_mul_ref(*x),
    "rope_kv_write": lambda x, a: rope_kv_write_ref(*x, **{k: a[k] for k in ROPE_KV_ATTRS}),
}


class MissingInputError(KeyError):
    """A graph input was not fed."""


@dataclass(frozen=True)
class _Step:
    impl: OpImpl
    attrs: dict[str, Any]
    args: tuple[int, ...]       # slots read
    outs: tuple[int, ...]       # slots written, one per result
    free: tuple[int, ...]       # slots whose last reader is this step (or that nobody reads)


def _value_slots(graph: Graph) -> dict[Value, int]:
    """One slot per result of every node, in graph order."""
    slots: dict[Value, int] = {}
    for node in graph.nodes:
        for i in range(len(node.types)):
            slots[node.value(i)] = len(slots)
    return slots


class TorchProgram:
    """One IR graph bound to its weights, callable with a dict of input tensors. `impls` maps
    each op to its torch function: the refs (OP_IMPLS) unless a faster table is given."""

    def __init__(self, graph: Graph, weights: dict[str, torch.Tensor], impls: dict[str, OpImpl] = OP_IMPLS):
        self.graph = graph
        self.input_names = [n.name for n in graph.inputs()]
        self._slots = slot = _value_slots(graph)
        self._constants = {slot[n.value()]: weights[n.name[2:]] for n in graph.weights()}
        self._input_slots = {n.name: slot[n.value()] for n in graph.inputs()}
        self._outputs = [slot[v] for v in graph.outputs]
        self._steps = self._plan(graph, slot, impls)
        self._num_slots = len(slot)

    @staticmethod
    def _plan(graph: Graph, slot: dict[Value, int], impls: dict[str, OpImpl]) -> list[_Step]:
        ops = [n for n in graph.nodes if n.op not in ("input", "weight")]
        last_use: dict[int, int] = {}
        for i, node in enumerate(ops):
            for i_res in range(len(node.types)):
                last_use[slot[node.value(i_res)]] = i      # unread results die where they are made
            for v in node.inputs:
                last_use[slot[v]] = i
        keep = {slot[v] for v in graph.outputs} | {slot[n.value()] for n in graph.weights()}
        steps = []
        for i, node in enumerate(ops):
            reads = tuple(slot[v] for v in node.inputs)
            outs = tuple(slot[node.value(r)] for r in range(len(node.types)))
            dying = tuple(s for s in sorted(set(reads) | set(outs)) if last_use.get(s) == i and s not in keep)
            steps.append(_Step(impls[node.op], node.attrs, reads, outs, dying))
        return steps

    def _run(self, feeds: dict[str, torch.Tensor], free: bool) -> list[Any]:
        env: list[Any] = [None] * self._num_slots
        for s, t in self._constants.items():
            env[s] = t
        for name, s in self._input_slots.items():
            if name not in feeds:
                raise MissingInputError(f"graph {self.graph.name} needs input {name!r}")
            env[s] = feeds[name]
        for step in self._steps:
            result = step.impl([env[s] for s in step.args], step.attrs)
            if len(step.outs) == 1:
                env[step.outs[0]] = result
            else:
                for s, t in zip(step.outs, result, strict=True):
                    env[s] = t
            if free:
                for s in step.free:
                    env[s] = None
        return env

    def __call__(self, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        env = self._run(feeds, free=True)
        return [env[s] for s in self._outputs]

    def values(self, feeds: dict[str, torch.Tensor]) -> dict[Value, torch.Tensor]:
        """Every value the graph computes (for debugging: nothing is freed)."""
        env = self._run(feeds, free=False)
        return {v: env[s] for v, s in self._slots.items()}


def interpret(graph: Graph, weights: dict[str, torch.Tensor], feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Run `graph` once with the torch backend (the reference semantics of the IR)."""
    with torch.inference_mode():
        return TorchProgram(graph, weights)(feeds)
