"""The pass pipeline: one ordered, visible list, and the manager that runs it.

Every pass is `Graph, PassContext -> Graph`, in its own file. The manager verifies the graph
after every pass, records hits, node counts and time per pass, and turns an invalid graph into a
`PassError` that names the pass, the node (in IR text) and the rule it broke. Any pass but a
`required` one can be disabled by name, and the pipeline can stop after any pass; `on_pass`
sees each pass's output (IR dumps, bisect), and `ctx.value_map` maps the values of the graph
before the last pass to those after it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from llmc.compiler.ir import Graph, IRError
from llmc.compiler.ops import verify

from .canonicalize import canonicalize
from .cse import cse
from .dce import dce
from .fold_weights import fold_weights
from .fuse_add_rmsnorm import fuse_add_rmsnorm
from .fuse_rope_kv_write import fuse_rope_kv_write
from .fuse_silu_mul import fuse_silu_mul
from .fusion_grouping import fusion_grouping
from .insert_paged_attention import insert_paged_attention
from .merge_gate_up import merge_gate_up
from .merge_qkv import merge_qkv
from .quantize_kv import quantize_kv
from .quantize_weights import quantize_weights
from .rewrite import PassContext, PassError  # noqa: F401  (PassError is re-exported)
from .shard import shard


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[Graph, PassContext], Graph]
    summary: str
    required: bool = False  # the runtime cannot run the graph without it


PIPELINE: list[Pass] = [
    # --- normalise what tracing produced
    Pass("canonicalize", canonicalize, "drop identity casts, order commutative operands"),
    Pass("cse", cse, "reuse the first of identical pure computations"),
    # --- merge GEMMs that read the same input
    Pass("merge_qkv", merge_qkv, "Q, K, V projections -> one linear + split"),
    Pass("merge_gate_up", merge_gate_up, "MLP gate and up projections -> one linear + split"),
    # --- fuse elementwise ops into their neighbours
    Pass("fuse_add_rmsnorm", fuse_add_rmsnorm, "residual add + rmsnorm -> add_rmsnorm (normed, sum)"),
    Pass("fuse_silu_mul", fuse_silu_mul, "silu(gate) * up -> silu_mul, gelu_tanh(gate) * up -> gelu_tanh_mul"),
    # --- lower to the runtime's execution model
    Pass("insert_paged_attention", insert_paged_attention,
         "attention -> kv_write + paged attention over block tables", required=True),
    Pass("fuse_rope_kv_write", fuse_rope_kv_write, "rope of q and k + kv_write -> rope_kv_write"),
    # --- compute weight-only expressions (merged weights) once, at compile time
    Pass("fold_weights", fold_weights, "weight-only nodes (concats) -> new stored weights"),
    # --- trade bits for bytes, when a recipe asks (off otherwise)
    Pass("quantize_weights", quantize_weights, "linear -> qlinear on int8/int4 codes (--quant)"),
    Pass("quantize_kv", quantize_kv, "float KV cache -> int8 codes + a scale per token and head (--kv-dtype)"),
    # --- clean up
    Pass("dce", dce, "remove nodes that reach no output or side effect"),
    # --- split over tensor-parallel ranks, when the compile asks (off otherwise)
    Pass("shard", shard, "heads and MLP columns split over --tp N ranks, all_reduce / all_gather between (--tp)"),
    # --- prepare code generation
    Pass("fusion_grouping", fusion_grouping, "partition ops into kernels: group=N attributes"),
]


@dataclass(frozen=True)
class PassRecord:
    """What one pass did to one graph (goes into report.json)."""

    graph: str
    name: str
    hits: int
    nodes_before: int
    nodes_after: int
    seconds: float


def pass_names() -> list[str]:
    return [p.name for p in PIPELINE]


def check_pass_options(disabled: tuple[str, ...] = (), stop_after: str | None = None) -> None:
    """Raise PassError for an unknown or required pass name."""
    names = pass_names()
    for name in (*disabled, *([stop_after] if stop_after else [])):
        if name not in names:
            raise PassError(f"there is no pass named {name!r}; the passes are {', '.join(names)}")
    for p in PIPELINE:
        if p.name in disabled and p.required:
            raise PassError(f"pass {p.name!r} cannot be disabled: the runtime needs its output")
    if stop_after in disabled:
        raise PassError(f"--stop-after {stop_after} names a disabled pass; stop after one that runs")


def required_after(stop_after: str | None) -> list[str]:
    """Required passes that a pipeline ending after `stop_after` would not run."""
    if stop_after is None:
        return []
    names = pass_names()
    return [p.name for p in PIPELINE[names.index(stop_after) + 1:] if p.required]


def run_pipeline(graph: Graph, ctx: PassContext, disabled: tuple[str, ...] = (),
                 stop_after: str | None = None,
                 on_pass: Callable[[Pass, Graph], None] | None = None) -> tuple[Graph, list[PassRecord]]:
    """Run the pipeline over one graph; `on_pass(pass, graph)` sees the graph after each pass."""
    check_pass_options(disabled, stop_after)
    records = []
    for p in PIPELINE:
        if p.name in disabled:
            continue
        before, start = len(graph.nodes), time.perf_counter()
        hits_before = ctx.hits.get(p.name, 0)
        ctx.value_map = None
        try:
            graph = p.run(graph, ctx)
            verify(graph)
        except IRError as exc:
            raise PassError(f"pass {p.name!r} produced an invalid graph: {exc}") from None
        records.append(PassRecord(graph.name, p.name, ctx.hits.get(p.name, 0) - hits_before,
                                  before, len(graph.nodes), time.perf_counter() - start))
        if on_pass:
            on_pass(p, graph)
        if p.name == stop_after:
            break
    return graph, records
