"""Partial rotary (Phi-4-mini's partial_rotary_factor): only each head's first rotary_dim values
turn, the rest pass through. The reference against transformers' Phi3 rotary embedding; the
frontend's attribute (fuse_rope_kv_write's: tests/passes); the native kernel, the step plan (bit for bit
with the native table) and the Triton template (interpreter) against the reference, with and
without q/k norms, float and int8 caches."""

from __future__ import annotations

import pytest
import torch

from llmc.compiler import frontend
from llmc.compiler.ir import parse_graph
from llmc.compiler.ops import OPS, bind
from llmc.compiler.ops.rope import rope_ref
from llmc.kernels.native import load_native_kernels
from llmc.kernels.native_ops import native_op_impls
from llmc.kernels.rope import RopeTables, rope_inv_freq
from llmc.kernels.rope_kv_write import rope_kv_write_cpu, rope_kv_write_ref
from llmc.kernels.triton.rope_kv_write import rope_kv_write_triton
from llmc.runtime.step_plan import lower_step_plan
from test_rope_qk_norm import BS, EPS_NORM, HEADS, KV_HEADS, caches, inputs, plan_graph
from test_triton_rope_kv_write import DEVICE, LAYER, STEPS, THETA, make_case, rope_tolerance
from tolerances import assert_as_close_as_ref, tolerance

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def native():
    load_native_kernels()


