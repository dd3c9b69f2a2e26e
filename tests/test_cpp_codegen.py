"""Generated CPU kernels (compiler/codegen/cpp.py) against the interpreted graph they came from.

Each case is a small IR graph, grouped as the pipeline groups it; every generated CPU unit's
function is called on the unit's inputs as the torch references computed them, and its outputs
are compared with `interpret` on the unit's nodes alone. T = 1, 5 and 64; widths 24, 72 and 100
(a partial last chunk of 16); f32, bf16 and f16. f32: as close to the float64 run of the same
nodes as the f32 refs are (tolerances.assert_as_close_as_ref). bf16 and f16, where kernel and refs
round at the same points from fp32 values that differ only in fp32 rounding: every element within
one ulp of the result, and only as many differing as fp32-sized differences make (a dropped
rounding makes far more, and a planted one must fail). Outputs are poisoned with NaN in a buffer
wider than the row: a call on rows [first, last) writes every element of those rows and nothing
else, and run_generated (the op-by-op launcher, all rows, ATen's threads) gives the same bits. A
column-local unit's window function (NAME_cols), called on each 16 columns in turn, gives the row
function's bits and writes only its window; a unit with a row sum or outputs of two widths has none.
"""

from __future__ import annotations

import ctypes
import math
import textwrap

import pytest
import torch

from llmc.compiler.codegen import cpp
from llmc.compiler.codegen.cpu_lowering import CpuLowering, lower_cpu
from llmc.compiler.codegen.units import KernelUnit
from llmc.compiler.dtypes import to_torch
from llmc.compiler.formula import (PRIMITIVES, Expr, Row, exp, maximum, minimum, rounded, row_sum, rsqrt, sigmoid,
                                   sqrt, tanh)
from llmc.compiler.ir import Graph, Node, Value, parse_graph
from llmc.compiler.ops import OpRecord, operands, registered, verify
from llmc.kernels.generated import load_generated
from llmc.kernels.native import load_native_kernels
from llmc.passes.fusion_grouping import fusion_grouping
from llmc.passes.rewrite import PassContext
from llmc.runtime.cpu_program import generated_launch
from llmc.runtime.torch_backend import TorchProgram, interpret
from tolerances import EPS, assert_as_close_as_ref

WIDTHS = [24, 72, 100]
DTYPES = ["f32", "bf16", "f16"]
TOKENS = [1, 5, 64]
PAD = 8                     # poisoned columns past every output row


def every_primitive_formula(row, attrs):
    x, y = row["x"], row["y"]
    inner = rounded(exp(-x * 0.5) - tanh(3.0 * y), row.outs[0])
    scale = sqrt(maximum(x, 0.0) + 1.0) * rsqrt(minimum(y * y, 4.0) + 0.5)
    return (inner / scale + sigmoid(x) + row_sum(x * y) / row.widths["x"],)


def every_primitive_ref(x, attrs):
    """The formula in torch: in fp32 (float64 for float64 inputs), rounded where the formula rounds."""
    wide = torch.promote_types(x.x.dtype, torch.float32)
    X, Y = x.x.to(wide), x.y.to(wide)
    inner = (torch.exp(-X * 0.5) - torch.tanh(3.0 * Y)).to(x.x.dtype).to(wide)
    scale = torch.sqrt(torch.clamp_min(X, 0.0) + 1.0) * torch.rsqrt(torch.clamp_max(Y * Y, 4.0) + 0.5)
    return (inner / scale + torch.sigmoid(X) + (X * Y).sum(-1, keepdim=True) / X.shape[-1]).to(x.x.dtype)


# a test op whose formula uses every primitive (registered for this module's tests)
EVERY_PRIMITIVE = OpRecord("every_primitive", (operands("x", "y"),), (), lambda ts, a: (ts.x,), "rowwise",
                           "every formula primitive once", reference=every_primitive_ref,
                           formula=every_primitive_formula)

