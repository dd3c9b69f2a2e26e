"""`llmc kernels ART [--graph decode] [--group N]`: the generated kernel of every fusion group.

Without --group: one line per kernel unit of the graph (its group, its ops, the kernel module
it launches) and how many distinct modules the artifact holds. With --group N: that group's IR
lines and the full source of its kernel module, as the artifact stores it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from llmc.compiler.artifact_format import KERNELS_DIR
from llmc.compiler.codegen import lower
from llmc.runtime.artifact import ArtifactError, load_artifact
from llmc.runtime.sampling_params import RequestError


def kernels_cmd(
    artifact: Path = typer.Argument(..., help="artifact directory compiled with --target cuda"),
    graph: str = typer.Option("decode", help="prefill or decode"),
    group: Optional[int] = typer.Option(None, help="print this fusion group's IR lines and kernel source"),
) -> None:
    """Print the Triton kernels codegen wrote for an artifact's fusion groups."""
    art = load_artifact(artifact)
    if "triton" not in art.manifest.get("backends", []):
        raise ArtifactError(f"{artifact} was compiled for the cpu target and has no kernels; recompile it with "
                            "`llmc compile --target cuda`")
    if graph not in art.graphs:
        raise RequestError(f"graph {graph!r} is unknown; choose one of {', '.join(art.graphs)}")
    lowering = lower(art.graphs)
    pairs = list(zip(lowering.units[graph], lowering.plan[graph]))
    if group is None:
        for unit, module in pairs:
            where = f"group {unit.group:>3}" if unit.group is not None else "         "
            typer.echo(f"unit {unit.index:>4}  {where}  {'+'.join(n.op for n in unit.nodes):<28} {module}")
        typer.echo(f"{len(pairs)} units launch {len(set(lowering.plan[graph]))} distinct kernel modules "
                   f"(in {artifact / KERNELS_DIR})")
        return
    chosen = [(u, m) for u, m in pairs if u.group == group]
    if not chosen:
        known = sorted({u.group for u, _ in pairs if u.group is not None})
        raise RequestError(f"the {graph} graph has no group {group}; its groups are {known}")
    unit, module = chosen[0]
    typer.echo(f"# {unit.label} -> {KERNELS_DIR}/{module}.py")
    for line in unit.ir_lines():
        typer.echo(f"#   {line}")
    typer.echo((art.path / KERNELS_DIR / f"{module}.py").read_text())
