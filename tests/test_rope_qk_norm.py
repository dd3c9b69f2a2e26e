"""rope_kv_write with q/k RMSNorm before the rotation (Qwen3, Gemma 3: per head; OLMo-2: the whole
row): the native CPU kernel against the op record's reference, and the step plan's instruction
equal to the op-by-op native table bit for bit. Grouped queries (H=4, KVH=2), head_dim 64, 128
and 256, f32 and bf16, float and int8 caches, packed and separate q/k/v. eps is large (0.05)
and the rows small, so a dropped eps or a norm over the wrong span fails every check."""

from __future__ import annotations

import pytest
import torch

from llmc.compiler.ir import parse_graph
from llmc.compiler.ops import OPS, bind
from llmc.kernels.native import load_native_kernels
from llmc.kernels.native_ops import native_op_impls
from llmc.kernels.quant import dequantize_kv_rows
from llmc.kernels.rope import RopeTables
from llmc.kernels.rope_kv_write import rope_kv_write_cpu, rope_kv_write_ref
from llmc.runtime.step_plan import lower_step_plan
from tolerances import assert_as_close_as_ref, tolerance

HEADS, KV_HEADS, BS, EPS_NORM = 4, 2, 16, 0.05
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(scope="module", autouse=True)
def native():
    load_native_kernels()


def norm_weights(kind: str, d: int, dtype: torch.dtype, g: torch.Generator) -> list[torch.Tensor]:
    widths = (d, d) if kind == "head" else (HEADS * d, KV_HEADS * d)
    return [(torch.rand(w, generator=g) + 0.5).to(dtype) for w in widths]


def inputs(kind: str, d: int, dtype: torch.dtype, t: int, seed: int):
    """(qkv [T, (H + 2 KVH) D], positions, slots with one padding slot, [q_norm, k_norm])."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (HEADS + 2 * KV_HEADS) * d, generator=g) * 0.3).to(dtype)   # mean square ~ eps
    positions = torch.randint(0, 3000, (t,), generator=g)
    slots = torch.randperm(4 * BS, generator=g)[:t]
    slots[t // 2] = -1
    return qkv, positions, slots, norm_weights(kind, d, dtype, g)


def caches(d: int, dtype: torch.dtype, n: int) -> list[torch.Tensor]:
    width = d + 4 if dtype == torch.int8 else d
    return [torch.zeros(2, 2, 4, KV_HEADS, BS, width, dtype=dtype) for _ in range(n)]


def split(qkv: torch.Tensor, d: int) -> list[torch.Tensor]:
    return [x.contiguous() for x in qkv.split([HEADS * d, KV_HEADS * d, KV_HEADS * d], -1)]


def attrs(d: int, kind: str) -> dict:
    return dict(layer=1, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=d, qk_norm=kind, norm_eps=EPS_NORM)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "separate"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["head", "all"])
def test_native_norm_and_rope_match_the_reference(kind, dtype, d, packed):
    dtype = DTYPES[dtype]
    qkv, positions, slots, norms = inputs(kind, d, dtype, 13, seed=d)
    parts = [qkv] if packed else split(qkv, d)
    got, want, exact = caches(d, dtype, 2) + caches(d, torch.float64, 1)
    q_got, _ = rope_kv_write_cpu(*parts, positions, got, slots, *norms, **attrs(d, kind),
                                 tables=RopeTables(d, 1e4, None))
    q_want, _ = rope_kv_write_ref(*parts, positions, want, slots, *norms, **attrs(d, kind), theta=1e4, scaling=None)
    q_exact, _ = rope_kv_write_ref(*[x.double() for x in (*parts, positions, exact, slots, *norms)], **attrs(d, kind),
                                   theta=1e4, scaling=None)
    if dtype == torch.float32:      # one rounding apart: the norm's sum and the rotation in another order
        torch.testing.assert_close(q_got, q_want, **tolerance(dtype, d))
        torch.testing.assert_close(got, want, **tolerance(dtype, d))
    else:
        assert_as_close_as_ref(q_got, q_want, q_exact, dtype)
        assert_as_close_as_ref(got, want, exact, dtype)
    assert got[1, 1].eq(want[1, 1]).all()                                # v stored as it came


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["head", "all"])
def test_native_norm_into_an_int8_cache(kind, dtype):
    """k is normed, rotated in fp32 and quantized; the ref rounds the rotation to k's dtype first:
    codes within 1 of the ref's (as tests/test_native_int8_kv.py allows), and for f32 the
    dequantized rows are the float64 normed rotation within half a code step."""
    dtype, d = DTYPES[dtype], 64
    qkv, positions, slots, norms = inputs(kind, d, dtype, 9, seed=3)
    (got, want), (exact,) = caches(d, torch.int8, 2), caches(d, torch.float64, 1)
    q_got, _ = rope_kv_write_cpu(qkv, positions, got, slots, *norms, **attrs(d, kind), tables=RopeTables(d, 1e4, None))
    q_want, _ = rope_kv_write_ref(qkv, positions, want, slots, *norms, **attrs(d, kind), theta=1e4, scaling=None)
    q_exact, _ = rope_kv_write_ref(*[x.double() for x in (qkv, positions, exact, slots, *norms)], **attrs(d, kind),
                                   theta=1e4, scaling=None)
    f32 = dtype == torch.float32
    if f32:
        torch.testing.assert_close(q_got, q_want, **tolerance(dtype, d))
    else:
        assert_as_close_as_ref(q_got, q_want, q_exact, dtype)
    valid = slots[slots >= 0]
    rows, ref_rows = (c[1, 0][valid // BS, :, valid % BS] for c in (got, want))     # [n, KVH, D + 4]
    code_diff = (rows[..., :-4].int() - ref_rows[..., :-4].int()).abs()
    assert code_diff.max() <= 1 and code_diff.float().mean() < (0.01 if f32 else 0.25)
    assert torch.equal(got[1, 1], want[1, 1])                             # v: the same codes
    if f32:
        k = exact[1, 0][valid // BS, :, valid % BS]                        # [n, KVH, D]
        scale = rows[..., -4:].contiguous().view(torch.float32).double()
        err = (dequantize_kv_rows(rows).double() - k).abs()
        assert (scale > 0).all() and (err <= scale * (0.5 + 1e-4)).all()


def plan_graph(kind: str, d: int, dtype: str, int8_cache: bool = False) -> str:
    width, q_width = (HEADS + 2 * KV_HEADS) * d, HEADS * d
    q_norm, k_norm = (d, d) if kind == "head" else (HEADS * d, KV_HEADS * d)
    cache = f"i8[2,2,4,{KV_HEADS},16,{d + 4}]" if int8_cache else f"{dtype}[2,2,4,{KV_HEADS},16,{d}]"
    return f"""