CASES = {
    "add": "%a = input() : {dt}[T,{w}]\n%b = input() : {dt}[T,{w}]\n%0 = add(%a, %b) : {dt}[T,{w}]\nreturn %0",
    "mul": "%a = input() : {dt}[T,{w}]\n%b = input() : {dt}[T,{w}]\n%0 = mul(%a, %b) : {dt}[T,{w}]\nreturn %0",
    "silu": "%x = input() : {dt}[T,{w}]\n%0 = silu(%x) : {dt}[T,{w}]\nreturn %0",
    "cast": "%x = input() : {dt}[T,{w}]\n%0 = cast(%x, dtype='{other}') : {other}[T,{w}]\nreturn %0",
    "silu_mul_halves": "%x = input() : {dt}[T,{w2}]\n%0 = silu_mul(%x) : {dt}[T,{w}]\nreturn %0",
    "silu_mul_apart": """%g = input() : {dt}[T,{w}]
        %u = input() : {dt}[T,{w}]
        %0 = silu_mul(%g, %u) : {dt}[T,{w}]
        return %0""",
    "split": """%x = input() : {dt}[T,{w}]
        %0 = split(%x, sizes=[{third}, {rest}]) : {dt}[T,{third}], {dt}[T,{rest}]
        return %0, %0#1""",
    "rmsnorm": """%x = input() : {dt}[T,{w}]
        %w.n = weight() : {dt}[{w}]
        %0 = rmsnorm(%x, %w.n, eps=1e-05) : {dt}[T,{w}]
        return %0""",
    "add_rmsnorm": """%x = input() : {dt}[T,{w}]
        %r = input() : {dt}[T,{w}]
        %w.n = weight() : {dt}[{w}]
        %0 = add_rmsnorm(%x, %r, %w.n, eps=1e-06) : {dt}[T,{w}], {dt}[T,{w}]
        return %0, %0#1""",
    # the norms that round once, after the weight (Gemma, OLMo-2): bf16 rows ~25% apart from the others'
    "rmsnorm_product": """%x = input() : {dt}[T,{w}]
        %w.n = weight() : {dt}[{w}]
        %0 = rmsnorm(%x, %w.n, eps=1e-05, rounding='product') : {dt}[T,{w}]
        return %0""",
    "add_rmsnorm_product": """%x = input() : {dt}[T,{w}]
        %r = input() : {dt}[T,{w}]
        %w.n = weight() : {dt}[{w}]
        %0 = add_rmsnorm(%x, %r, %w.n, eps=1e-06, rounding='product') : {dt}[T,{w}], {dt}[T,{w}]
        return %0, %0#1""",
    # fused chains, one unit each: the add's sum only the norm reads (a stack row), silu then mul
    # (fusion_grouping groups both), and a norm's sum both returned and read by the op after it
    # (grouped by hand: fusion_grouping leaves a returned value's producer apart)
    "add_then_rmsnorm": """%x = input() : {dt}[T,{w}]
        %r = input() : {dt}[T,{w}]
        %w.n = weight() : {dt}[{w}]
        %0 = add(%x, %r) : {dt}[T,{w}]
        %1 = rmsnorm(%0, %w.n, eps=1e-05) : {dt}[T,{w}]
        return %1""",
    "silu_then_mul": """%g = input() : {dt}[T,{w}]
        %u = input() : {dt}[T,{w}]
        %0 = silu(%g) : {dt}[T,{w}]
        %1 = mul(%0, %u) : {dt}[T,{w}]
        return %1""",
    "norm_epilogue": """%x = input() : {dt}[T,{w}]
        %r = input() : {dt}[T,{w}]
        %w.n = weight() : {dt}[{w}]
        %0 = add_rmsnorm(%x, %r, %w.n, eps=1e-05, group=0) : {dt}[T,{w}], {dt}[T,{w}]
        %1 = mul(%0, %0#1, group=0) : {dt}[T,{w}]
        return %1, %0#1""",
    # Gemma's ops, each alone and chained into one unit (the GeGLU gate, the embedding scale, soft-capping)
    "gelu_tanh": "%x = input() : {dt}[T,{w}]\n%0 = gelu_tanh(%x) : {dt}[T,{w}]\nreturn %0",
    "gelu_tanh_mul_halves": "%x = input() : {dt}[T,{w2}]\n%0 = gelu_tanh_mul(%x) : {dt}[T,{w}]\nreturn %0",
    "scale": "%x = input() : {dt}[T,{w}]\n%0 = scale(%x, factor=55.42562584220407) : {dt}[T,{w}]\nreturn %0",
    "softcap": "%x = input() : {dt}[T,{w}]\n%0 = softcap(%x, cap=0.5) : {dt}[T,{w}]\nreturn %0",
    # (GELU's inputs kept above -4: below, 1 + tanh cancels and torch's own fp32 result has no digit right)
    "gemma_chain": """%g = input() : {dt}[T,{w}]
        %u = input() : {dt}[T,{w}]
        %0 = softcap(%g, cap=3.0) : {dt}[T,{w}]
        %1 = gelu_tanh(%0) : {dt}[T,{w}]
        %2 = gelu_tanh_mul(%1, %u) : {dt}[T,{w}]
        %3 = scale(%2, factor=55.42562584220407) : {dt}[T,{w}]
        %4 = softcap(%3, cap=30.0) : {dt}[T,{w}]
        return %4""",
    "every_primitive": """%x = input() : {dt}[T,{w}]
        %y = input() : {dt}[T,{w}]
        %0 = every_primitive(%x, %y) : {dt}[T,{w}]
        return %0""",
}


