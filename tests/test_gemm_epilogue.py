"""A GEMM with a generated epilogue (kernels/cpu/amx_epilogue.h, panel_epilogue.h; the step plan's
`linear_epilogue`).

The AMX kernel: a bf16 GEMM on AMX tiles whose column-local epilogue (a gated activation's window
function, generated from the IR as an artifact's are) runs on each 32 columns as they are made,
against the GEMM (amx_panel_gemm) then the epilogue's row function: equal bit for bit, at token
counts below, at and across the 16-token tiles, ATen's threads splitting the tokens (so a thread's
rows start past 0), K with and without a tail, across token blocks (K 4096: blocks of 128 tokens),
gate/up halves of one and of several windows, with and without bias; the output starts as NaN, so
an element left unwritten fails too (planted: the last window never run). Skipped, saying why, where
AMX is not usable.

The AVX-512 panel kernel's (every CPU; f32 and bf16): the same check against panel_gemm then the row
function, at token counts below and across its 12-token tiles and 48-row stages, across token blocks
(K 4096 f32: blocks of 12 tokens), ATen's threads splitting the windows (planted: a stage row stride
one panel short, so the up half overwrites the gate half of the next row, fails it).

The lowering: `epilogue_reads` (runtime/plan_generated.py) fuses a linear with the column-local
unit after it only where the plan can (the GEMM's result read by that unit alone, at whole
multiples of its width, W whole panels), and leaves the rest as two instructions. The whole-model
check, bit for bit against op by op, is tests/test_step_plan.py's (the tiny Llama's MLP of 160 runs
fused).
"""

from __future__ import annotations

import types

import pytest
import torch

from llmc.compiler.codegen.cpu_lowering import lower_cpu
from llmc.compiler.codegen.cpu_units import cpu_units
from llmc.compiler.ir import parse_graph
from llmc.kernels.amx import cpu_gemm_path
from llmc.kernels.generated import load_generated
from llmc.kernels.native import load_native_kernels
from llmc.kernels.panels import to_panels
from llmc.passes.fusion_grouping import fusion_grouping
from llmc.passes.rewrite import PassContext
from llmc.runtime.cpu_program import generated_launch
from llmc.runtime.plan_generated import epilogue_reads

BF16 = torch.bfloat16
GATED = ("silu_mul", "gelu_tanh_mul")
SHAPES = [(t, k, w) for t in (1, 15, 16, 33, 130) for k in (64, 90, 608) for w in (32, 96)]
SHAPES += [(130, 4096, 32)]                # token blocks of 128: a second block of 2 tokens


def gated_graph(op: str, width: int, n: int | None = None, also_returned: bool = False, k: int = 64,
                dtype: str = "bf16"):
    """x -> linear (n outputs, 2 x width unless given) -> the one-input gated `op`, grouped as the
    pipeline groups it; `also_returned`: the GEMM's result is a graph output too."""
    n = n or 2 * width
    text = (f"graph g {{\n  %x = input() : {dtype}[T,{k}]\n  %w.up = weight() : {dtype}[{n},{k}]\n"
            f"  %0 = linear(%x, %w.up) : {dtype}[T,{n}]\n  %1 = {op}(%0) : {dtype}[T,{width}]\n"
            f"  return %1{', %0' if also_returned else ''}\n}}\n")
    return fusion_grouping(parse_graph(text), PassContext())


@pytest.fixture(scope="module")
def windows():
    """(op, W, dtype) -> (row function address, window function address, the unit, its graph, the library)."""
    load_native_kernels()
    made = {}
    for op in GATED:
        for width in (32, 96):
            for dtype, name in ((BF16, "bf16"), (torch.float32, "f32")):
                graph = gated_graph(op, width, dtype=name)
                lowering = lower_cpu({graph.name: graph})
                (unit, fn), = [(u, f) for u, f in zip(lowering.units["g"], lowering.plan["g"]) if f is not None]
                library = load_generated(lowering.source())
                made[op, width, dtype] = (library.address(fn), library.address(fn + "_cols"), unit, graph, library)
    return made


