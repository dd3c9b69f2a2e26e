"""`llmc passes`, `llmc ir` and `llmc debug bisect|diff`: the pass-level debugging tools.

`register(app, user_errors)` (called at the end of tools/cli.py) adds them to the main app.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Callable, Optional

import typer

from llmc.compiler.ir import Graph


class Entry(str, enum.Enum):
    prefill = "prefill"
    decode = "decode"
    draft = "draft"


class Format(str, enum.Enum):
    text = "text"
    dot = "dot"
    onnx = "onnx"


def passes_cmd() -> None:
    """List the pass pipeline in order, one line per pass."""
    from llmc.passes.pipeline import PIPELINE

    for i, p in enumerate(PIPELINE, 1):
        typer.echo(f"{i:02d} {p.name:<24} {p.summary}" + ("  (required)" if p.required else ""))


def ops_cmd(verbose: bool = typer.Option(False, "--verbose", "-v", help="each cell's kernel or reason")) -> None:
    """The op x backend matrix: what each backend does with each op (lowered, declined, missing)."""
    from llmc.compiler.ops.matrix import format_matrix

    typer.echo(format_matrix(verbose))


def _is_artifact(path: Path) -> bool:
    from llmc.runtime.artifact import MANIFEST

    return path.is_dir() and (path / MANIFEST).is_file()


def _artifact_graph(path: Path, entry: str) -> Graph:
    from llmc.runtime.artifact import load_graph, read_manifest, require_entry

    require_entry(path, read_manifest(path), entry)
    return load_graph(path, entry)


def _model_graph(source: str | None, entry: str, after: str | None, dtype: str,
                 disabled: tuple[str, ...]) -> Graph:
    from llmc.compiler.dtypes import USER_DTYPES
    from llmc.compiler.frontend import trace
    from llmc.models.config import ModelError
    from llmc.models.loader import load_config
    from llmc.passes.pipeline import run_pipeline
    from llmc.passes.rewrite import PassContext

    if dtype not in USER_DTYPES:
        raise ModelError(f"dtype {dtype!r} is not supported; choose one of {', '.join(USER_DTYPES)}")
    if entry == "draft":
        raise ModelError("the draft graph's layers are chosen at compile time; compile the model with "
                         "--draft-skip N and give `llmc ir` the artifact")
    graph = trace(load_config(source), entry, USER_DTYPES[dtype])
    if after == "traced":
        return graph
    return run_pipeline(graph, PassContext(), disabled, stop_after=after)[0]


def ir_cmd(
    model_or_artifact: Optional[str] = typer.Argument(
        None, help="artifact directory, HF folder or .gguf; omit for the embedded SmolLM2-135M-Instruct"),
    after: Optional[str] = typer.Option(None, "--after", help="a pass name (or 'traced'): the IR after it; "
                                        "default: after the whole pipeline (models only)"),
    graph: Entry = typer.Option(Entry.prefill, "--graph", help="entry graph: prefill, decode or draft (an artifact "
                                 "compiled with --draft-skip)"),
    fmt: Format = typer.Option(Format.text, "--format", help="text (IR), dot (Graphviz) or onnx (for Netron)"),
    out: Optional[Path] = typer.Option(None, "-o", "--out", help="write to this file (required for onnx)"),
    dtype: str = typer.Option("float32", help="compute dtype the model is traced in"),
    disable_pass: list[str] = typer.Option([], "--disable-pass", help="skip a pass by name (repeatable)"),
) -> None:
    """Print the IR of a model after any pass, or of an artifact; or export it as DOT or ONNX."""
    from llmc.runtime.artifact import ArtifactError

    if fmt is Format.onnx and out is None:
        raise typer.BadParameter("--format onnx writes a binary file; give -o FILE.onnx", param_hint="-o")
    path = Path(model_or_artifact) if model_or_artifact else None
    if path is not None and _is_artifact(path):
        if after is not None or disable_pass:
            raise ArtifactError(f"{path} is an artifact, which holds only the final IR; give the model "
                                "to see the IR --after a pass or with --disable-pass")
        ir_graph = _artifact_graph(path, graph.value)
    else:
        ir_graph = _model_graph(model_or_artifact, graph.value, after, dtype, tuple(disable_pass))
    _emit(ir_graph, fmt, out)


def _emit(graph: Graph, fmt: Format, out: Path | None) -> None:
    from llmc.compiler.ir import print_graph

    from .graph_export import to_dot, to_onnx

    if fmt is Format.onnx:
        import onnx

        onnx.save(to_onnx(graph), str(out))
        typer.echo(f"wrote {out}", err=True)
        return
    text = print_graph(graph) if fmt is Format.text else to_dot(graph)
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text)
        typer.echo(f"wrote {out}", err=True)


def bisect_cmd(
    model: Optional[str] = typer.Argument(None, help="HF folder or .gguf; omit for the embedded SmolLM2-135M-Instruct"),
    dtype: str = typer.Option("float32", help="compute dtype: float32, bfloat16 or float16"),
    steps: int = typer.Option(16, help="greedy decode steps compared with the traced graph (0: none)"),
    prompt: str = typer.Option("What is the capital of France?", help="the real prompt (chat template applied)"),
    disable_pass: list[str] = typer.Option([], "--disable-pass", help="skip a pass by name (repeatable)"),
    seed: int = typer.Option(0, help="seed of the random token probes"),
    tp: int = typer.Option(1, help="shard for N tensor-parallel ranks, run in lockstep in this process"),
) -> None:
    """Run the pipeline pass by pass and name the first pass that changes the model's output.

    Exits 1 when a pass diverges, so a script can use it as a check."""
    from llmc.compiler.dtypes import USER_DTYPES
    from llmc.models.config import ModelError
    from llmc.models.embedded import EMBEDDED_NAME
    from llmc.models.loader import load_model
    from llmc.passes.pipeline import check_pass_options

    from .bisect import bisect

    if dtype not in USER_DTYPES:
        raise ModelError(f"dtype {dtype!r} is not supported; choose one of {', '.join(USER_DTYPES)}")
    check_pass_options(tuple(disable_pass))
    name = Path(model).name if model else f"{EMBEDDED_NAME} (embedded)"
    if tp < 1:
        raise ModelError(f"--tp {tp} is not a rank count; give 1 or more")
    report = bisect(load_model(model), name, dtype, steps, prompt, tuple(disable_pass), seed, tp)
    typer.echo(report.render(), nl=False)
    if report.culprit is not None:
        raise typer.Exit(1)


def diff_cmd(
    a: Path = typer.Argument(..., exists=True, dir_okay=False, help="first IR file (e.g. a --dump-ir file)"),
    b: Path = typer.Argument(..., exists=True, dir_okay=False, help="second IR file"),
    context: int = typer.Option(1, help="unchanged lines shown around each change"),
) -> None:
    """A readable structural diff of two IR dumps: op count changes, then the changed lines."""
    from .ir_diff import diff_ir_text

    typer.echo(diff_ir_text(a.read_text(), b.read_text(), str(a), str(b), context), nl=False)


def register(app: typer.Typer, user_errors: Callable) -> None:
    """Add `passes`, `ops`, `ir` and the `debug` sub-app to the main `llmc` app."""
    app.command("passes")(passes_cmd)
    app.command("ops")(ops_cmd)
    app.command("ir")(user_errors(ir_cmd))
    debug = typer.Typer(no_args_is_help=True, help="Find what a pass did to a model: bisect, diff.")
    debug.command("bisect")(user_errors(bisect_cmd))
    debug.command("diff")(user_errors(diff_cmd))
    app.add_typer(debug, name="debug")
