"""N ranks of a sharded graph interpreted in lockstep in one process (`llmc debug bisect --tp N`, the
shard pass's tests).

Every node runs on every rank before the next node runs anywhere: each rank's op by its reference,
on the rank's weights (the plan's cuts, compiler/tensor_parallel.py) and the rank's inputs; a
collective takes every rank's input value and gives each rank the same result: all_reduce their
sum (in rank order), all_gather their concatenation on the last axis. No process group is needed,
so a sharded graph is as printable and interpretable as any other, value by value.

Callers hold ONE cache of all the model's KV heads ([L, 2, NB, KVH, BS, D], as an unsharded graph's),
so a probe's context is written and read through the same feeds at every stage: each rank gets a
copy of its heads (the runtime's allocation; a head several ranks replicate is written by each with
the same values) and its writes are copied back after the step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from llmc.compiler.ir import Graph, Value
from llmc.compiler.ops import OPS, bind
from llmc.compiler.tensor_parallel import TensorParallelPlan, cut, segments
from llmc.runtime.torch_backend import TorchProgram

COLLECTIVES = ("all_reduce", "all_gather")
KV_HEAD_AXIS = 3                                                      # [L, 2, NB, KVH, BS, D]


def _collective(op: str, parts: list[torch.Tensor]) -> torch.Tensor:
    return sum(parts[1:], parts[0]) if op == "all_reduce" else torch.cat(parts, dim=-1)


def lockstep_values(graph: Graph, weights: list[dict], feeds: list[dict]) -> list[dict[Value, torch.Tensor]]:
    """Every rank's values of `graph`, run by len(weights) ranks in lockstep, the collectives simulated."""
    values: list[dict[Value, torch.Tensor]] = [{} for _ in weights]
    for node in graph.nodes:
        if node.op in ("input", "weight"):
            for rank, held in enumerate(values):
                held[node.value()] = (feeds if node.op == "input" else weights)[rank][node.name.removeprefix("w.")]
        elif node.op in COLLECTIVES:
            joined = _collective(node.op, [held[node.inputs[0]] for held in values])
            for held in values:
                held[node.value()] = joined.clone()
        else:
            record = OPS[node.op]
            for held in values:
                out = record.reference(bind(record, [held[v] for v in node.inputs], node.attrs), node.attrs)
                for i, t in enumerate(out if isinstance(out, tuple) else (out,)):
                    held[node.value(i)] = t
    return values


def run_ranks(graph: Graph, weights: list[dict], feeds: list[dict]) -> list[torch.Tensor]:
    """Rank 0's outputs of `graph` run by len(weights) ranks in lockstep."""
    return [lockstep_values(graph, weights, feeds)[0][v] for v in graph.outputs]


def kv_heads_rule(num_kv_heads: int) -> dict:
    """How the cache's head axis is cut over the ranks (heads split, or replicated below N heads)."""
    return segments(KV_HEAD_AXIS, [num_kv_heads], [num_kv_heads])


def rank_feeds(full: dict, num_kv_heads: int, n: int) -> list[dict]:
    """Each rank's inputs: the full step's, its cache a copy of its KV heads (as the runtime allocates it)."""
    if "kv_cache" not in full:
        return [dict(full) for _ in range(n)]
    rule = kv_heads_rule(num_kv_heads)
    return [full | {"kv_cache": cut(full["kv_cache"], rule, n, r).clone()} for r in range(n)]


@dataclass(frozen=True)
class Ranks:
    """How a stage's graphs run: `plan.size` ranks on the plan's weights, a cache of `num_kv_heads`."""

    plan: TensorParallelPlan
    num_kv_heads: int


class RankedProgram:
    """A sharded graph bound to the full weights, callable like a TorchProgram with full feeds:
    rank 0's outputs (the logits every rank ends with, gathered). `graph` is the sharded graph with
    its kv_cache input typed for all the model's KV heads, the cache its callers allocate and feed."""

    def __init__(self, graph: Graph, weights: dict[str, torch.Tensor], ranks: Ranks):
        self.sharded, self.ranks = graph, ranks
        self.rank_weights = [ranks.plan.rank_weights(weights, r) for r in range(ranks.plan.size)]
        self.graph = Graph(graph.name, [self._full_cache_node(n) for n in graph.nodes], graph.outputs)
        self.input_names = [n.name for n in graph.inputs()]

    def _full_cache_node(self, node):
        if node.op != "input" or node.name != "kv_cache":
            return node
        shape = list(node.type.shape)
        shape[KV_HEAD_AXIS] = self.ranks.num_kv_heads
        return dataclasses.replace(node, types=(dataclasses.replace(node.type, shape=tuple(shape)),))

    def _run(self, feeds: dict[str, torch.Tensor]) -> list[dict[Value, torch.Tensor]]:
        n = self.ranks.plan.size
        per_rank = rank_feeds(feeds, self.ranks.num_kv_heads, n)
        with torch.inference_mode():
            values = lockstep_values(self.sharded, self.rank_weights, per_rank)
            if "kv_cache" in feeds:
                rule = kv_heads_rule(self.ranks.num_kv_heads)
                for r, rank in enumerate(per_rank):
                    cut(feeds["kv_cache"], rule, n, r).copy_(rank["kv_cache"])    # one slice: a view
        return values

    def __call__(self, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        values = self._run(feeds)[0]
        return [values[v] for v in self.sharded.outputs]

    def values(self, feeds: dict[str, torch.Tensor]) -> dict[Value, torch.Tensor]:
        """Rank 0's values that every rank holds whole (equal on all ranks), the only ones an
        unsharded graph's values can stand for: a rank's heads or partial sums are left out."""
        ranks = self._run(feeds)
        return {v: t for v, t in ranks[0].items()
                if all(v in other and other[v].shape == t.shape and torch.equal(other[v], t) for other in ranks[1:])}


def stage_program(graph: Graph, weights: dict[str, torch.Tensor], ranks: Ranks | None):
    """The program a stage's graph runs as: the torch backend, or N ranks in lockstep."""
    return TorchProgram(graph, weights) if ranks is None else RankedProgram(graph, weights, ranks)