@pytest.fixture(scope="module", autouse=True)
def every_primitive_op():
    with registered(EVERY_PRIMITIVE):
        yield


def graph_of(case: str, dtype: str, width: int) -> Graph:
    """Case `case` in `dtype` with rows `width` wide, verified and grouped (unless grouped by hand)."""
    fields = dict(dt=dtype, w=width, w2=2 * width, third=width // 3, rest=width - width // 3,
                  other="bf16" if dtype == "f32" else "f32")
    body = textwrap.indent(textwrap.dedent(CASES[case]).strip().format(**fields), "  ")
    graph = parse_graph(f"graph {case} {{\n{body}\n}}\n")
    verify(graph)
    return graph if "group=" in CASES[case] else fusion_grouping(graph, PassContext())


def generated_units(graph: Graph) -> list[tuple[KernelUnit, str]]:
    lowering = lower_cpu({graph.name: graph})
    return [(u, f) for u, f in zip(lowering.units[graph.name], lowering.plan[graph.name]) if f is not None]


@pytest.fixture(scope="module")
def library(every_primitive_op):
    """Every case's functions in one library (built once per machine, as an artifact's are)."""
    load_native_kernels()
    functions: dict[str, str] = {}
    for case in CASES:
        for dtype in DTYPES:
            for width in WIDTHS:
                graph = graph_of(case, dtype, width)
                functions |= lower_cpu({graph.name: graph}).functions
    return load_generated(CpuLowering(functions, {}, {}).source())


def unit_graph(graph: Graph, unit: KernelUnit) -> Graph:
    """The unit's nodes alone: its inputs become graph inputs u0, u1, ..., its outputs the result."""
    rename = {v: Value(f"u{i}") for i, v in enumerate(unit.inputs)}
    nodes = [Node(f"u{i}", "input", (), {}, (graph.type_of(v),)) for i, v in enumerate(unit.inputs)]
    nodes += [Node(n.name, n.op, tuple(rename.get(v, v) for v in n.inputs), n.attrs, n.types) for n in unit.nodes]
    return Graph("unit", nodes, unit.outputs)


def feeds_for(graph: Graph, tokens: int, seed: int) -> tuple[dict, dict]:
    """Random inputs (T = tokens) and weights of the graph's dtypes."""
    g = torch.Generator().manual_seed(seed)

    def sample(node):
        shape = [tokens if isinstance(d, str) else d for d in node.type.shape]
        return torch.randn(*shape, generator=g).to(to_torch(node.type.dtype))

    return ({n.name: sample(n) for n in graph.inputs()}, {n.name[2:]: sample(n) for n in graph.weights()})


FN = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64), ctypes.c_int64,
                      ctypes.c_int64)


def call(address: int, inputs: list[torch.Tensor], outputs: list[torch.Tensor], first: int, last: int) -> None:
    """The generated function's ABI, called directly: rows [first, last) of `outputs`."""
    values = inputs + outputs
    ptrs = (ctypes.c_void_p * len(values))(*[t.data_ptr() for t in values])
    strides = (ctypes.c_int64 * len(values))(*[t.stride(0) if t.dim() == 2 else 0 for t in values])
    FN(address)(ptrs, strides, first, last)


