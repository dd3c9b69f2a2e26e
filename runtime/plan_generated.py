"""The step plan's lowerings of generated kernels (runtime/step_plan.py states their ABI): a
generated unit alone as instruction `generated` (`lower_generated`), or, where `epilogue_reads`
finds a column-local unit that alone reads a linear's (or a qlinear's) result at whole panels, that
GEMM and the unit as one instruction, `linear_epilogue` (or `qlinear_epilogue`: `lower_epilogue`).
Each takes the plan's `_Lowering` (`lo`) and returns the encoded instruction, or raises `NotPlannable`.
"""

from __future__ import annotations

from typing import Any

import torch

from llmc.compiler.codegen.units import KernelUnit
from llmc.compiler.ir import Node, Value
from llmc.kernels.panels import PANEL
from llmc.kernels.step_plan_isa import Encoded, encode

from .plan_gemm import NotPlannable, linear_args, qlinear_args


def lower_generated(lo, fn_address: int, inputs: list[Value], outputs: list[Value],
                    keepalive: Any) -> Encoded:
    """A generated kernel at `fn_address` (`ctypes.cast(lib.NAME, ctypes.c_void_p).value`; the
    module docstring states its ABI) reading `inputs` and writing `outputs` (results of graph nodes,
    made here), as instruction `generated`. An input is an activation the plan holds, a graph input,
    or a weight held as a plan constant (a 1-D one is read with stride 0); the plan holds
    `keepalive` (the kernel's ctypes library) so the code stays mapped."""
    ids = _generated_values(lo, inputs, outputs, keepalive)
    return encode("generated", fn=fn_address, num_inputs=len(inputs), values=ids)


def _generated_values(lo, inputs: list[Value], outputs: list[Value], keepalive: Any) -> list[int]:
    """The plan values a generated kernel reads (`inputs`) and writes (`outputs`, made here), in its
    ABI's order; the plan holds `keepalive`, the kernel's library."""
    unit = lo.nodes[outputs[0].node]
    ids = [_generated_input(lo, v, unit) for v in inputs]
    ids += [lo.result(lo.nodes[v.node], v.index) for v in outputs]
    lo.keepalive.append(keepalive)
    return ids


def epilogue_reads(lo, gemm: KernelUnit, unit: KernelUnit, window: tuple | None) -> int:
    """How many column groups of its own width a column-local generated `unit` (its window function
    and ColumnReads in `window`) reads of the result of `gemm`, a linear or qlinear before it, when the
    step plan can run it as that GEMM's epilogue; 0 when not: the result must be read by `unit`
    alone, at columns 0, W, 2W, ... of a GEMM W, 2W, ... wide, W a multiple of the panel width."""
    if window is None or len(gemm.nodes) != 1 or gemm.nodes[0].op not in ("linear", "qlinear"):
        return 0
    _, reads = window
    result = gemm.nodes[0].value()
    n, names = lo.graph.type_of(result).shape[1], {node.name for node in unit.nodes}
    readers = {node.name for node in lo.graph.nodes if result in node.inputs}
    if result not in unit.inputs or result in lo.graph.outputs or not readers <= names or reads.width % PANEL:
        return 0
    groups = n // reads.width
    wanted = tuple(range(0, n, reads.width))
    return groups if n % reads.width == 0 and reads.starts[unit.inputs.index(result)] == wanted else 0


def lower_epilogue(lo, gemm: Node, unit: KernelUnit, fn_address: int, window: tuple, reads: int,
                   keepalive: Any) -> Encoded:
    """`gemm` (a linear, or a qlinear) and the generated `unit` after it as instruction `linear_epilogue`
    (`qlinear_epilogue`; the unit's outputs made before the GEMM's dying values are released: the GEMM
    still reads its x while the epilogue writes)."""
    quantized = gemm.op == "qlinear"
    args = dict(qlinear_args(lo, gemm), picks=-1) if quantized else linear_args(lo, gemm)
    ids = _generated_values(lo, list(unit.inputs), list(unit.outputs), keepalive)
    window_fn, columns = window
    return encode("qlinear_epilogue" if quantized else "linear_epilogue", **args, fn=fn_address, window_fn=window_fn,
                  source=list(unit.inputs).index(gemm.value()), reads=reads, width=columns.width,
                  num_inputs=len(unit.inputs), values=ids)


def _generated_input(lo, v: Value, unit: Node) -> int:
    """The plan value of a generated kernel's input `v` (`unit` reads it)."""
    op = lo.nodes[v.node].op
    if op == "weight":
        w = lo.weight(v)
        if not isinstance(w, torch.Tensor) or w.dim() not in (1, 2):
            raise NotPlannable(f"{unit.name} ({unit.op}) reads {v}, not a 1-D or 2-D tensor a generated kernel takes")
        return lo.constant(w.contiguous())
    return lo.ids[v] if op == "input" else lo.activation(v, unit)