def test_the_reference_turns_what_transformers_phi3_turns():
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    config = Phi3Config(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.75)
    x = torch.randn(7, 4 * 128, generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([0, 1, 5, 99, 400, 1000, 3000])
    cos, sin = Phi3RotaryEmbedding(config)(x, positions[None])               # [1, T, 96]
    heads = x.view(1, 7, 4, 128).transpose(1, 2)                              # [1, H, T, D]
    want, _ = apply_rotary_pos_emb(heads, heads, cos, sin)
    got = rope_ref(x, positions, 128, 10000.0, None, rotary_dim=96)
    torch.testing.assert_close(got, want.transpose(1, 2).reshape(7, -1), atol=2e-6, rtol=2e-6)
    assert torch.equal(got.view(7, 4, 128)[..., 96:], x.view(7, 4, 128)[..., 96:])   # passed through
    assert torch.equal(rope_ref(x, positions, 128, 1e4, None, rotary_dim=128), rope_ref(x, positions, 128, 1e4, None))


class _Builder:
    def op(self, name, inputs, **attrs):
        return name, attrs


def test_the_frontend_writes_rotary_dim_only_for_a_partial_rotary():
    assert frontend._fn_rope(_Builder(), "x", "p", 128, 1e4, None, 96)[1]["rotary_dim"] == 96
    assert "rotary_dim" not in frontend._fn_rope(_Builder(), "x", "p", 128, 1e4, None, rotary_dim=128)[1]
    assert "rotary_dim" not in frontend._fn_rope(_Builder(), "x", "p", 128, 1e4, None)[1]


def partial(text: str, rotary: int) -> str:
    return text.replace("scaling=None", f"scaling=None, rotary_dim={rotary}")


CASES = [(128, 96, ""), (64, 32, ""), (32, 24, ""), (128, 96, "head"), (64, 48, "head"), (128, 64, "all")]
# head_dim, rotary_dim (24, 48: vectors of 16 angles and a tail), qk_norm


@pytest.mark.parametrize("d,rotary,kind", CASES)
@pytest.mark.parametrize("cache", ["float", "int8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_partial_rotary_matches_the_reference(native, d, rotary, kind, cache, dtype):
    dtype = DTYPES[dtype]
    qkv, positions, slots, norms = inputs(kind or "head", d, dtype, 13, seed=rotary)
    norms, attrs = (norms, dict(qk_norm=kind, norm_eps=EPS_NORM)) if kind else ([], {})
    common = dict(layer=1, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=d, **attrs)
    got, want = caches(d, torch.int8 if cache == "int8" else dtype, 2)
    exact = caches(d, torch.float64, 1)[0]
    q_got, _ = rope_kv_write_cpu(qkv, positions, got, slots, *norms, **common, tables=RopeTables(rotary, 1e4, None))
    q_want, _ = rope_kv_write_ref(qkv, positions, want, slots, *norms, **common, theta=1e4, scaling=None,
                                  rotary_dim=rotary)
    q_exact, _ = rope_kv_write_ref(*[x.double() for x in (qkv, positions, exact, slots, *norms)], **common,
                                   theta=1e4, scaling=None, rotary_dim=rotary)
    if dtype == torch.float32:
        torch.testing.assert_close(q_got, q_want, **tolerance(dtype, d))
    else:
        assert_as_close_as_ref(q_got, q_want, q_exact, dtype)
    if cache == "int8":                       # codes within one of the ref's (tests/test_native_int8_kv.py)
        assert (got.int() - want.int())[..., :-4].abs().max() <= 1
    elif dtype == torch.float32:
        torch.testing.assert_close(got, want, **tolerance(dtype, d))
    else:
        assert_as_close_as_ref(got, want, exact, dtype)
    if not kind:                                                          # the rest of each head passes through
        assert torch.equal(q_got.view(13, HEADS, d)[..., rotary:], qkv[:, :HEADS * d].view(13, HEADS, d)[..., rotary:])


@pytest.mark.parametrize("d,rotary,kind", CASES)
def test_step_plan_partial_rotary_equals_the_native_table(native, d, rotary, kind):
    text = partial(plan_graph(kind or "head", d, "bf16"), rotary)
    if not kind:
        text = text.replace(", %w.q_norm, %w.k_norm", "").replace(f", qk_norm='head', norm_eps={EPS_NORM}", "")
    graph = parse_graph(text)
    qkv, positions, slots, norms = inputs(kind or "head", d, torch.bfloat16, 11, seed=3)
    plan = lower_step_plan(graph, {"q_norm": norms[0], "k_norm": norms[1]}, BS)
    plan_cache, table_cache = caches(d, torch.bfloat16, 2)
    (q_plan,) = plan({"qkv": qkv, "positions": positions, "kv_cache": plan_cache, "slot_mapping": slots})
    node = next(n for n in graph.nodes if n.op == "rope_kv_write")
    x = bind(OPS["rope_kv_write"], [qkv, positions, table_cache, slots, *(norms if kind else [])], node.attrs)
    q_table, _ = native_op_impls()["rope_kv_write"](x, node.attrs)
    assert torch.equal(q_plan, q_table) and torch.equal(plan_cache, table_cache)
    want, _ = OPS["rope_kv_write"].reference(x, node.attrs)
    assert_as_close_as_ref(q_plan, want, OPS["rope_kv_write"].reference(
        bind(OPS["rope_kv_write"], [t.double() for t in x.values()], node.attrs), node.attrs)[0], torch.bfloat16)


@pytest.mark.parametrize("d,rotary", [(128, 96), (64, 48), (80, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
def test_triton_partial_rotary_matches_the_reference(d, rotary, dtype, int8):
    ours, ref = make_case(STEPS["mixed"], HEADS, KV_HEADS, d, dtype, packed=True, seed=rotary)
    if int8:
        ours[2] = torch.zeros(*ours[2].shape[:-1], d + 4, dtype=torch.int8, device=DEVICE)
        ref[2] = torch.zeros(*ref[2].shape[:-1], d + 4, dtype=torch.int8)
    attrs = dict(layer=LAYER, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=d)
    q_got, cache_got = rope_kv_write_triton(*ours, **attrs, inv_freq=rope_inv_freq(rotary, THETA, None).to(DEVICE),
                                            rotary_dim=rotary)
    q_want, cache_want = rope_kv_write_ref(*ref, **attrs, theta=THETA, scaling=None, rotary_dim=rotary)
    torch.testing.assert_close(q_got.cpu().float(), q_want.to(dtype).float(), **rope_tolerance(dtype))
    if int8:
        assert (cache_got.cpu().int() - cache_want.int())[..., :-4].abs().max() <= 1
    else:
        torch.testing.assert_close(cache_got.cpu().float(), cache_want.to(dtype).float(), **rope_tolerance(dtype))
