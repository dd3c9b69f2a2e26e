"""Generated kernels of quantized-weight units (qlinear groups, qembedding) against the
interpreted graph they came from (kernels/quant.py's refs), in Triton's interpreter.

Each case is a small IR graph grouped as the pipeline would; its quantized weights are real
quantizations (kernels/quant.py) of random float weights. Outputs are allocated under
deterministic mode, which fills them with NaN: an element a kernel forgets to write fails. f16
outputs are measured against the f32 graph on the same inputs (test_codegen_kernels' rule), and
a bug planted in every kernel (outputs zeroed, negated, 3% off) fails.
"""

from __future__ import annotations

import pytest
import torch

from llmc.compiler.codegen import lower
from llmc.compiler.dtypes import to_torch
from llmc.kernels.quant import quantize_int4, quantize_int8
import test_codegen_kernels
from test_codegen_kernels import BUGS, assert_generated_equals_interpreted, graph_of as grouped_graph, planted_import

CASES = {
    # int8 per output channel (K = 72, not a power of two), bias, then a residual add
    "qgemm_bias_residual": """
        %x = input() : {dt}[T,72]
        %r = input() : {dt}[T,40]
        %w.p.codes = weight() : i8[40,72]
        %w.p.scales = weight() : f16[40,1]
        %w.p.bias = weight() : {dt}[40]
        %0 = qlinear(%x, %w.p.codes, %w.p.scales, %w.p.bias, bits=8, group_size=72) : {dt}[T,40]
        %1 = add(%0, %r) : {dt}[T,40]
        return %1""",
    # a merged gate/up int4 GEMM (groups of 32) with the gated SiLU-and-multiply epilogue
    "qgemm_gated": """
        %x = input() : {dt}[T,128]
        %w.gu.codes = weight() : u4x2[240,64]
        %w.gu.scales = weight() : f16[240,4]
        %w.gu.mins = weight() : f16[240,4]
        %0 = qlinear(%x, %w.gu.codes, %w.gu.scales, %w.gu.mins, bits=4, group_size=32) : {dt}[T,240]
        %1 = silu_mul(%0) : {dt}[T,120]
        return %1""",
    # an int4 (groups of 64) GEMM split into column views feeding two norms; Q8_0 groups after
    "qgemm_split": """
        %x = input() : {dt}[T,128]
        %w.q.codes = weight() : u4x2[96,64]
        %w.q.scales = weight() : f16[96,2]
        %w.q.mins = weight() : f16[96,2]
        %w.n = weight() : {dt}[48]
        %w.o.codes = weight() : i8[24,48]
        %w.o.scales = weight() : f16[24,3]
        %0 = qlinear(%x, %w.q.codes, %w.q.scales, %w.q.mins, bits=4, group_size=64) : {dt}[T,96]
        %1 = split(%0, sizes=[48, 48]) : {dt}[T,48], {dt}[T,48]
        %2 = rmsnorm(%1, %w.n, eps=1e-05) : {dt}[T,48]
        %3 = rmsnorm(%1#1, %w.n, eps=1e-05) : {dt}[T,48]
        %4 = add(%2, %3) : {dt}[T,48]
        %5 = qlinear(%4, %w.o.codes, %w.o.scales, bits=8, group_size=16) : {dt}[T,24]
        return %5""",
    # quantized embedding rows (int4 groups of 128, then int8 per row) into a silu
    "qembedding": """
        %ids = input() : i64[T]
        %w.e.codes = weight() : u4x2[50,64]
        %w.e.scales = weight() : f16[50,1]
        %w.e.mins = weight() : f16[50,1]
        %w.f.codes = weight() : i8[50,128]
        %w.f.scales = weight() : f16[50,1]
        %0 = qembedding(%w.e.codes, %w.e.scales, %w.e.mins, %ids, bits=4, group_size=128, dtype="{dt}") : {dt}[T,128]
        %1 = qembedding(%w.f.codes, %w.f.scales, %ids, bits=8, group_size=128, dtype="{dt}") : {dt}[T,128]
        %2 = mul(%0, %1) : {dt}[T,128]
        return %2""",
}


