"""Generated kernels against the interpreted graph they came from (Triton interpreter).

Each case is a small IR graph; fusion_grouping groups it as the pipeline would, codegen writes
one kernel per unit, and the kernels' outputs must equal the torch backend's on the same inputs:
fp32 within the dtype's tolerance; fp16 as close to the fp32 graph on the same inputs as the
interpreted fp16 graph is; a bug planted in every kernel (outputs zeroed, negated, 3% off) fails.
Outputs are allocated with torch.empty under deterministic mode, which fills them with NaN: an
element a kernel forgets to write fails.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import pytest
import torch

from llmc.compiler.codegen import CodegenError, kernel_units, lower
from llmc.compiler.dtypes import to_torch
from llmc.compiler.ir import parse_graph
from llmc.compiler.ops import verify
from llmc.passes.fusion_grouping import fusion_grouping
from llmc.passes.rewrite import PassContext
from llmc.runtime.slot_program import LaunchSpec, SlotProgram
from llmc.runtime.torch_backend import interpret
from tolerances import assert_as_close_as_ref, tolerance

CASES = {
    # residual add + norm (two results), then a norm of its sum: width 72, not a power of two
    "add_rmsnorm": """
        %x = input() : {dt}[T,72]
        %r = input() : {dt}[T,72]
        %w.a = weight() : {dt}[72]
        %0 = add_rmsnorm(%x, %r, %w.a, eps=1e-05) : {dt}[T,72], {dt}[T,72]
        %1 = rmsnorm(%0#1, %w.a, eps=1e-06) : {dt}[T,72]
        return %0, %0#1, %1""",
    # the gate/up halves of one [T, 2N] input, then an elementwise chain fused after it
    "silu_mul_chain": """
        %x = input() : {dt}[T,240]
        %y = input() : {dt}[T,120]
        %0 = silu_mul(%x) : {dt}[T,120]
        %1 = add(%0, %y) : {dt}[T,120]
        %2 = silu(%1) : {dt}[T,120]
        %3 = mul(%2, %y) : {dt}[T,120]
        return %3""",
    # a split of an input, two-input silu_mul of its parts, a cast
    "split_cast": """
        %x = input() : {dt}[T,96]
        %0 = split(%x, sizes=[48, 48]) : {dt}[T,48], {dt}[T,48]
        %1 = silu_mul(%0, %0#1) : {dt}[T,48]
        %2 = cast(%1, dtype="f32") : f32[T,48]
        return %2""",
    # a row-wise op with an elementwise epilogue reading both its results
    "norm_epilogue": """
        %x = input() : {dt}[T,72]
        %r = input() : {dt}[T,72]
        %w.a = weight() : {dt}[72]
        %0 = add_rmsnorm(%x, %r, %w.a, eps=1e-05) : {dt}[T,72], {dt}[T,72]
        %1 = mul(%0, %0#1) : {dt}[T,72]
        return %1""",
    # a GEMM group: bias, then a residual add as its epilogue
    "gemm_residual": """
        %x = input() : {dt}[T,72]
        %r = input() : {dt}[T,40]
        %w.p = weight() : {dt}[40,72]
        %w.b = weight() : {dt}[40]
        %0 = linear(%x, %w.p, %w.b) : {dt}[T,40]
        %1 = add(%0, %r) : {dt}[T,40]
        return %1""",
    # the gate/up GEMM with its GeGLU epilogue (Gemma's MLP), then a residual add
    "gemm_geglu": """
        %x = input() : {dt}[T,72]
        %r = input() : {dt}[T,60]
        %w.gu = weight() : {dt}[120,72]
        %0 = linear(%x, %w.gu) : {dt}[T,120]
        %1 = gelu_tanh_mul(%0) : {dt}[T,60]
        %2 = add(%1, %r) : {dt}[T,60]
        return %2""",
    # Gemma 2's LM head: the GEMM with its final-logit soft-cap
    "gemm_softcap": """
        %x = input() : {dt}[T,72]
        %w.h = weight() : {dt}[40,72]
        %0 = linear(%x, %w.h) : {dt}[T,40]
        %1 = softcap(%0, cap=0.5) : {dt}[T,40]
        return %1""",
    # a GEMM whose output is split into column views feeding two norms
    "gemm_split": """
        %x = input() : {dt}[T,72]
        %w.q = weight() : {dt}[96,72]
        %w.n = weight() : {dt}[48]
        %0 = linear(%x, %w.q) : {dt}[T,96]
        %1 = split(%0, sizes=[48, 48]) : {dt}[T,48], {dt}[T,48]
        %2 = rmsnorm(%1, %w.n, eps=1e-05) : {dt}[T,48]
        %3 = rmsnorm(%1#1, %w.n, eps=1e-05) : {dt}[T,48]
        %4 = add(%2, %3) : {dt}[T,48]
        return %4""",
    # Gemma's elementwise ops chained into one kernel: the GeGLU gate of one [T, 2N] input,
    # soft-capping, a GELU, the embedding scale
    "gemma_chain": """
        %x = input() : {dt}[T,240]
        %0 = gelu_tanh_mul(%x) : {dt}[T,120]
        %1 = softcap(%0, cap=3.0) : {dt}[T,120]
        %2 = gelu_tanh(%1) : {dt}[T,120]
        %3 = scale(%2, factor=55.42562584220407) : {dt}[T,120]
        %4 = softcap(%3, cap=30.0) : {dt}[T,120]
        return %4""",
    # the Triton target's norm prologues (units.py triton_units): an add+RMSNorm into the gate/up GEMM
    # with its SwiGLU epilogue, its sum read on; an RMSNorm into a GEMM with bias and a residual
    # epilogue; width 80: a multiple of 16, not a power of two
    "norm_prologues": """
        %x = input() : {dt}[T,80]
        %r = input() : {dt}[T,80]
        %w.n1 = weight() : {dt}[80]
        %w.n2 = weight() : {dt}[80]
        %w.gu = weight() : {dt}[96,80]
        %w.p = weight() : {dt}[80,48]
        %w.o = weight() : {dt}[80,80]
        %w.b = weight() : {dt}[80]
        %0 = add_rmsnorm(%x, %r, %w.n1, eps=1e-05) : {dt}[T,80], {dt}[T,80]
        %1 = linear(%0, %w.gu) : {dt}[T,96]
        %2 = silu_mul(%1) : {dt}[T,48]
        %3 = linear(%2, %w.p) : {dt}[T,80]
        %4 = add(%3, %0#1) : {dt}[T,80]
        %5 = rmsnorm(%4, %w.n2, eps=1e-06) : {dt}[T,80]
        %6 = linear(%5, %w.o, %w.b) : {dt}[T,80]
        %7 = add(%6, %x) : {dt}[T,80]
        return %7, %4""",
    # a chain feeding a norm (elementwise before a row-wise op), norm weight of another width
    "chain_into_norm": """
        %x = input() : {dt}[T,80]
        %y = input() : {dt}[T,80]
        %w.n = weight() : {dt}[80]
        %0 = mul(%x, %y) : {dt}[T,80]
        %1 = rmsnorm(%0, %w.n, eps=1e-05) : {dt}[T,80]
        return %1""",
}