graph prefill {{
  %qkv = input() : {dtype}[T,{width}]
  %positions = input() : i64[T]
  %kv_cache = input() : {cache}
  %slot_mapping = input() : i64[T]
  %w.q_norm = weight() : {dtype}[{q_norm}]
  %w.k_norm = weight() : {dtype}[{k_norm}]
  %0 = rope_kv_write(%qkv, %positions, %kv_cache, %slot_mapping, %w.q_norm, %w.k_norm, layer=1, num_heads={HEADS}, \
num_kv_heads={KV_HEADS}, head_dim={d}, theta=10000.0, scaling=None, qk_norm='{kind}', norm_eps={EPS_NORM}) : \
{dtype}[T,{q_width}], {cache}
  return %0
}}
"""


@pytest.mark.parametrize("cache", ["float", "int8"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["head", "all"])
def test_step_plan_equals_the_native_table_bit_for_bit(kind, dtype, d, cache):
    graph = parse_graph(plan_graph(kind, d, dtype, int8_cache=cache == "int8"))
    qkv, positions, slots, norms = inputs(kind, d, DTYPES[dtype], 11, seed=7)
    plan = lower_step_plan(graph, {"q_norm": norms[0], "k_norm": norms[1]}, BS)
    plan_cache, table_cache = caches(d, torch.int8 if cache == "int8" else DTYPES[dtype], 2)
    (q_plan,) = plan({"qkv": qkv, "positions": positions, "kv_cache": plan_cache, "slot_mapping": slots})
    node = next(n for n in graph.nodes if n.op == "rope_kv_write")
    x = bind(OPS["rope_kv_write"], [qkv, positions, table_cache, slots, *norms], node.attrs)
    q_table, _ = native_op_impls()["rope_kv_write"](x, node.attrs)
    assert torch.equal(q_plan, q_table) and torch.equal(plan_cache, table_cache)
    assert plan_cache.float().abs().sum() > 0
