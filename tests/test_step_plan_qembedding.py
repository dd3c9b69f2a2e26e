"""The step plan's quantized row gather (instruction `qembedding`, kernels/cpu/step_plan.h's
qembed_rows) against `qembedding_ref` bit for bit: scale * code (+ min) is exact in fp32, so the
plan's rows are the ref's. Both layouts: the artifact's rows (an untied table, int8 and int4 in
GGUF's block order), the quantized panels of a tied LM head (test_gemv_kernels' tiny graph: int4,
N = 97 odd) and its quads (int8 activations: built here from kernels/panels.py's description, an
independent reading of it); f32 and bf16 rows; ids at both ends of the table; a bad id refused."""

from __future__ import annotations

import pytest
import torch

from llmc.compiler.ir import parse_graph
from llmc.compiler.ops.gathers import qembedding_ref
from llmc.compiler.quant_format import quantize_int4, quantize_int8
from llmc.kernels.gemv import GemvWeight
from llmc.kernels.native import load_native_kernels
from llmc.kernels.native_ops import native_op_impls, prepare_weights
from llmc.kernels.panels import column_panels
from llmc.kernels.quant import unpack_int4
from llmc.runtime.step_plan import StepPlanProgram, lower_step_plan
from llmc.runtime.torch_backend import TorchProgram
from test_gemv_kernels import GRAPH, tiny_graph_weights

VOCAB, WIDTH = 70, 96


def table_graph(bits: int, group: int, dtype: str) -> str:
    """A graph that only gathers rows of a [70, 96] quantized table (not prepared: the artifact's rows)."""
    codes = f"u4x2[{VOCAB},{WIDTH // 2}]" if bits == 4 else f"i8[{VOCAB},{WIDTH}]"
    mins = f"  %w.e.mins = weight() : f16[{VOCAB},{WIDTH // group}]\n" if bits == 4 else ""
    return f"""graph table {{
  %ids = input() : i64[T]
  %w.e.codes = weight() : {codes}
  %w.e.scales = weight() : f16[{VOCAB},{WIDTH // group}]
{mins}  %0 = qembedding(%w.e.codes, %w.e.scales, {'%w.e.mins, ' if bits == 4 else ''}%ids, bits={bits}, \
group_size={group}, dtype="{dtype}") : {dtype}[T,{WIDTH}]
  return %0
}}"""


def table_weights(bits: int, group: int) -> dict[str, torch.Tensor]:
    w = torch.randn(VOCAB, WIDTH, generator=torch.Generator().manual_seed(bits + group))
    parts = quantize_int4(w, group) if bits == 4 else quantize_int8(w, group)
    return dict(zip(("e.codes", "e.scales", "e.mins"), parts))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("bits,group", [(8, 96), (8, 32), (4, 32), (4, 96)])
def test_plan_gathers_the_artifacts_rows_as_the_ref(bits, group, dtype):
    load_native_kernels()
    graph, weights = parse_graph(table_graph(bits, group, dtype)), table_weights(bits, group)
    program = lower_step_plan(graph, weights, 16)
    assert isinstance(program, StepPlanProgram)
    ids = torch.tensor([0, VOCAB - 1, 5, 33, 5, 64, 31])
    torch_dtype = torch.float32 if dtype == "f32" else torch.bfloat16
    want = qembedding_ref(weights["e.codes"], weights["e.scales"], weights.get("e.mins"), ids, bits=bits,
                          dtype=torch_dtype)
    (got,) = program({"ids": ids})
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match=f"token id {VOCAB} is outside the vocabulary of {VOCAB}"):
        program({"ids": torch.tensor([VOCAB])})


@pytest.mark.parametrize("tokens", [1, 6])
def test_plan_gathers_a_tied_tables_panels_as_the_op_by_op_kernels(tokens):
    """test_gemv_kernels' graph (an int4 table tied to its LM head, an int8 and a float GEMM): the
    plan's logits equal the native ops' bit for bit, its gather reads the LM head's panels, and the
    LM head picks each row's greedy token beside them."""
    load_native_kernels()
    graph = parse_graph(GRAPH)
    prepared = prepare_weights([graph], tiny_graph_weights())
    assert isinstance(prepared["emb.codes"], GemvWeight)
    program = lower_step_plan(graph, prepared, 16)
    ids = torch.randint(0, 97, (tokens,), generator=torch.Generator().manual_seed(tokens))
    ids[0] = 96                                                  # the last, padded panel
    got, picks = program({"ids": ids})                        # the LM head writes the one output: it picks
    with torch.inference_mode():
        (want,) = TorchProgram(graph, prepared, native_op_impls())({"ids": ids})
    assert torch.equal(got, want) and program.picks and torch.equal(picks, got.argmax(dim=-1))


def quads(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """kernels/panels.py's quads, built from its description: int8 codes + 128 [P, K/4, 32, 4]; int4
    [P, K/8, 32, 4], byte r of quad i holding input 8i + r in the low nibble and 8i + 4 + r in the high."""
    if bits == 8:
        lanes = (codes.to(torch.int16) + 128).to(torch.uint8).view(codes.shape[0], -1, 4)   # [N, K/4, 4]
    else:
        q = unpack_int4(codes).view(codes.shape[0], -1, 2, 4)                              # [N, K/8, 2, 4]
        lanes = q[:, :, 0] | (q[:, :, 1] << 4)                                               # [N, K/8, 4]
    n, per_row, _ = lanes.shape
    padded = torch.cat([lanes, lanes.new_zeros(-n % 32, per_row, 4)])
    return padded.view(-1, 32, per_row, 4).transpose(1, 2).contiguous()                      # [P, K/4|K/8, 32, 4]


@pytest.mark.parametrize("bits,group", [(8, 96), (4, 32)])
def test_plan_gathers_a_tied_tables_quads_as_the_ref(bits, group):
    """A table kept as quads (the LM head's layout with int8 activations) gives the ref's rows."""
    load_native_kernels()
    weights = table_weights(bits, group)
    mins = weights.get("e.mins")
    held = GemvWeight(f"int{bits}", quads(weights["e.codes"], bits), VOCAB, column_panels(weights["e.scales"]),
                      None if mins is None else column_panels(mins), group)
    assert held.weight.shape[1:] == (WIDTH * bits // 32, 32, 4)
    prepared = {"e.codes": held, "e.scales": held, **({"e.mins": held} if bits == 4 else {})}
    program = lower_step_plan(parse_graph(table_graph(bits, group, "f32")), prepared, 16)
    ids = torch.tensor([0, VOCAB - 1, 5, 33, 64, 31])
    (got,) = program({"ids": ids})
    assert torch.equal(got, qembedding_ref(weights["e.codes"], weights["e.scales"], mins, ids, bits=bits,
                                           dtype=torch.float32))
