"""`llmc kernels ART [--graph decode] [--group N]`: the generated kernels of every fusion group.

Without --group: one line per kernel unit of the graph (its group, its ops, the Triton module it
launches, and how many kernels where more than one) where the artifact has Triton kernels (cuda
target), the step's kernel launches in all and a layer's (from one layer's attention unit to the
next's: what CUDA graphs replay per layer; the most a step launches: decode attention on its own
skips its merge stage where one split covers the context; merged with the O projection, whose GEMM
then takes the merge as its prologue, it launches its split stage and that GEMM either way), then
one line per CPU unit (its group, its ops, the generated C++ function it calls, or `template` for a
hand-written kernel), and how many distinct modules and functions there are. With --group N: that
group's IR lines and the source of its Triton module and of its C++ functions, as the artifact
stores them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from llmc.compiler.artifact_format import CPU_KERNELS_FILE, KERNELS_DIR
from llmc.compiler.codegen import lower
from llmc.compiler.codegen.cpu_lowering import CpuLowering, lower_cpu
from llmc.compiler.codegen.units import KernelUnit
from llmc.runtime.artifact import Artifact, ArtifactError, load_artifact
from llmc.runtime.sampling_params import RequestError


def _where(unit: KernelUnit) -> str:
    return f"group {unit.group:>3}" if unit.group is not None else "         "


def _cpu_lowering(art: Artifact) -> CpuLowering:
    """The artifact's C++ units, after checking its file is what this llmc generates for its IR."""
    lowering, path = lower_cpu(art.graphs), art.path / CPU_KERNELS_FILE
    if not path.is_file() or path.read_text() != lowering.source():
        raise ArtifactError(f"{art.path} has no {CPU_KERNELS_FILE} matching its IR (compiled by another llmc); "
                            "recompile it with `llmc compile`")
    return lowering


def _list(art: Artifact, graph: str, cpu: CpuLowering) -> None:
    if "triton" in art.manifest.get("backends", []):
        lowering = lower(art.graphs)
        launches = lowering.launches(graph)
        for unit, module, n in zip(lowering.units[graph], lowering.plan[graph], launches):
            typer.echo(f"unit {unit.index:>4}  {_where(unit)}  {'+'.join(n.op for n in unit.nodes):<34} {module}"
                       + (f"  ({n} launches)" if n > 1 else ""))
        typer.echo(f"{len(lowering.plan[graph])} units launch {len(set(lowering.plan[graph]))} distinct kernel modules "
                   f"(in {art.path / KERNELS_DIR})")
        per_layer = lowering.launches_per_layer(graph)
        typer.echo(f"the {graph} step launches {sum(launches)} kernels"
                   + (f", {per_layer} a layer" if per_layer is not None else "") + "\n")
    for unit, function in zip(cpu.units[graph], cpu.plan[graph]):
        typer.echo(f"cpu unit {unit.index:>4}  {_where(unit)}  {'+'.join(n.op for n in unit.nodes):<28} "
                   f"{function or 'template'}")
    generated = [f for f in cpu.plan[graph] if f is not None]
    typer.echo(f"{len(cpu.plan[graph])} CPU units: {len(generated)} call {len(set(generated))} distinct generated "
               f"C++ functions (in {art.path / CPU_KERNELS_FILE}), the others hand-written templates")


def _show_group(art: Artifact, graph: str, group: int, cpu: CpuLowering) -> None:
    parts = [(u, f) for u, f in zip(cpu.units[graph], cpu.plan[graph]) if u.group == group]
    if not parts:
        known = sorted({u.group for u in cpu.units[graph] if u.group is not None})
        raise RequestError(f"the {graph} graph has no group {group}; its groups are {known}")
    if "triton" in art.manifest.get("backends", []):
        lowering = lower(art.graphs)
        unit, module = next((u, m) for u, m in zip(lowering.units[graph], lowering.plan[graph]) if u.group == group)
        typer.echo(f"# {unit.label} -> {KERNELS_DIR}/{module}.py")
        for line in unit.ir_lines():
            typer.echo(f"#   {line}")
        typer.echo((art.path / KERNELS_DIR / f"{module}.py").read_text())
    for unit, function in parts:
        typer.echo(f"// cpu {unit.label}: {'+'.join(n.op for n in unit.nodes)} -> "
                   f"{f'{CPU_KERNELS_FILE}: {function}' if function else 'a hand-written template'}")
        if function:
            typer.echo(cpu.functions[function] + "\n")


def kernels_cmd(
    artifact: Path = typer.Argument(..., help="artifact directory"),
    graph: str = typer.Option("decode", help="prefill or decode"),
    group: Optional[int] = typer.Option(None, help="print this fusion group's IR lines and kernel source"),
) -> None:
    """Print the kernels codegen wrote for an artifact's fusion groups: Triton and C++."""
    art = load_artifact(artifact)
    if graph not in art.graphs:
        raise RequestError(f"graph {graph!r} is unknown; choose one of {', '.join(art.graphs)}")
    cpu = _cpu_lowering(art)
    if group is None:
        _list(art, graph, cpu)
    else:
        _show_group(art, graph, group, cpu)
