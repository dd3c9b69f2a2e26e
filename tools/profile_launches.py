"""A timed step's launches, grouped for `llmc profile`: each thread's waits at a step plan's barriers
by kind of instruction, and the GEMM/GEMV time by weight (a decode step's against the paired read,
a prefill's against the matmul peak: gemm_flops counts each GEMM's FLOPs).

By weight: a GEMM launch names the weights it takes (LaunchTime.weights); launches whose weight
has the same name once the layer number is dropped (`layers.7.qkv_proj.weight.codes` ->
`qkv_proj`) form one row: how many a step runs, their seconds, the bytes of every weight they
take as the artifact stores them (codes, scales and mins), and the rate those make. Against the
rate of the floor's read that followed each step (the profile's paired read), a row says which
GEMMs read at memory speed and which do not: on a 2-core AMD EPYC VM, with bandwidth to spare, an
int4 SmolLM2's smallest GEMVs (o_proj, 207 KB) fell furthest below it (the README's "Which GEMVs
miss the floor").
"""

from __future__ import annotations

import re

import torch

from llmc.compiler.ir import Graph
from llmc.runtime.slot_program import LaunchTime, weight_names

_LAYER = re.compile(r"layers\.\d+\.")


def weight_role(name: str) -> str:
    """A weight's name without its layer number and its parts: `layers.3.o_proj.weight.scales` -> `o_proj`."""
    return _LAYER.sub("", name).split(".weight")[0]


def gemm_flops(graph: Graph, tokens: int) -> dict[str, int]:
    """FLOPs of each GEMM of one sequence's `tokens`-token step of `graph`, by the first weight it takes:
    2 x rows x N x K, its rows every token, or after the logits gather one (a sequence's last)."""
    nodes, flops = graph.node_map(), {}
    for n in graph.nodes:
        if n.op in ("linear", "qlinear"):
            k = nodes[n.inputs[0].node].types[n.inputs[0].index].shape[-1]        # K of its input x
            name = weight_names(n.inputs)[0]
            flops[name] = flops.get(name, 0) + 2 * (tokens if n.type.shape[0] == "T" else 1) * n.type.shape[1] * k
    return flops


def gemm_by_weight(launches: list[LaunchTime], weights: dict[str, torch.Tensor],
                   flops: dict[str, int] | None = None) -> dict[str, dict]:
    """One step's GEMM launches by role: {"launches", "seconds", "bytes", "flops"}, where `weights` are
    the artifact's (their stored bytes) and `flops` (gemm_flops) each GEMM's FLOPs, by weight. A role
    that other launches take too (an embedding gather reads the table a tied LM head multiplies by) is
    named as the tied LM head."""
    shared = {weight_role(w) for launch in launches if launch.kind != "gemm" for w in launch.weights}
    rows: dict[str, dict] = {}
    for launch in launches:
        if launch.kind != "gemm" or not launch.weights:
            continue
        role = weight_role(launch.weights[0])
        row = rows.setdefault(f"{role} (tied LM head)" if role in shared else role,
                              {"launches": 0, "seconds": 0.0, "bytes": 0, "flops": 0})
        row["launches"] += 1
        row["seconds"] += launch.seconds
        row["bytes"] += sum(weights[w].nbytes for w in launch.weights)
        row["flops"] += sum((flops or {}).get(w, 0) for w in launch.weights)
    return rows


def mean_by_weight(steps: list[dict[str, dict]]) -> dict[str, dict]:
    """Several steps' gemm_by_weight as one, each role's seconds their mean."""
    return {role: {**row, "seconds": sum(s[role]["seconds"] for s in steps) / len(steps)}
            for role, row in (steps[0].items() if steps else ())}


def _slowest_first(by_weight: dict[str, dict]) -> tuple[list[dict], int]:
    """gemm_by_weight's rows as a list, slowest first, and the widest role's length."""
    rows = sorted(({"role": role, **row} for role, row in by_weight.items()), key=lambda r: -r["seconds"])
    return rows, max((len(r["role"]) for r in rows), default=0)


def weight_lines(by_weight: dict[str, dict], paired_rate: float) -> list[str]:
    """A decode step's gemm_by_weight rows as the profile prints them, slowest first, each rate against
    the paired read's (bytes/s)."""
    rows, width = _slowest_first(by_weight)
    return ["    GEMM/GEMV by weight in a timed step: launches, time, bytes, rate, its share of the paired read's rate",
            *(f"      {r['role']:<{width}} x{r['launches']:<4}{1000 * r['seconds']:7.2f} ms{r['bytes'] / 1e6:8.1f} MB"
              f"{r['bytes'] / r['seconds'] / 1e9:7.1f} GB/s{100 * r['bytes'] / r['seconds'] / paired_rate:5.0f}%"
              for r in rows)] if rows else []


def flop_lines(by_weight: dict[str, dict], peak: float) -> list[str]:
    """A prefill's gemm_by_weight rows, slowest first, each rate against the matmul peak (FLOP/s)."""
    rows, width = _slowest_first(by_weight)
    return ["    GEMMs by weight: launches, time, GFLOP, rate, its share of the matmul peak",
            *(f"      {r['role']:<{width}} x{r['launches']:<4}{1000 * r['seconds']:8.1f} ms"
              f"{r['flops'] / 1e9:8.2f} GFLOP{r['flops'] / r['seconds'] / 1e9:8.1f} GFLOP/s"
              f"{100 * r['flops'] / r['seconds'] / peak:5.0f}%" for r in rows)] if rows else []


def waits_line(waits: dict[str, list[float]]) -> list[str]:
    """Each thread's wait at a timed decode step's barriers, in all and by kind of instruction."""
    if not waits:
        return []
    threads = range(len(next(iter(waits.values()))))
    ms = lambda per_thread: " / ".join(f"{1000 * w:.2f}" for w in per_thread)  # noqa: E731
    total = [sum(w[t] for w in waits.values()) for t in threads]
    kinds = " | ".join(f"{kind} {ms(w)}" for kind, w in waits.items())
    return [f"    the team's balance: each thread's wait at the barriers of a timed step, thread "
            f"{' / '.join(map(str, threads))}: {ms(total)} ms ({kinds})"]