def poisoned(tokens: int, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN buffer PAD columns wider than the rows, and the [tokens, width] view of it."""
    buffer = torch.full((tokens, width + PAD), float("nan"), dtype=dtype)
    return buffer, buffer[:, :width]


def ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at each element's magnitude."""
    _, exponent = torch.frexp(t.double())
    return torch.ldexp(torch.full_like(t.double(), EPS[dtype] / 2), exponent)


def assert_rounded_alike(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """bf16 / f16: within one ulp everywhere, and few elements apart (see module docstring)."""
    got, want = got.double(), want.double()
    apart = got != want
    spacing = ulp(torch.maximum(got.abs(), want.abs()), dtype)
    assert ((got - want).abs() <= spacing).all(), f"{(got - want).abs().div(spacing).max():.3g} ulp apart"
    allowed = math.ceil(got.numel() * 64 * EPS[torch.float32] / EPS[dtype])
    assert apart.sum() <= allowed, f"{int(apart.sum())} of {got.numel()} elements differ, more than {allowed}"


def assert_output_matches(got: torch.Tensor, want: torch.Tensor, exact: torch.Tensor) -> None:
    if got.dtype == torch.float32:
        assert_as_close_as_ref(got, want, exact, torch.float32)
    else:
        assert_rounded_alike(got, want, got.dtype)


def check_unit(graph: Graph, unit: KernelUnit, address: int, tokens: int, seed: int) -> None:
    feeds, weights = feeds_for(graph, tokens, seed)
    values = interpret_values(graph, weights, feeds)
    inputs = [values[v] for v in unit.inputs]
    small = unit_graph(graph, unit)
    want = interpret(small, {}, {f"u{i}": t for i, t in enumerate(inputs)})
    exact = interpret(small, {}, {f"u{i}": t.double() for i, t in enumerate(inputs)})
    first, last = (0, 1) if tokens == 1 else (1, tokens - 1)
    buffers = [poisoned(tokens, graph.type_of(v).shape[-1], to_torch(graph.type_of(v).dtype)) for v in unit.outputs]
    call(address, inputs, [view for _, view in buffers], first, last)
    full = generated_launch(address, unit, graph)(inputs, {})
    for (buffer, view), whole, w, x in zip(buffers, full, want, exact, strict=True):
        assert buffer[:first].isnan().all() and buffer[last:].isnan().all(), "a row outside [first, last) written"
        assert buffer[first:last, view.shape[1]:].isnan().all(), "a column past the row's end written"
        assert not view[first:last].isnan().any(), "an element of rows [first, last) not written"
        assert torch.equal(view[first:last], whole[first:last]), "run_generated's rows differ from a direct call's"
        assert whole.dtype == w.dtype and whole.shape == w.shape
        assert_output_matches(whole, w, x)


def interpret_values(graph: Graph, weights: dict, feeds: dict) -> dict[Value, torch.Tensor]:
    """Every value of `graph` as the torch references compute it."""
    with torch.inference_mode():
        return TorchProgram(graph, weights).values(feeds)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_generated_kernels_equal_the_interpreted_graph(library, case, dtype, width, tokens):
    graph = graph_of(case, dtype, width)
    units = generated_units(graph)
    assert units, f"case {case} has no generated unit"
    for unit, function in units:
        check_unit(graph, unit, library.address(function), tokens, seed=tokens * 1000 + width)


def test_the_chains_are_one_generated_unit_each(every_primitive_op):
    for case in ("add_then_rmsnorm", "silu_then_mul", "norm_epilogue"):
        units = generated_units(graph_of(case, "bf16", 72))
        assert [len(u.nodes) for u, _ in units] == [2], case
    source = lower_cpu({"g": graph_of("add_then_rmsnorm", "bf16", 72)}).source()
    assert "alignas(64) float t0[72];" in source and "st(t0 + j, round_bf16(" in source   # the sum, a stack row
    source = lower_cpu({"g": graph_of("norm_epilogue", "bf16", 72)}).source()
    assert "t0, out0 = add_rmsnorm(" in source and "const Vec16 v1 = ld(out0 + j, n);" in source   # read back


def test_every_primitive_is_rendered():
    assert set(cpp.CALLS) | {"operand", "const", "round", "row_sum"} == set(PRIMITIVES)
    used: set[str] = set()

    def walk(e: Expr) -> None:
        used.add(e.op)
        for a in e.args:
            walk(a)

    for e in every_primitive_formula(Row({"x": 8, "y": 8}, {"x": "bf16", "y": "bf16"}, ["bf16"]), {}):
        walk(e)
    assert used == set(PRIMITIVES)            # so the every_primitive case runs each of them


# Planted in the generator: each must fail the check it names (dtype, width 100, T = 64).
PLANTED = {
    "rounds dropped": (("ROUNDS", "bf16", "{}"), "bf16", ["silu_mul_halves", "rmsnorm", "add_then_rmsnorm"]),
    "f16 rounds dropped": (("ROUNDS", "f16", "{}"), "f16", ["silu_mul_apart", "add_rmsnorm"]),
    "sigmoid 0.1% high": (("CALLS", "sigmoid", "sigmoid16({}) * 1.001f"), "f32", ["silu", "silu_then_mul"]),
    "row sum 0.1% low": (("CALLS", "div", "{} / ({} * 1.001f)"), "f32", ["rmsnorm", "every_primitive"]),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_a_bug_planted_in_the_generator_fails_the_check(every_primitive_op, bug, monkeypatch):
    (table, key, text), dtype, cases = PLANTED[bug]
    monkeypatch.setitem(getattr(cpp, table), key, text)
    for case in cases:
        graph = graph_of(case, dtype, 100)
        units = generated_units(graph)
        library = load_generated(lower_cpu({graph.name: graph}).source())
        with pytest.raises(AssertionError):
            for unit, function in units:
                check_unit(graph, unit, library.address(function), 64, seed=7)


COLS_FN = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64), ctypes.c_int64,
                           ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)
COLUMN_LOCAL = {"add", "mul", "cast", "silu", "silu_then_mul", "silu_mul_halves", "silu_mul_apart",
                "gemma_chain"}                                  # no row sums: each has a window function


def call_window(address: int, inputs: list[torch.Tensor], outputs: list[torch.Tensor], first: int, last: int,
                col0: int, col1: int) -> None:
    """A window function's ABI (compiler/codegen/cpp.py's NAME_cols), called directly."""
    values = inputs + outputs
    ptrs = (ctypes.c_void_p * len(values))(*[t.data_ptr() for t in values])
    strides = (ctypes.c_int64 * len(values))(*[t.stride(0) if t.dim() == 2 else 0 for t in values])
    COLS_FN(address)(ptrs, strides, first, last, col0, col1)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(COLUMN_LOCAL) + ["split", "rmsnorm", "add_then_rmsnorm", "every_primitive"])
