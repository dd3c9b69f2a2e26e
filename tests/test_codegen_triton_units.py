"""The Triton target's unit cut (compiler/codegen/units.py `triton_units`): each RMSNorm unit merged
into the GEMM unit that reads its normed row, as that template's prologue, and each near miss left
alone; the CPU units stay kernel_units'; the decode step's launches are counted per layer.

The generated kernels' numbers are checked in test_codegen_kernels.py (case "norm_prologues",
against the interpreted graph, with planted bugs) and a whole model's in test_triton_executor.py.
"""

from __future__ import annotations

import textwrap

import pytest

from llmc.compiler.codegen import kernel_units, lower, triton_units
from llmc.compiler.codegen.cpu_units import cpu_units
from llmc.compiler.codegen.templates import unit_launches
from llmc.compiler.ir import parse_graph
from llmc.compiler.ops import verify
from llmc.passes.fusion_grouping import fusion_grouping
from llmc.passes.rewrite import PassContext

from test_codegen_kernels import graph_of

# a norm, then a GEMM reading it; {extra} lines go before the return
NEAR = """
    %x = input() : f32[T,{width}]
    %r = input() : f32[T,{width}]
    %w.n = weight() : f32[{width}]
    %w.p = weight() : f32[{n},{width}]
    %0 = add_rmsnorm(%x, %r, %w.n, eps=1e-05) : f32[T,{width}], f32[T,{width}]
    %1 = linear(%0, %w.p) : f32[T,{n}]
    {extra}
    return {returns}"""


def grouped(body: str, **fields):
    text = textwrap.indent(textwrap.dedent(body.format(**fields)).strip(), "  ")
    graph = parse_graph(f"graph g {{\n{text}\n}}\n")
    verify(graph)
    return fusion_grouping(graph, PassContext())


def ops(units) -> list[str]:
    return ["+".join(n.op for n in u.nodes) for u in units]


def test_the_near_misses_graph_merges_when_nothing_is_missed():
    graph = grouped(NEAR, width=80, extra="", returns="%1, %0#1", n=40)
    assert ops(triton_units(graph)) == ["add_rmsnorm+linear"]


def test_each_norm_is_merged_into_the_gemm_that_reads_it():
    graph = graph_of("norm_prologues", "f32")
    assert ops(kernel_units(graph)) == ["add_rmsnorm", "linear+silu_mul", "linear+add", "rmsnorm", "linear+add"]
    units = triton_units(graph)
    assert ops(units) == ["add_rmsnorm+linear+silu_mul", "linear+add", "rmsnorm+linear+add"]
    first = units[0]
    assert [str(v) for v in first.outputs] == ["%0#1", "%2"]        # the sum read on, then the GEMM's result
    assert [str(v) for v in first.inputs] == ["%x", "%r", "%w.n1", "%w.gu"]
    assert [u.index for u in units] == [0, 1, 2] and units[2].group == kernel_units(graph)[4].group
    source = lower({graph.name: graph}).modules[lower({graph.name: graph}).plan[graph.name][0]]
    assert "norm_linear_triton(in0, in2, in3, None, None, eps=1e-05, norm_residual=in1" in source


def test_the_cpu_target_keeps_its_norm_units():
    graph = graph_of("norm_prologues", "f32")
    assert {"add_rmsnorm", "rmsnorm"} <= set(ops(cpu_units(graph)))


@pytest.mark.parametrize("why,width,extra,returns", [
    ("the row is not a multiple of 16 wide", 72, "", "%1, %0#1"),
    ("the normed row is a result too", 80, "", "%1, %0"),
    ("another op reads the normed row", 80, "%2 = linear(%0, %w.p) : f32[T,40]", "%1, %2"),
    ("the GEMM's epilogue reads the sum", 48, "%2 = add(%1, %0#1) : f32[T,48]", "%2"),
])
def test_a_near_miss_launches_the_norm_on_its_own(why, width, extra, returns):
    graph = grouped(NEAR, width=width, extra=extra, returns=returns, n=48 if "sum" in why else 40)
    assert ops(triton_units(graph)) == ops(kernel_units(graph)), why
    assert any(u.nodes[0].op == "add_rmsnorm" and len(u.nodes) == 1 for u in triton_units(graph)), why


def test_a_quantized_gemm_takes_neither_the_norm_nor_the_rope():
    """qgemm.py has no prologue and no RoPE epilogue: the norm and the rope launch on their own."""
    graph = grouped(QKV.replace("%w.qkv = weight() : f32[128,64]", "%w.qkv.codes = weight() : i8[128,64]\n"
                                "    %w.qkv.scales = weight() : f16[128,1]")
                    .replace("linear(%0, %w.qkv)", "qlinear(%0, %w.qkv.codes, %w.qkv.scales, bits=8, group_size=64)"),
                    cache=FLOAT_CACHE, extra="")
    assert ops(triton_units(graph)) == ["rmsnorm", "qlinear", "rope_kv_write"]


def test_a_graph_without_two_layers_has_no_launches_per_layer():
    """(A model's count: test_codegen_cli.py's `llmc kernels` test.)"""
    graph = graph_of("norm_prologues", "f32")
    lowering = lower({graph.name: graph})
    assert lowering.launches(graph.name) == [1, 1, 1] and lowering.launches_per_layer(graph.name) is None


