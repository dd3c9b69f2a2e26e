"""RMSNorm's two roundings (compiler/ops/norms.py, attr `rounding`; rope_kv_write's `norm_rounding`):
"normed" rounds the normed row to x's dtype before the weight (Llama, Qwen3), "product" rounds once
after the fp32 product (Gemma 2/3, OLMo-2). In bf16 they differ by an ulp on about a quarter of the
values, so every check here is in bf16, and each shows the other rounding fails it.

The references equal transformers' norm modules bit for bit; each path follows the attr: the
formula (bit for bit), the generated C++ and Triton kernels (tests/test_cpp_codegen.py's rule: few
elements an ulp apart), the native and Triton rope_kv_write norms (their fp32 rotation of the
reference's normed values: few elements an ulp apart), the step plan (the native table's bits);
the frontend writes the attr from the config and the passes carry it; and a tiny Gemma 3 and
OLMo-2 in bf16 norm their first hidden states exactly as transformers does.
"""

from __future__ import annotations

import math

import pytest
import torch

from llmc.compiler.formula import Row, evaluate
from llmc.compiler.ir import parse_graph
from llmc.compiler.ops import OPS, bind
from llmc.compiler.ops.norms import ROUNDINGS, head_rmsnorm_ref, rmsnorm_ref, rounding_attr
from llmc.compiler.ops.rope import qk_norm_ref
from llmc.kernels.native import load_native_kernels
from llmc.kernels.native_ops import native_op_impls
from llmc.kernels.rope import RopeTables
from llmc.kernels.rope_kv_write import rope_kv_write_cpu, rope_kv_write_ref
from llmc.runtime.step_plan import lower_step_plan
from tolerances import EPS

BF16 = torch.bfloat16
HEADS, KV_HEADS, BS, NORM_EPS = 4, 2, 16, 0.05
OTHER = {"normed": "product", "product": "normed"}


