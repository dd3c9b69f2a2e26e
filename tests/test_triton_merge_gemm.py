"""Decode attention's merge as the O projection's prologue (kernels/triton/gemm.py
`merge_linear_triton` on paged_decode_attention_parts' workspace) against the torch ref of the same
workspace (`merge_linear_ref`: stage 2's arithmetic, rounded to the dtype, then the GEMM), against
the unfused Triton path (split + merge + GEMM) and against float64 arithmetic.

Both paths round the merged attention output to the dtype before the dot, at the same point, but
they sum the splits in another order, so in fp16 an element may round one unit apart: the claim is
tolerances.assert_as_close_as_ref's (as close to exact as the ref is: twice its error plus a
rounding). In fp32 they agree within fp32's reduction tolerance over K. Caches are poisoned as in
test_triton_attention.py; outputs are NaN until written (deterministic mode's empty). Interpreter:
fp32 and fp16 (its bf16 dot is wrong).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmc.kernels.attention import paged_decode_attention_ref
from llmc.kernels.triton.gemm import linear_triton, merge_linear_ref, merge_linear_triton
from llmc.kernels.triton.paged_decode_attention import (DecodeParts, decode_merge_ref, decode_splits,
                                                        paged_decode_attention_parts, paged_decode_attention_triton)
from test_triton_attention import DEVICE, LAYER, poisoned_cache, random_queries
from tolerances import assert_as_close_as_ref, tolerance

N = 40                                        # the O projection's output width (a model's hidden size)
# (H, KVH, D): SmolLM2-135M's heads, and a head_dim that is not a power of two (K tiles of 16)
HEAD_SHAPES = [(9, 3, 64), (6, 2, 80)]
# T = 1 over several splits; odd S with an empty sequence (seq_len 0) and several splits
LENS = {"T=1": [300], "odd S with an empty one": [1, 32, 37, 0, 300]}


@pytest.fixture(autouse=True)
def poisoned_empty():
    """torch.empty fills NaN: an element the kernel never writes fails."""
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def attention_inputs(lens, heads, kv_heads, head_dim, dtype, seed=0, q_scale=1.0):
    cache, tables = poisoned_cache(lens, kv_heads, head_dim, dtype, 16, seed)
    q = (random_queries(len(lens), heads * head_dim, torch.float32, seed + 1) * q_scale).to(dtype)
    return q, cache, tables, torch.tensor(lens, dtype=torch.int32, device=DEVICE), head_dim ** -0.5


def projection(K, dtype, seed=2, residual_rows=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype).to(DEVICE)            # |y| ~ |attention|
    res = torch.randn(residual_rows, N, generator=g).to(dtype).to(DEVICE) if residual_rows else None
    return w, res


def exact_projection(q, cache, tables, seq_lens, scale, head_dim, w, res):
    """Attention then the projection in float64 from the same inputs (an empty sequence's row: zeros)."""
    live = seq_lens > 0
    attn = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    attn[live] = paged_decode_attention_ref(q[live].double(), cache.nan_to_num(0.0).double(), tables[live],
                                            seq_lens[live], LAYER, head_dim, scale)
    y = F.linear(attn, w.double())
    return y if res is None else y + res.double()


def exact_merge(parts: DecodeParts) -> torch.Tensor:
    """decode_merge_ref's meaning in float64, not rounded: the exact A operand."""
    return decode_merge_ref(DecodeParts(parts.acc.double(), parts.max.double(), parts.sum.double(),
                                        parts.head_dim, torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", HEAD_SHAPES)
@pytest.mark.parametrize("lens", list(LENS))
def test_merge_prologue_matches_the_ref_and_the_unfused_path(dtype, heads, kv_heads, head_dim, lens):
    lens = LENS[lens]
    assert decode_splits(len(lens), kv_heads, 320)[0] > 1
    q, cache, tables, seq_lens, scale = attention_inputs(lens, heads, kv_heads, head_dim, dtype, seed=head_dim)
    w, res = projection(heads * head_dim, dtype, residual_rows=len(lens))
    parts = paged_decode_attention_parts(q, cache, tables, seq_lens, LAYER, scale)
    assert isinstance(parts, DecodeParts)
    got = merge_linear_triton(parts, w, None, res)
    want = merge_linear_ref(parts, w, None, res)
    unfused = linear_triton(paged_decode_attention_triton(q, cache, tables, seq_lens, LAYER, scale), w, None, res)
    assert not got.isnan().any()
    K = heads * head_dim
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **tolerance(torch.float32, K))
        torch.testing.assert_close(got, unfused, **tolerance(torch.float32, K))
    else:
        exact_ws = F.linear(exact_merge(parts), w.double()) + res.double()
        assert_as_close_as_ref(got, want, exact_ws, dtype)
        assert_as_close_as_ref(got, unfused, exact_projection(q, cache, tables, seq_lens, scale, head_dim, w, res),
                               dtype)
    if 0 in lens:
        empty = lens.index(0)
        assert torch.equal(got[empty], res[empty])                     # zeros @ w + residual


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_split_writes_the_output_and_the_gemm_takes_no_prologue(dtype):
    """A short block table: decode_splits gives one split, stage 1 writes the output (SINGLE)."""
    lens = [20, 5, 0]
    assert decode_splits(len(lens), 2, 32)[0] == 1
    q, cache, tables, seq_lens, scale = attention_inputs(lens, 6, 2, 80, dtype)
    w, _ = projection(480, dtype)
    attn = paged_decode_attention_parts(q, cache, tables, seq_lens, LAYER, scale)
    assert isinstance(attn, torch.Tensor)
    got = merge_linear_triton(attn, w)
    unfused = linear_triton(paged_decode_attention_triton(q, cache, tables, seq_lens, LAYER, scale), w)
    assert torch.equal(got, unfused) and got[2].eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_splits_whose_maxima_lie_far_apart(dtype):
    """Queries 100 times larger: the splits' max scores differ by hundreds (log2 domain), so a merge
    that rescales by another split's max than the largest overflows exp2 (fp32's ends at 2^128)."""
    q, cache, tables, seq_lens, scale = attention_inputs([300], 9, 3, 64, dtype, seed=5, q_scale=100.0)
    parts = paged_decode_attention_parts(q, cache, tables, seq_lens, LAYER, scale)
    spread = (parts.max.amax(-1) - parts.max.amin(-1)).max().item()
    assert spread > 128, spread
    w, _ = projection(576, dtype)
    got = merge_linear_triton(parts, w)
    assert got.isfinite().all()
    torch.testing.assert_close(got.float(), merge_linear_ref(parts, w).float(), **tolerance(dtype, 576))


def test_the_merge_ref_is_stage_two():
    """decode_merge_ref (the prologue's reference) gives stage 2's output on the same workspace."""
    q, cache, tables, seq_lens, scale = attention_inputs(LENS["odd S with an empty one"], 6, 2, 80, torch.float32)
    parts = paged_decode_attention_parts(q, cache, tables, seq_lens, LAYER, scale)
    stage2 = paged_decode_attention_triton(q, cache, tables, seq_lens, LAYER, scale)
    torch.testing.assert_close(decode_merge_ref(parts), stage2, **tolerance(torch.float32, parts.acc.shape[2]))
    assert decode_merge_ref(parts)[3].eq(0).all()


def test_launcher_refuses_a_head_dim_without_a_k_tile():
    parts = DecodeParts(torch.zeros(2, 3, 4, 128), torch.zeros(2, 3, 4), torch.ones(2, 3, 4), 72, torch.float32)
    with pytest.raises(ValueError, match="head_dim that is a multiple of 16; got 72"):
        merge_linear_triton(parts, torch.zeros(8, 216))
    with pytest.raises(ValueError, match="takes w \\[N, 3 heads x 72\\]"):
        merge_linear_triton(parts, torch.zeros(8, 200))


# decode attention, then its O projection with a residual epilogue (units.py triton_units merges them)
ATTENTION_O = """
    %q = input() : {dt}[S,{width}]
    %kv_cache = input() : {dt}[2,2,NB,2,BS,{head_dim}]
    %block_tables = input() : i32[S,MB]
    %seq_lens = input() : i32[S]
    %r = input() : {dt}[S,40]
    %w.o = weight() : {dt}[40,{width}]
    %0 = paged_decode_attention(%q, %kv_cache, %block_tables, %seq_lens, layer=1, num_heads=6, num_kv_heads=2, \
head_dim={head_dim}, scale=0.125) : {dt}[S,{width}]
    %1 = linear(%0, %w.o) : {dt}[S,40]
    %2 = add(%1, %r) : {dt}[S,40]
    return %2"""


def attention_o_graph(dtype: str, head_dim: int = 80):
    from test_codegen_triton_units import grouped

    return grouped(ATTENTION_O, dt=dtype, width=6 * head_dim, head_dim=head_dim)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("lens", [[300], [1, 32, 37, 300, 45]], ids=["T=1", "odd S"])
def test_the_generated_module_equals_the_interpreted_graph(dtype, lens, tmp_path):
    """The codegen's merged unit (split stage + the O GEMM with the merge prologue) against the torch
    backend's graph (whose attention gives NaN for a seq_len 0 row: no padding row here); f16 as
    close to the f32 graph as the interpreted f16 graph is."""
    from llmc.compiler.codegen import lower
    from test_codegen_kernels import assert_generated_equals_interpreted

    graph = attention_o_graph(dtype)
    units = lower({graph.name: graph}).units[graph.name]
    assert ["+".join(n.op for n in u.nodes) for u in units] == ["paged_decode_attention+linear+add"]
    t = {"f32": torch.float32, "f16": torch.float16}[dtype]
    q, cache, tables, seq_lens, _ = attention_inputs(lens, 6, 2, 80, t)
    w, res = projection(480, t, residual_rows=len(lens))
    feeds = dict(q=q, kv_cache=cache.nan_to_num(0.0), block_tables=tables, seq_lens=seq_lens, r=res)
    assert_generated_equals_interpreted(graph, {"o": w}, feeds, tmp_path,
                                        attention_o_graph("f32") if dtype == "f16" else None, reduction=480)


def test_a_whole_model_merges_in_every_decode_layer_as_the_torch_executor_computes(tiny_family, tmp_path,
                                                                                   monkeypatch):
    """test_triton_executor's run of a tiny Llama (head_dim 32) with splits of 16 keys: its 48-key
    block tables take two splits (the short sequences' second one empty), so each decode layer's O
    projection merges as its prologue; its logits stay the torch executor's within fp32 tolerance."""
    import llmc.kernels.triton.gemm as gemm
    import llmc.kernels.triton.paged_decode_attention as decode
    from llmc.compiler.driver import CompileConfig, compile_model
    from llmc.runtime.artifact import load_artifact
    from test_triton_executor import run_backend

    artifact = compile_model(tiny_family("llama_hd32")[1], tmp_path / "cuda", CompileConfig(target="cuda"))
    monkeypatch.setattr(decode, "MIN_SPLIT_KEYS", 16)
    merged, launch = [], gemm.linear_triton
    monkeypatch.setattr(gemm, "linear_triton", lambda *a, merge=None, **k: merged.append(merge is not None)
                        or launch(*a, merge=merge, **k))
    want, got = run_backend(artifact, "torch"), run_backend(artifact, "triton")
    layers = load_artifact(artifact).config.num_layers
    assert sum(merged) == 8 * layers                                   # 8 decode steps, every layer
    tol = tolerance(torch.float32, load_artifact(artifact).config.intermediate_size, scale=4.0)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert not g.isnan().any(), f"step {step}"
        torch.testing.assert_close(g, w, **tol, msg=lambda m: f"step {step}: {m}")
