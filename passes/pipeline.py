"""The pass pipeline: one ordered, visible list, and the manager that runs it.

Every pass is `Graph, PassContext -> Graph`. The manager verifies the graph after every pass,
records hits, node counts and time per pass, and turns an invalid graph into a `PassError` that
names the pass, the node (in IR text) and the rule it broke.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from llmc.compiler.ir import Graph, IRError
from llmc.compiler.ops import verify

from .canonicalize import canonicalize
from .dce import dce
from .insert_paged_attention import insert_paged_attention
from .rewrite import PassContext


class PassError(Exception):
    """A pass broke the graph or a pass option is wrong; the message names the pass."""


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[Graph, PassContext], Graph]
    summary: str
    required: bool = False  # the runtime cannot run the graph without it


PIPELINE: list[Pass] = [
    # --- normalise what tracing produced
    Pass("canonicalize", canonicalize, "drop identity casts, order commutative operands"),
    # --- lower to the runtime's execution model
    Pass("insert_paged_attention", insert_paged_attention,
         "attention -> kv_write + paged attention over block tables", required=True),
    # --- clean up
    Pass("dce", dce, "remove nodes that reach no output or side effect"),
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