def gate_up_operands(t: int, k: int, width: int, bias: bool, dtype: torch.dtype):
    """Seeded x [t, k], the panels of a [2 x width, k] gate/up weight, and its bias (or None), in dtype."""
    g = torch.Generator().manual_seed(t * k + width)
    x = torch.randn(t, k, generator=g).to(dtype)
    w = torch.randn(2 * width, k, generator=g).to(dtype)
    b = torch.randn(2 * width, generator=g).to(dtype) if bias else None
    return x, to_panels(w), b


def amx_or_skip() -> None:
    path, why = cpu_gemm_path()
    if path != "amx-bf16":
        pytest.skip(f"AMX is not usable here: {why or path}")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("op", GATED)
@pytest.mark.parametrize("t,k,width", SHAPES)
def test_the_fused_gemm_equals_the_gemm_then_the_epilogue(windows, op, t, k, width, bias):
    amx_or_skip()
    row_fn, window_fn, unit, graph, _ = windows[op, width, BF16]
    x, panels, b = gate_up_operands(t, k, width, bias, BF16)
    gate_up = torch.ops.llmc.amx_panel_gemm(x, panels, 2 * width, b)
    (want,) = generated_launch(row_fn, unit, graph)([gate_up], {})
    got = torch.full((t, width), float("nan"), dtype=BF16)
    torch.ops.llmc.amx_gemm_epilogue(x, panels, b, window_fn, 2, got)
    assert torch.equal(got, want)


PANEL_SHAPES = [(t, k, w) for t in (1, 13, 50, 130) for k in (64, 90) for w in (32, 96)]
PANEL_SHAPES += [(30, 4096, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("op", GATED)
@pytest.mark.parametrize("t,k,width", PANEL_SHAPES)
def test_the_panel_kernel_fused_equals_the_gemm_then_the_epilogue(windows, op, t, k, width, bias, dtype):
    row_fn, window_fn, unit, graph, _ = windows[op, width, dtype]
    x, panels, b = gate_up_operands(t, k, width, bias, dtype)
    # row by row: the panel kernel's values (a token's do not depend on its batch), where panel_gemm
    # would take AMX tiles for bf16
    gate_up = torch.cat([torch.ops.llmc.panel_gemm(row, panels, 2 * width, b) for row in x.split(1)])
    (want,) = generated_launch(row_fn, unit, graph)([gate_up], {})
    got = torch.full((t, width), float("nan"), dtype=dtype)
    torch.ops.llmc.panel_gemm_epilogue(x, panels, b, window_fn, 2, got)
    assert torch.equal(got, want)


def reads_of(graph) -> int:
    """What the plan's lowering decides for the graph's GEMM unit and the unit after it."""
    lowering = lower_cpu({graph.name: graph})
    units = cpu_units(graph)
    names = lowering.plan[graph.name]
    window = (0, lowering.windows[names[1]]) if names[1] in lowering.windows else None
    return epilogue_reads(types.SimpleNamespace(graph=graph), units[0], units[1], window)


def test_the_plan_fuses_a_gated_activation_after_its_gemm():
    assert reads_of(gated_graph("silu_mul", 64)) == 2
    assert reads_of(gated_graph("gelu_tanh_mul", 96)) == 2


@pytest.mark.parametrize("why,graph", [
    ("W not whole panels", lambda: gated_graph("silu_mul", 72)),
    ("the GEMM's result is also a graph output", lambda: gated_graph("silu_mul", 64, also_returned=True)),
])
def test_the_plan_leaves_what_it_cannot_fuse(why, graph):
    assert reads_of(graph()) == 0, why


def test_a_unit_with_a_row_sum_is_no_epilogue():
    text = ("graph g {\n  %x = input() : bf16[T,64]\n  %w.o = weight() : bf16[64,64]\n  %w.n = weight() : bf16[64]\n"
            "  %0 = linear(%x, %w.o) : bf16[T,64]\n  %1 = rmsnorm(%0, %w.n, eps=1e-05) : bf16[T,64]\n"
            "  return %1\n}\n")
    assert reads_of(fusion_grouping(parse_graph(text), PassContext())) == 0