def graph_of(case: str, dtype: str, cases: dict[str, str] | None = None):
    """Case `case` of `cases` (default: this file's CASES) in `dtype`, verified and grouped."""
    body = textwrap.indent(textwrap.dedent((cases or CASES)[case].format(dt=dtype)).strip(), "  ")
    graph = parse_graph(f"graph {case} {{\n{body}\n}}\n")
    verify(graph)
    return fusion_grouping(graph, PassContext())


def import_module(tmp_path, name: str, source: str):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"codegen_test_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_generated(graph, weights, feeds, tmp_path):
    lowering = lower({graph.name: graph})
    launchers = {n: import_module(tmp_path, n, src).build(torch.device("cpu")) for n, src in lowering.modules.items()}
    launches = [LaunchSpec(lambda args, attrs, f=launchers[m]: f(*args), {}, u.inputs, u.outputs)
                for u, m in zip(lowering.units[graph.name], lowering.plan[graph.name])]
    with torch.inference_mode():
        return SlotProgram(graph, weights, launches)(feeds), lowering


def inputs_for(graph, tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    feeds, weights = {}, {}
    for node in graph.nodes:
        if node.op in ("input", "weight"):
            shape = [tokens if d == "T" else d for d in node.type.shape]
            value = torch.randn(shape, generator=g).to(to_torch(node.type.dtype))
            (feeds if node.op == "input" else weights)[node.name if node.op == "input" else node.name[2:]] = value
    return feeds, weights


def widened_inputs(exact_graph, weights, feeds):
    """`weights` and `feeds` as `exact_graph` (the same graph in f32) declares them: f16 values made
    f32 exactly; ids, codes and what it declares f16 (quantization scales) as they are."""
    types = {n.name: to_torch(n.type.dtype) for n in exact_graph.nodes if n.op in ("input", "weight")}
    return ({name: w.to(types[f"w.{name}"]) for name, w in weights.items()},
            {name: x.to(types[name]) for name, x in feeds.items()})


def float64_outputs(graph, weights, feeds) -> list:
    """The f32 graph's outputs computed in float64 (its inputs widened), or Nones where the graph
    takes anything but floats (quantized weights keep their codes' and scales' types)."""
    if any(t.dtype != torch.float32 for t in (*weights.values(), *feeds.values())):
        return [None] * len(graph.outputs)
    return interpret(graph, {k: w.double() for k, w in weights.items()}, {k: x.double() for k, x in feeds.items()})


def assert_generated_equals_interpreted(graph, weights, feeds, tmp_path, exact_graph=None,
                                        reduction: int | None = None, scale: float = 1.0) -> None:
    """The generated kernels' outputs (every element written: torch.empty fills NaN under
    deterministic algorithms) match the interpreted graph's. With `exact_graph` (the f32 twin of an
    f16 graph, whose fused kernels round at other points than the op-by-op graph): as close to its
    outputs on the same inputs as the interpreted f16 graph's are, within twice their error and an
    f16 rounding (tolerances.assert_as_close_as_ref). Without it (f32 graphs): within the dtype's
    tolerance for `reduction` and `scale`, or, where the graph's own rounding is larger than that (a
    chain of GEMMs whose sums reach the thousands and then cancel), as close to the graph computed in
    float64 as the interpreted graph is."""
    expected = interpret(graph, weights, feeds)
    exact = (interpret(exact_graph, *widened_inputs(exact_graph, weights, feeds)) if exact_graph is not None
             else float64_outputs(graph, weights, feeds))
    torch.use_deterministic_algorithms(True)
    try:
        got, _ = run_generated(graph, weights, feeds, tmp_path)
    finally:
        torch.use_deterministic_algorithms(False)
    for g_out, e_out, x_out in zip(got, expected, exact, strict=True):
        assert not g_out.isnan().any()
        tol = tolerance(e_out.dtype, reduction or g_out.shape[-1], scale=scale)
        if exact_graph is not None:
            assert_as_close_as_ref(g_out, e_out, x_out, torch.float16)
        elif x_out is not None and not torch.allclose(g_out, e_out, **tol):
            assert_as_close_as_ref(g_out, e_out, x_out, torch.float32)
        else:
            torch.testing.assert_close(g_out, e_out, **tol)


def planted_import(factor: float):
    """import_module whose kernels return their outputs times `factor`: a bug in every kernel."""
    def load(tmp_path, name, source, import_module=import_module):
        module = import_module(tmp_path, name, source)

        def build(device, build=module.build):
            launch = build(device)
            return lambda *args: tuple(out * factor for out in launch(*args))

        module.build = build
        return module

    return load


def check_case(case: str, dtype: str, tokens: int, tmp_path) -> None:
    """Case `case` in `dtype` on random inputs: generated against interpreted (f16: and the f32 graph)."""
    graph = graph_of(case, dtype)
    feeds, weights = inputs_for(graph, tokens)
    exact_graph = graph_of(case, "f32") if dtype == "f16" else None
    assert_generated_equals_interpreted(graph, weights, feeds, tmp_path, exact_graph)


# Planted in every generated kernel: each must fail the check.
BUGS = {"zeroed": 0.0, "negated": -1.0, "3% high": 1.03, "3% low": 0.97}


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("case", list(CASES))
def test_generated_kernels_equal_the_interpreted_graph(case, dtype, tokens, tmp_path):
    check_case(case, dtype, tokens, tmp_path)


@pytest.mark.parametrize("bug", list(BUGS))
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_bug_planted_in_every_generated_kernel_fails_the_check(case, dtype, bug, tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "import_module", planted_import(BUGS[bug]))
    with pytest.raises(AssertionError):
        check_case(case, dtype, 5, tmp_path)


@pytest.mark.parametrize("case", ["silu_mul_chain", "gemma_chain", "split_cast", "norm_epilogue", "chain_into_norm", "gemm_residual",
                                  "gemm_geglu", "gemm_softcap", "gemm_split"])
def test_the_fusing_cases_run_fewer_kernels_than_ops(case):
    graph = graph_of(case, "f32")
    assert len(kernel_units(graph)) < len([n for n in graph.nodes if n.op not in ("input", "weight")])


def test_a_unit_source_is_readable_and_shared_between_identical_layers():
    graph = parse_graph(textwrap.dedent("""\
        graph g {
          %x = input() : f32[T,72]
          %r = input() : f32[T,72]
          %w.a = weight() : f32[72]
          %w.b = weight() : f32[72]
          %0 = add_rmsnorm(%x, %r, %w.a, eps=1e-05) : f32[T,72], f32[T,72]
          %1 = add_rmsnorm(%0, %0#1, %w.b, eps=1e-05) : f32[T,72], f32[T,72]
          return %1, %1#1
        }
        """))
    lowering = lower({"g": graph})
    assert lowering.plan["g"][0] == lowering.plan["g"][1]          # two layers, one module
    source = lowering.modules[lowering.plan["g"][0]]
    assert "%0 = add_rmsnorm(%x, %r, %w.a, eps=1e-05)" in source        # the IR lines it serves
    assert "%1 = add_rmsnorm(%0, %0#1, %w.b, eps=1e-05)" in source
    assert "tl.rsqrt(" in source and "tl.sum(" in source and "@triton.jit" in source


def test_an_op_codegen_cannot_lower_is_named():
    graph = parse_graph(textwrap.dedent("""\
        graph g {
          %x = input() : f32[T,24]
          %p = input() : i64[T]
          %0 = rope(%x, %p, head_dim=8, theta=10000.0, scaling=None) : f32[T,24]
          return %0
        }
        """))
    with pytest.raises(CodegenError, match="op 'rope' .* cannot lower"):
        lower({"g": graph})