def rows(t: int, w: int, seed: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.randn(t, w, generator=torch.Generator().manual_seed(seed)).to(dtype)


def weight(w: int, seed: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return (torch.rand(w, generator=torch.Generator().manual_seed(seed)) + 0.5).to(dtype)


def assert_rounded_alike(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype = BF16) -> None:
    """Within one ulp of `dtype` everywhere and at most 1% of the elements apart: what one fp32
    rounding of the same math in another order gives; the other rounding puts ~25% apart (bf16)."""
    got, want = got.double(), want.double()
    spacing = torch.maximum(got.abs(), want.abs()).clamp_min(1e-30) * EPS[dtype]
    assert ((got - want).abs() <= spacing).all(), "more than one ulp apart"
    apart = int((got != want).sum())
    assert apart <= math.ceil(0.01 * got.numel()), f"{apart} of {got.numel()} elements differ"


# ---------------------------------------------------------------- the references mean transformers'


def test_the_references_are_transformers_norms_bit_for_bit():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    x, w = rows(13, 100, 0), weight(100, 1)
    gemma, olmo, qwen = Gemma3RMSNorm(100, eps=1e-6), Olmo2RMSNorm(100, eps=1e-6), Qwen3RMSNorm(100, eps=1e-6)
    with torch.no_grad():
        gemma.weight.copy_(w.float() - 1)         # Gemma's multiplier 1 + w, here bf16-exact
        for m in (olmo, qwen):
            m.weight.copy_(w.float())
        want = {"gemma": gemma.to(BF16)(x), "olmo2": olmo.to(BF16)(x), "qwen3": qwen.to(BF16)(x)}
    for family, rounding in (("gemma", "product"), ("olmo2", "product"), ("qwen3", "normed")):
        assert torch.equal(rmsnorm_ref(x, w, 1e-6, rounding), want[family]), family
        assert not torch.equal(rmsnorm_ref(x, w, 1e-6, OTHER[rounding]), want[family]), family
    heads = x[:, :96].reshape(13, 3, 32)          # head_rmsnorm: Gemma 3's q/k norm over each head
    gemma_head = Gemma3RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        gemma_head.weight.copy_(w[:32].float() - 1)
        want_heads = gemma_head.to(BF16)(heads).reshape(13, 96)
    assert torch.equal(head_rmsnorm_ref(x[:, :96], w[:32], 1e-6, 32, "product"), want_heads)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("op", ["rmsnorm", "add_rmsnorm"])
def test_the_formula_is_the_reference_bit_for_bit(op, rounding):
    record, attrs = OPS[op], {"eps": 1e-5, **rounding_attr(rounding)}
    tensors = {"x": rows(9, 72, 2), "residual": rows(9, 72, 3), "weight": weight(72, 4)}
    if op == "rmsnorm":
        del tensors["residual"]
    want = record.reference(bind(record, list(tensors.values()), attrs), attrs)
    want = want if isinstance(want, tuple) else (want,)
    outs = ["bf16"] * len(want)
    row = Row({k: t.shape[-1] for k, t in tensors.items()}, {k: "bf16" for k in tensors}, outs)
    got = evaluate(record.formula(row, attrs), tensors, outs)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    other = {"eps": 1e-5, **rounding_attr(OTHER[rounding])}
    assert not torch.equal(evaluate(record.formula(row, other), tensors, outs)[0], want[0])


def test_the_type_rule_refuses_an_unknown_rounding():
    from llmc.compiler.ir import IRError
    from llmc.compiler.ops import verify
    graph = parse_graph("""graph g {
  %x = input() : bf16[T,72]
  %w.n = weight() : bf16[72]
  %0 = rmsnorm(%x, %w.n, eps=1e-05, rounding='once') : bf16[T,72]
  return %0
}
""")
    with pytest.raises(IRError, match="rounding='once' is not one of"):
        verify(graph)


# ------------------------------------------- generated Triton (the interpreter: f16, its bf16 is not IEEE's)


def norms_graph(rounding: str):
    from test_codegen_kernels import graph_of
    attr = f", rounding='{rounding}'" if rounding != "normed" else ""
    return graph_of("norms", "f16", {"norms": f"""
        %x = input() : {{dt}}[T,72]
        %r = input() : {{dt}}[T,72]
        %w.a = weight() : {{dt}}[72]
        %0 = add_rmsnorm(%x, %r, %w.a, eps=1e-05{attr}) : {{dt}}[T,72], {{dt}}[T,72]
        %1 = rmsnorm(%0#1, %w.a, eps=1e-06{attr}) : {{dt}}[T,72]
        return %0, %1"""})


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_generated_triton_norms_round_as_the_attr_says(rounding, tmp_path):
    from test_codegen_kernels import run_generated
    from llmc.runtime.torch_backend import interpret
    f16 = torch.float16
    feeds, weights = {"x": rows(5, 72, 5, f16), "r": rows(5, 72, 6, f16)}, {"a": weight(72, 7, f16)}
    got, _ = run_generated(norms_graph(rounding), weights, feeds, tmp_path)
    want = interpret(norms_graph(rounding), weights, feeds)
    for g, w in zip(got, want, strict=True):
        assert_rounded_alike(g, w, f16)
    other = interpret(norms_graph(OTHER[rounding]), weights, feeds)
    assert (got[1] != other[1]).float().mean() > 0.05, "the other rounding's norm is as close"


# ---------------------------------------------------------------- rope_kv_write's q/k norms


def norm_case(kind: str, d: int, t: int, seed: int, dtype: torch.dtype = BF16):
    """(qkv, positions, slots with a padding slot, [q_norm, k_norm]), float ones of `dtype`."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (HEADS + 2 * KV_HEADS) * d, generator=g) * 0.3).to(dtype)
    positions, slots = torch.randint(0, 3000, (t,), generator=g), torch.randperm(4 * BS, generator=g)[:t]
    slots[t // 2] = -1
    widths = (d, d) if kind == "head" else (HEADS * d, KV_HEADS * d)
    return qkv, positions, slots, [(torch.rand(w, generator=g) + 0.5).to(dtype) for w in widths]


def rope_attrs(kind: str, d: int, rounding: str) -> dict:
    attrs = dict(layer=1, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=d, qk_norm=kind, norm_eps=NORM_EPS)
    return attrs | ({"norm_rounding": rounding} if rounding != "normed" else {})


def fp32_rotation_of_normed(qkv, positions, slots, norms, kind, d, rounding):
    """(q, cache) as the fused kernels compute them: the reference's norms in qkv's dtype, the fp32
    rotation, one rounding to that dtype."""
    q, k, v = qkv.split([HEADS * d, KV_HEADS * d, KV_HEADS * d], -1)
    q, k = (qk_norm_ref(x, w, kind, NORM_EPS, d, rounding).float() for x, w in zip((q, k), norms))
    cache = torch.zeros(2, 2, 4, KV_HEADS, BS, d)
    q_rot, cache = rope_kv_write_ref(q, k, v.float(), positions, cache, slots, layer=1, num_heads=HEADS,
                                     num_kv_heads=KV_HEADS, head_dim=d, theta=1e4, scaling=None)
    return q_rot.to(qkv.dtype), cache.to(qkv.dtype)


def assert_fused_norms_follow(q_got, cache_got, case, kind, d, rounding):
    q_want, cache_want = fp32_rotation_of_normed(*case, kind, d, rounding)
    assert_rounded_alike(q_got.cpu(), q_want, q_want.dtype)
    assert_rounded_alike(cache_got.cpu()[1, 0], cache_want[1, 0], q_want.dtype)
    q_other, _ = fp32_rotation_of_normed(*case, kind, d, OTHER[rounding])
    assert (q_got.cpu() != q_other).float().mean() > 0.05, "the other rounding's q is as close"


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "separate"])
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("kind", ["head", "all"])
def test_native_rope_kv_write_norms_round_as_the_attr_says(kind, rounding, packed):
    load_native_kernels()
    d = 64
    case = norm_case(kind, d, 13, seed=11)
    qkv, positions, slots, norms = case
    parts = [qkv] if packed else [x.contiguous() for x in qkv.split([HEADS * d, KV_HEADS * d, KV_HEADS * d], -1)]
    cache = torch.zeros(2, 2, 4, KV_HEADS, BS, d, dtype=BF16)
    q_got, _ = rope_kv_write_cpu(*parts, positions, cache, slots, *norms, **rope_attrs(kind, d, rounding),
                                 tables=RopeTables(d, 1e4, None))
    assert_fused_norms_follow(q_got, cache, case, kind, d, rounding)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("kind", ["head", "all"])
def test_triton_rope_kv_write_norms_round_as_the_attr_says(kind, rounding):
    from llmc.kernels.rope import rope_inv_freq
    from llmc.kernels.triton.rope_kv_write import rope_kv_write_triton
    d, f16 = 64, torch.float16            # the interpreter's bf16 is not IEEE's: f16 shows the rounding too
    case = norm_case(kind, d, 7, seed=12, dtype=f16)
    qkv, positions, slots, norms = case
    cache = torch.zeros(2, 2, 4, KV_HEADS, BS, d, dtype=f16)
    attrs = {k: v for k, v in rope_attrs(kind, d, rounding).items() if k != "norm_rounding"}
    q_got, _ = rope_kv_write_triton(qkv, positions, cache, slots, *norms, **attrs, norm_rounding=rounding,
                                    inv_freq=rope_inv_freq(d, 1e4, None))
    assert_fused_norms_follow(q_got, cache, case, kind, d, rounding)


def plan_graph(kind: str, d: int, rounding: str) -> str:
    width, q_width = (HEADS + 2 * KV_HEADS) * d, HEADS * d
    q_norm, k_norm = (d, d) if kind == "head" else (HEADS * d, KV_HEADS * d)
    extra = f", norm_rounding='{rounding}'" if rounding != "normed" else ""
    return f"""
graph prefill {{
  %qkv = input() : bf16[T,{width}]
  %positions = input() : i64[T]
  %kv_cache = input() : bf16[2,2,4,{KV_HEADS},16,{d}]
  %slot_mapping = input() : i64[T]
  %w.q_norm = weight() : bf16[{q_norm}]
  %w.k_norm = weight() : bf16[{k_norm}]
  %0 = rope_kv_write(%qkv, %positions, %kv_cache, %slot_mapping, %w.q_norm, %w.k_norm, layer=1, num_heads={HEADS}, \
num_kv_heads={KV_HEADS}, head_dim={d}, theta=10000.0, scaling=None, qk_norm='{kind}', norm_eps={NORM_EPS}{extra}) : \
bf16[T,{q_width}], bf16[2,2,4,{KV_HEADS},16,{d}]
  return %0
}}
"""


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("kind", ["head", "all"])
def test_step_plan_equals_the_native_table_bit_for_bit(kind, rounding):
    load_native_kernels()
    d = 64
    graph = parse_graph(plan_graph(kind, d, rounding))
    case = norm_case(kind, d, 11, seed=13)
    qkv, positions, slots, norms = case
    plan = lower_step_plan(graph, {"q_norm": norms[0], "k_norm": norms[1]}, BS)
    plan_cache, table_cache = (torch.zeros(2, 2, 4, KV_HEADS, BS, d, dtype=BF16) for _ in range(2))
    (q_plan,) = plan({"qkv": qkv, "positions": positions, "kv_cache": plan_cache, "slot_mapping": slots})
    node = next(n for n in graph.nodes if n.op == "rope_kv_write")
    x = bind(OPS["rope_kv_write"], [qkv, positions, table_cache, slots, *norms], node.attrs)
    q_table, _ = native_op_impls()["rope_kv_write"](x, node.attrs)
    assert torch.equal(q_plan, q_table) and torch.equal(plan_cache, table_cache)
    assert_fused_norms_follow(q_plan, plan_cache, case, kind, d, rounding)