def graph_of(case: str, dtype: str):
    return grouped_graph(case, dtype, CASES)


def quantized_inputs(graph, tokens: int, seed: int = 0):
    """Feeds and weights: each quantized weight a quantization of a random [N, K] float weight."""
    g = torch.Generator().manual_seed(seed)
    feeds, weights, nodes = {}, {}, graph.node_map()
    for node in graph.nodes:
        shape = [tokens if d == "T" else d for d in node.type.shape] if len(node.types) == 1 else None
        if node.op == "input":
            feeds[node.name] = (torch.randint(0, 50, shape, generator=g) if node.type.dtype == "i64"
                                else torch.randn(shape, generator=g).to(to_torch(node.type.dtype)))
        elif node.op == "weight" and node.name.endswith(".codes"):
            base = node.name[2:-len(".codes")]
            bits = 4 if node.type.dtype == "u4x2" else 8
            n, k = shape[0], shape[1] * (2 if bits == 4 else 1)
            group = k // nodes[f"w.{base}.scales"].type.shape[1]
            w = torch.randn(n, k, generator=g) / k ** 0.5
            parts = quantize_int4(w, group) if bits == 4 else quantize_int8(w, group)
            weights.update(zip([f"{base}.codes", f"{base}.scales", f"{base}.mins"], parts))
        elif node.op == "weight" and node.name[2:] not in weights:
            weights[node.name[2:]] = torch.randn(shape, generator=g).to(to_torch(node.type.dtype))
    return feeds, weights


def check_case(case: str, dtype: str, tokens: int, tmp_path) -> None:
    """The generated kernels against the interpreted graph: f32 within its tolerance, f16 as close
    to the f32 graph on the same inputs as the interpreted f16 graph is."""
    graph = graph_of(case, dtype)
    feeds, weights = quantized_inputs(graph, tokens)
    exact_graph = graph_of(case, "f32") if dtype == "f16" else None
    assert_generated_equals_interpreted(graph, weights, feeds, tmp_path, exact_graph, reduction=256, scale=4.0)


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("case", list(CASES))
def test_generated_quantized_kernels_equal_the_interpreted_graph(case, dtype, tokens, tmp_path):
    check_case(case, dtype, tokens, tmp_path)


@pytest.mark.parametrize("bug", list(BUGS))
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_bug_planted_in_every_generated_kernel_fails_the_check(case, dtype, bug, tmp_path, monkeypatch):
    monkeypatch.setattr(test_codegen_kernels, "import_module", planted_import(BUGS[bug]))
    with pytest.raises(AssertionError):
        check_case(case, dtype, 5, tmp_path)


UNITS = {
    "qgemm_bias_residual": [["qlinear", "add"]],
    "qgemm_gated": [["qlinear", "silu_mul"]],
    "qgemm_split": [["qlinear", "split"], ["rmsnorm"], ["rmsnorm", "add"], ["qlinear"]],
    "qembedding": [["qembedding"], ["qembedding"], ["mul"]],
}


@pytest.mark.parametrize("case", list(CASES))
def test_qlinear_takes_its_epilogue_into_one_launch(case):
    units = lower({case: graph_of(case, "f32")}).units[case]
    assert [[n.op for n in u.nodes] for u in units] == UNITS[case]


def test_the_gated_module_calls_the_template_with_configs_that_fit_the_groups():
    graph = graph_of("qgemm_gated", "f16")
    lowering = lower({graph.name: graph})
    (module,) = lowering.plan[graph.name]                                  # qlinear + silu_mul: one unit
    source = lowering.modules[module]
    assert "qlinear_triton(in0, in1, in2, in3, None, None, bits=4, group_size=32, activation='none', gated=True" \
        in source
    assert "block_k=32" in source and "block_k=64" not in source           # no K tile crosses a group of 32
