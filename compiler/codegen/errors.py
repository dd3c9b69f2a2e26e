"""The one error codegen raises: a unit it cannot lower, named with its graph, unit and op."""

from __future__ import annotations

from llmc.compiler.ir import IRError


class CodegenError(IRError):
    """Codegen cannot lower this unit; compiling for the cuda target stops with this sentence."""