# a decode step's QKV: a norm, the merged GEMM, RoPE + KV write; {extra}: the rope's attrs; {cache}: its type
QKV = """
    %x = input() : f32[S,64]
    %positions = input() : i64[S]
    %kv_cache = input() : {cache}
    %slot_mapping = input() : i64[S]
    %w.n = weight() : f32[64]
    %w.qkv = weight() : f32[128,64]
    %0 = rmsnorm(%x, %w.n, eps=1e-05) : f32[S,64]
    %1 = linear(%0, %w.qkv) : f32[S,128]
    %2 = rope_kv_write(%1, %positions, %kv_cache, %slot_mapping, layer=1, num_heads=4, num_kv_heads=2, head_dim=16, \
theta=10000.0, scaling=None{extra}) : f32[S,64], {cache}
    return %2, %2#1"""
FLOAT_CACHE, INT8_CACHE = "f32[2,2,NB,2,BS,16]", "i8[2,2,NB,2,BS,20]"


def test_the_qkv_gemm_takes_rope_and_the_kv_write_as_its_epilogue():
    graph = grouped(QKV, cache=FLOAT_CACHE, extra="")
    assert ops(triton_units(graph)) == ["rmsnorm+linear+rope_kv_write"]
    lowering = lower({graph.name: graph})
    source = lowering.modules[lowering.plan[graph.name][0]]
    assert "qkv_rope_triton(in0, in2, None, in3, in4, in5, layer=1, num_heads=4, num_kv_heads=2" in source
    assert "norm_weight=in1, eps=1e-05, norm_residual=None" in source and "return result[0], result[1]\n" in source


@pytest.mark.parametrize("why,cache,extra", [
    ("a partial rotary", FLOAT_CACHE, ", rotary_dim=8"),
    ("an int8 cache", INT8_CACHE, ""),
])
def test_a_rope_the_epilogue_cannot_take_launches_on_its_own(why, cache, extra):
    graph = grouped(QKV, cache=cache, extra=extra)
    assert ops(triton_units(graph)) == ["rmsnorm+linear", "rope_kv_write"], why


def test_a_qkv_read_by_another_op_keeps_its_rope_apart():
    graph = grouped(QKV.replace("return %2, %2#1", "return %2, %2#1, %1"), cache=FLOAT_CACHE, extra="")
    assert ops(triton_units(graph)) == ["rmsnorm+linear", "rope_kv_write"]


def test_a_profile_files_a_norm_and_gemm_unit_under_gemm():
    """The triton executor's launch kind (llmc profile's GEMM/GEMV column) is the GEMM's, not the merged norm's."""
    from llmc.runtime.triton_executor import unit_kind

    merged = triton_units(grouped(QKV, cache=FLOAT_CACHE, extra=""))
    alone = triton_units(grouped(QKV, cache=FLOAT_CACHE, extra=", rotary_dim=8"))
    assert [unit_kind(u) for u in merged] == ["gemm"]
    assert [unit_kind(u) for u in alone] == ["gemm", "data_movement"]          # rmsnorm+linear, rope_kv_write


def test_decode_attention_merges_into_the_o_projection():
    """The split stage and the O GEMM whose prologue is the merge: 2 launches for attention and O, not 3."""
    from test_triton_merge_gemm import attention_o_graph

    graph = attention_o_graph("f32")
    assert ops(kernel_units(graph)) == ["paged_decode_attention", "linear+add"]
    units = triton_units(graph)
    assert ops(units) == ["paged_decode_attention+linear+add"]
    lowering = lower({graph.name: graph})
    assert lowering.launches(graph.name) == [2] and sum(unit_launches(u) for u in kernel_units(graph)) == 3
    source = lowering.modules[lowering.plan[graph.name][0]]
    assert ("merge_linear_triton(paged_decode_attention_parts(in0, in1, in2, in3, 1, 0.125), in4, None, in5, "
            "activation='none', gated=False, config=config_for(in0.shape[0]))") in source
    assert "paged_decode_attention" in ops(cpu_units(graph))             # the CPU target keeps its own cut


@pytest.mark.parametrize("why,edit", [
    ("the attention output is a result too", lambda t: t.replace("return %2", "return %2, %0")),
    ("another op reads the attention output", lambda t: t.replace("return %2", "%3 = linear(%0, %w.o) : f32[S,40]\n"
                                                                 "    return %2, %3")),
    ("a quantized O projection", lambda t: t.replace("%w.o = weight() : f32[40,480]", "%w.o.codes = weight() : "
                                                     "i8[40,480]\n    %w.o.scales = weight() : f16[40,1]")
     .replace("linear(%0, %w.o)", "qlinear(%0, %w.o.codes, %w.o.scales, bits=8, group_size=480)")),
    ("a head_dim that is not a multiple of 16", lambda t: t.replace("480", "432").replace(",80]", ",72]")
     .replace("head_dim=80", "head_dim=72")),
])
def test_an_o_projection_the_merge_cannot_join_leaves_the_merge_stage_alone(why, edit):
    from test_triton_merge_gemm import ATTENTION_O

    body = edit(ATTENTION_O.replace("{dt}", "f32").replace("{width}", "480").replace("{head_dim}", "80"))
    graph = grouped(body)
    assert ops(triton_units(graph))[0] == "paged_decode_attention", why
    assert ops(triton_units(graph)) == ops(kernel_units(graph)), why
