"""The native GEMMs over panels (kernels/cpu/panel_gemm.cpp, qpanel_gemm.cpp via kernels/gemv.py)
against their refs, and the seam that prepares GEMM weights once (kernels/native_ops.py's
prepare_weights).

Every weight format (f32, bf16, int8 per channel and per 16/32, int4 per 32/64/128) at T = 1, 3, 8,
37 and 131 (tiles with a remainder; two token blocks), odd N, K not a power of two (and for float
weights K not a multiple of 16, and odd for f32), f32 and bf16 x, with and without bias. The refs
themselves against float64 math on the dequantized weight.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from llmc.compiler.ir import parse_graph
from llmc.compiler.ops import verify
from llmc.kernels.gemv import GemvWeight, gemv_cpu, gemv_ref, prepare_linear_weight, prepare_qlinear_weight
from llmc.kernels.native import load_native_kernels
from llmc.kernels.native_ops import native_op_impls, prepare_weights
from llmc.kernels.panels import PANEL, from_panels, panel_rows, quantized_rows
from llmc.kernels.quant import dequantize_weight, pack_int4, quantize_int4, quantize_int8
from llmc.runtime.artifact import load_artifact
from llmc.runtime.torch_backend import TorchProgram
from llmc.runtime.weight_arena import HUGE_PAGE, PAGE
from tolerances import tolerance

TOKENS = [1, 3, 8, 37, 131]
XDTYPES = [torch.float32, torch.bfloat16]
# (format, N, K, G): odd N, K not a power of two, every group size the formats take
QUANT_CASES = [("int8", 97, 576, 576), ("int8", 33, 96, 32), ("int8", 5, 48, 16), ("int4", 97, 576, 32),
               ("int4", 33, 192, 64), ("int4", 31, 384, 128)]
FLOAT_SHAPES = [(97, 576), (33, 72), (5, 8), (40, 9)]  # K = 72, 8, 9: no 16-lane step; 9: odd (f32 only)


@pytest.fixture(scope="module", autouse=True)
def native():
    load_native_kernels()


def quantized(fmt: str, n: int, k: int, group: int, seed: int) -> GemvWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    if fmt == "int8":
        return prepare_qlinear_weight(*quantize_int8(w, group), None, bits=8, group_size=group)
    return prepare_qlinear_weight(*quantize_int4(w, group), bits=4, group_size=group)


def exact(x: torch.Tensor, w: GemvWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T + bias in float64 on the dequantized weight."""
    if w.bits:
        rows = quantized_rows(w.weight, w.scales, w.mins, torch.arange(w.rows), w.bits)
        wd = dequantize_weight(*rows, w.bits, torch.float64)
    else:
        wd = from_panels(w.weight, w.rows).double()
    return F.linear(x.double(), wd, None if bias is None else bias.double())


def assert_matches(got: torch.Tensor, want: torch.Tensor, best: torch.Tensor, k: int) -> None:
    """f32: `got` equals the ref `want` within the tolerance for a length-k reduction. bf16, where
    the two round at different points: `got` is as close to the float64 result `best` as the ref
    is, within a factor 2 and one bf16 ulp of the largest value."""
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = best.abs().max().item()
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, **tolerance(torch.float32, k, scale))
        return
    err_got, err_ref = ((t.double() - best).abs().max().item() for t in (got, want))
    assert err_got <= 2 * err_ref + 2.0**-8 * scale, (err_got, err_ref)