def test_window_functions_compute_their_columns_as_the_row_function(library, case, dtype, width):
    """A column-local unit's window function, called on each 16 columns in turn, writes those columns
    of rows [first, last) and nothing else, and in all gives the row function's bits; a unit with a
    row sum has none."""
    graph = graph_of(case, dtype, width)
    lowering = lower_cpu({graph.name: graph})
    units = generated_units(graph)
    assert all((f in lowering.windows) == (case in COLUMN_LOCAL) for _, f in units), case
    feeds, weights = feeds_for(graph, 5, seed=width)
    values = interpret_values(graph, weights, feeds)
    for unit, function in (u for u in units if u[1] in lowering.windows):
        inputs = [values[v] for v in unit.inputs]
        whole = generated_launch(library.address(function), unit, graph)(inputs, {})
        buffers = [poisoned(5, graph.type_of(v).shape[-1], to_torch(graph.type_of(v).dtype)) for v in unit.outputs]
        for col0 in range(0, width, 16):
            call_window(library.address(function + "_cols"), inputs, [view for _, view in buffers], 1, 4, col0,
                        min(col0 + 16, width))
            for (_, view), want in zip(buffers, whole, strict=True):
                assert torch.equal(view[1:4, :col0 + 16], want[1:4, :col0 + 16]), "a window's columns differ"
                assert view[1:4, col0 + 16:].isnan().all(), "a column past the window written"
        for (buffer, view), want in zip(buffers, whole, strict=True):
            assert buffer[0].isnan().all() and buffer[4].isnan().all(), "a row outside [first, last) written"
            assert buffer[1:4, width:].isnan().all(), "a column past the row's end written"


def test_a_gated_window_reads_both_halves():
    graph = graph_of("silu_mul_halves", "bf16", 72)
    (unit, function), = generated_units(graph)
    assert lower_cpu({graph.name: graph}).windows[function] == cpp.ColumnReads(((0, 72),), 72)