def inputs(t: int, w: GemvWeight, dtype: torch.dtype, with_bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, w.in_features, generator=g).to(dtype)
    bias = torch.randn(w.out_features, generator=g).to(dtype) if with_bias else None
    return x, bias


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("dtype", XDTYPES)
@pytest.mark.parametrize("n,k", FLOAT_SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_float_gemv_matches_ref(tokens, dtype, n, k, with_bias):
    weight = (torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 0.05).to(dtype)
    w = prepare_linear_weight(weight)
    if dtype == torch.bfloat16 and k % 2:
        assert w is None                                   # bf16 panels pair the inputs: odd K runs the ref
        return
    assert w.weight.shape[0] == -(-n // PANEL) and torch.equal(from_panels(w.weight, n), weight)
    x, bias = inputs(tokens, w, dtype, with_bias, seed=tokens)
    got = gemv_cpu(x, w, bias)       # first: its output must not reuse a freed result of the same values
    want, best = gemv_ref(x, w, bias), exact(x, w, bias)
    torch.testing.assert_close(want, F.linear(x, weight, bias), rtol=0, atol=0)   # the ref is F.linear
    assert_matches(got, want, best, k)


def test_panels_give_back_any_row():
    weight = torch.randn(70, 10).to(torch.bfloat16)
    w = prepare_linear_weight(weight)
    ids = torch.tensor([[0, 69], [31, 32]])
    torch.testing.assert_close(panel_rows(w.weight, ids), weight[ids], rtol=0, atol=0)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("dtype", XDTYPES)
@pytest.mark.parametrize("fmt,n,k,group", QUANT_CASES)
def test_quantized_gemv_matches_ref(tokens, dtype, fmt, n, k, group):
    w = quantized(fmt, n, k, group, seed=k + group)
    x, bias = inputs(tokens, w, dtype, with_bias=tokens % 2 == 1, seed=tokens)
    assert_matches(gemv_cpu(x, w, bias), gemv_ref(x, w, bias), exact(x, w, bias), k)


@pytest.mark.parametrize("fmt,n,k,group", QUANT_CASES)
def test_quantized_ref_is_float64_math_on_the_dequantized_weight(fmt, n, k, group):
    w = quantized(fmt, n, k, group, seed=1)
    x, bias = inputs(5, w, torch.float32, with_bias=True, seed=2)
    best = exact(x, w, bias)
    torch.testing.assert_close(gemv_ref(x, w, bias).double(), best, **tolerance(torch.float32, k, best.abs().max()))


def test_dequantization_reads_each_nibble_and_group():
    """Every input alone, through both int4 paths, gives its dequantized weight exactly: a swapped
    nibble or an off-by-one group changes the result."""
    n, k, group = 3, 128, 32
    codes = torch.arange(n * k).remainder(16).to(torch.uint8).view(n, k)
    scales = torch.arange(1, n * k // group + 1, dtype=torch.float16).view(n, k // group) / 8
    mins = -scales * 3
    w = prepare_qlinear_weight(pack_int4(codes), scales, mins, bits=4, group_size=group)
    want = (codes.float() * scales.float().repeat_interleave(group, 1) + mins.float().repeat_interleave(group, 1))
    for rows in (4, 8):                  # x rows picking single inputs, 4 (nibble order) or 8 at a time
        for first in range(0, k, rows):
            x = torch.eye(k)[first:first + rows]
            torch.testing.assert_close(gemv_cpu(x, w), want[:, first:first + rows].T.contiguous(), rtol=0, atol=0)


def test_launcher_names_what_does_not_fit():
    w = quantized("int4", 8, 64, 32, seed=0)
    with pytest.raises(ValueError, match="float16"):
        gemv_cpu(torch.zeros(2, 64, dtype=torch.float16), w)
    with pytest.raises(ValueError, match=r"\(2, 63\)"):
        gemv_cpu(torch.zeros(2, 63), w)
    with pytest.raises(ValueError, match="bias"):
        gemv_cpu(torch.zeros(2, 64), w, torch.zeros(8, dtype=torch.bfloat16))
    f32 = prepare_linear_weight(torch.zeros(8, 64))
    with pytest.raises(ValueError, match="bfloat16"):
        gemv_cpu(torch.zeros(2, 64, dtype=torch.bfloat16), f32)
    assert prepare_qlinear_weight(*quantize_int8(torch.randn(4, 24), 24), None, bits=8, group_size=24) is None


# ------------------------------------------------------------------ the prepared-weights seam

# A tied int4 embedding / LM head, an int8 GEMM with bias, a float GEMM: N = 97 odd, K = 96.
GRAPH = """graph tiny {
  %ids = input() : i64[T]
  %w.emb.codes = weight() : u4x2[97,48]
  %w.emb.scales = weight() : f16[97,3]
  %w.emb.mins = weight() : f16[97,3]
  %w.up.codes = weight() : i8[160,96]
  %w.up.scales = weight() : f16[160,1]
  %w.up.bias = weight() : f32[160]
  %w.down = weight() : f32[96,160]
  %0 = qembedding(%w.emb.codes, %w.emb.scales, %w.emb.mins, %ids, bits=4, group_size=32, dtype="f32") : f32[T,96]
  %1 = qlinear(%0, %w.up.codes, %w.up.scales, %w.up.bias, bits=8, group_size=96) : f32[T,160]
  %2 = linear(%1, %w.down) : f32[T,96]
  %3 = qlinear(%2, %w.emb.codes, %w.emb.scales, %w.emb.mins, bits=4, group_size=32) : f32[T,97]
  return %3
}"""


def tiny_graph_weights():
    g = torch.Generator().manual_seed(0)
    emb = quantize_int4(torch.randn(97, 96, generator=g), 32)
    up = quantize_int8(torch.randn(160, 96, generator=g) * 0.1)
    return {"emb.codes": emb[0], "emb.scales": emb[1], "emb.mins": emb[2], "up.codes": up[0], "up.scales": up[1],
            "up.bias": torch.randn(160, generator=g), "down": torch.randn(96, 160, generator=g) * 0.1}


@pytest.mark.parametrize("tokens", [1, 5, 15, 132])
def test_native_program_on_prepared_weights_gives_the_ref_logits(tokens):
    graph = parse_graph(GRAPH)
    verify(graph)
    weights = tiny_graph_weights()
    prepared = prepare_weights([graph], weights)
    assert isinstance(prepared["emb.codes"], GemvWeight) and isinstance(prepared["up.codes"], GemvWeight)
    assert isinstance(prepared["down"], GemvWeight) and prepared["up.scales"] is prepared["up.codes"]
    feeds = {"ids": torch.randint(0, 97, (tokens,), generator=torch.Generator().manual_seed(tokens))}
    with torch.inference_mode(), torch.profiler.profile() as prof:
        (got,) = TorchProgram(graph, prepared, native_op_impls())(feeds)
    (want,) = TorchProgram(graph, weights)(feeds)
    torch.testing.assert_close(got, want, **tolerance(torch.float32, 160, want.abs().max().item()))
    ran = {e.name for e in prof.events()}
    assert {"llmc::qpanel_gemm", "llmc::panel_gemm"} <= ran              # the panels at every T
    assert not {"mkldnn::_linear_pointwise", "aten::linear"} & ran


def test_an_unprepared_weight_runs_the_ref():
    """The native table given the plain weights (nothing prepared) still computes the graph."""
    graph, weights = parse_graph(GRAPH), tiny_graph_weights()
    feeds = {"ids": torch.arange(7)}
    with torch.inference_mode():
        (got,) = TorchProgram(graph, weights, native_op_impls())(feeds)
        (want,) = TorchProgram(graph, weights)(feeds)
    torch.testing.assert_close(got, want)


def storages(values) -> dict[int, int]:
    """data_ptr -> bytes of every tensor storage under `values` (tensors or GemvWeights)."""
    found = {}
    for v in values:
        parts = [v.weight, v.scales, v.mins] if isinstance(v, GemvWeight) else [v]
        for t in (p for p in parts if p is not None):
            found[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return found


def tensor_bytes(values) -> dict[int, int]:
    """data_ptr -> bytes of every tensor under `values` (tensors or GemvWeights), each counted once."""
    found = {}
    for v in values:
        parts = [v.weight, v.scales, v.mins] if isinstance(v, GemvWeight) else [v]
        found.update((t.data_ptr(), t.nbytes) for t in parts if t is not None)
    return found


def padding_bytes(prepared) -> int:
    """Bytes of the zero rows that round each prepared weight's N up to a multiple of 32."""
    found = {id(v): v for v in prepared if isinstance(v, GemvWeight)}.values()
    return sum(t.numel() * t.element_size() * (t.shape[0] * PANEL - v.rows) // (t.shape[0] * PANEL)
               for v in found for t in (v.weight, v.scales, v.mins) if t is not None)


@pytest.mark.parametrize("family", ["llama_tied", "quantized"])
def test_prepared_weights_hold_one_copy_of_each_weight(tiny_family, family):
    """GEMM weights (float, and quantized codes with their scales and mins) become panels in their
    place: the prepared weights hold none of the originals, and their bytes plus the zero rows
    that round N up to 32; the tied LM head and the table lookup share one prepared weight; the
    op table keeps no weight of its own after running."""
    if family == "quantized":
        graphs, weights = [parse_graph(GRAPH)], tiny_graph_weights()
    else:
        art = load_artifact(tiny_family(family)[2])
        graphs, weights = list(art.graphs.values()), art.weights
    prepared = prepare_weights(graphs, weights)
    gemm = {n.inputs[1].node[2:] for g in graphs for n in g.nodes if n.op in ("linear", "qlinear")}
    assert gemm and all(isinstance(prepared[name], GemvWeight) for name in gemm)
    replaced = [name for name, v in prepared.items() if isinstance(v, GemvWeight)]
    assert not storages(prepared.values()).keys() & storages(weights[name] for name in replaced).keys()
    assert sum(storages(prepared.values()).values()) == sum(storages(weights.values()).values()) + \
        padding_bytes(prepared.values())
    tables = {n.inputs[0].node[2:] for g in graphs for n in g.nodes if n.op in ("embedding", "qembedding")}
    assert tables & gemm                                           # tied: the LM head is the table

    graph, weights = parse_graph(GRAPH), tiny_graph_weights()
    impls = native_op_impls()
    watch = weakref.ref(weights["up.codes"])
    with torch.inference_mode():
        TorchProgram(graph, prepare_weights([graph], weights), impls)({"ids": torch.arange(3)})
    del weights
    gc.collect()
    assert watch() is None                                         # nothing in the table kept it
    for fn in impls.values():
        cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())]
        assert not any(isinstance(c, (torch.Tensor, GemvWeight)) for c in cells)


def test_an_engine_keeps_one_copy_of_the_weights(tiny_family):
    """An engine that loads its artifact keeps the weights only in its executor (the artifact keeps
    their shapes and dtypes), and still answers as the reference kernels do."""
    from llmc.runtime.engine import Engine, EngineConfig
    from llmc.runtime.sampling_params import SamplingParams

    folder = tiny_family("llama_tied")[2]
    engine = Engine(folder, EngineConfig(backend_options={"kernels": "native"}))
    assert all(w.is_meta for w in engine.artifact.weights.values())
    held = [v for p in engine.runner.executor.programs.values() for v in p.constants]
    stored = sum(w.numel() * w.element_size() for w in engine.artifact.weights.values())
    assert sum(tensor_bytes(held).values()) == stored + padding_bytes(held)
    (arena_bytes,) = storages(held).values()                      # all of them in the one weight arena
    assert arena_bytes <= stored + padding_bytes(held) + PAGE * len(tensor_bytes(held)) + HUGE_PAGE
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    reference = Engine(folder, EngineConfig(backend_options={"kernels": "reference"}))
    assert engine.generate(["a b c"], greedy)[0].token_ids == reference.generate(["a b c"], greedy)[0].token_ids
