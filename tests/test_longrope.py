"""LongRoPE (Phi-3, Phi-4-mini): `longrope_choice` picks one set of factors per artifact, by the
served context; rope_ref with it equals transformers' own Phi-3 rotary embedding on calls where
transformers picks the same set (long: a call past original_max_position_embeddings; short: one
within it), the attention factor included; the native tables (RopeTables, the C++ kernel's) and
the Triton kernel (interpreter) rotate as the reference does."""

from __future__ import annotations

import math

import pytest
import torch

from llmc.compiler.ops.rope import longrope_choice, rope_attention_factor, rope_ref
from llmc.kernels.rope import RopeTables, rope_inv_freq
from llmc.kernels.rope_kv_write import rope_kv_write_cpu, rope_kv_write_ref
from llmc.kernels.triton.rope_kv_write import rope_kv_write_triton
from test_triton_rope_kv_write import DEVICE, LAYER, STEPS, make_case, rope_tolerance

HEAD_DIM, THETA, ORIGINAL = 32, 10000.0, 32
_g = torch.Generator().manual_seed(7)
SHORT = [round(1.0 + float(v), 3) for v in torch.rand(HEAD_DIM // 2, generator=_g)]
LONG = [round(1.0 + 20 * float(v), 3) for v in torch.rand(HEAD_DIM // 2, generator=_g)]


def hf_params(**extra) -> dict:
    return {"rope_type": "longrope", "rope_theta": THETA, "short_factor": SHORT, "long_factor": LONG, **extra}


def transformers_rotation(max_positions: int, positions: torch.Tensor, **extra):
    """(cos, sin [T, D], apply_rotary_pos_emb) of transformers' Phi-3 for one forward call."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    config = Phi3Config(hidden_size=2 * HEAD_DIM, num_attention_heads=2, num_key_value_heads=2,
                        max_position_embeddings=max_positions, original_max_position_embeddings=ORIGINAL,
                        rope_parameters=hf_params(**extra))
    rotary = Phi3RotaryEmbedding(config)
    cos, sin = rotary(torch.zeros(1, len(positions), HEAD_DIM), positions[None])
    return cos[0], sin[0], apply_rotary_pos_emb


def hf_rope(x: torch.Tensor, positions: torch.Tensor, max_positions: int, **extra) -> torch.Tensor:
    """x [T, H * D] rotated by transformers' Phi-3 (one call over these positions)."""
    cos, sin, apply = transformers_rotation(max_positions, positions, **extra)
    heads = x.view(1, len(positions), -1, HEAD_DIM).transpose(1, 2)            # [1, H, T, D]
    q, _ = apply(heads, heads, cos[None], sin[None])
    return q.transpose(1, 2).reshape(x.shape)


def ours(max_positions: int, **extra) -> dict:
    return longrope_choice(hf_params(**extra), max_positions, ORIGINAL)


@pytest.mark.parametrize("max_positions, positions, factors", [
    (128, torch.arange(0, 100), "long"),              # served context past the original: long, as a long call
    (128, torch.tensor([40, 33, 99, 127]), "long"),
    (32, torch.arange(0, 32), "short"),               # served context within it: short, attention factor 1
], ids=["long_prefill", "long_scattered", "short"])
def test_rope_ref_equals_transformers_phi3(max_positions, positions, factors):
    scaling = ours(max_positions)
    assert scaling["factors"] == factors
    x = torch.randn(len(positions), 2 * HEAD_DIM, generator=torch.Generator().manual_seed(0))
    want = hf_rope(x, positions, max_positions)
    torch.testing.assert_close(rope_ref(x, positions, HEAD_DIM, THETA, scaling), want, rtol=1e-5, atol=1e-5)


def test_short_factors_keep_the_attention_factor_as_transformers_does():
    """A 128-position config rotates a call within the original 32 with the short factors, still
    times sqrt(1 + ln 4 / ln 32): the artifact's short set (forced here) does the same."""
    positions = torch.arange(0, 20)
    scaling = {**ours(128), "factors": "short"}
    x = torch.randn(len(positions), 2 * HEAD_DIM, generator=torch.Generator().manual_seed(1))
    want = hf_rope(x, positions, 128)
    torch.testing.assert_close(rope_ref(x, positions, HEAD_DIM, THETA, scaling), want, rtol=1e-5, atol=1e-5)
    assert rope_attention_factor(scaling) == pytest.approx(math.sqrt(1 + math.log(4) / math.log(32)))


def test_a_given_attention_factor_is_used_and_matches_transformers():
    positions = torch.arange(30, 90)
    scaling = ours(128, attention_factor=1.3)
    assert rope_attention_factor(scaling) == 1.3
    x = torch.randn(len(positions), 2 * HEAD_DIM, generator=torch.Generator().manual_seed(2))
    want = hf_rope(x, positions, 128, attention_factor=1.3)
    torch.testing.assert_close(rope_ref(x, positions, HEAD_DIM, THETA, scaling), want, rtol=1e-5, atol=1e-5)


def test_rope_tables_are_transformers_cos_and_sin():
    positions = torch.arange(0, 128)
    cos, sin = RopeTables(HEAD_DIM, THETA, ours(128))(positions)              # [T, D/2]
    hf_cos, hf_sin, _ = transformers_rotation(128, positions)                 # [T, D]: halves repeated
    torch.testing.assert_close(cos, hf_cos[:, : HEAD_DIM // 2], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin[:, : HEAD_DIM // 2], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scaling, words", [
    ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG}, "'factors'"),
    ({**ours(128), "long_factor": LONG[:-1]}, "has 15 values"),
])
def test_a_longrope_dict_it_cannot_use_is_one_sentence(scaling, words):
    with pytest.raises(ValueError, match=words):
        rope_inv_freq(HEAD_DIM, THETA, scaling)


def test_longrope_choice_needs_both_factor_lists():
    with pytest.raises(ValueError, match="short_factor and long_factor"):
        longrope_choice({"rope_type": "longrope", "short_factor": SHORT}, 128, 32)


@pytest.mark.parametrize("max_positions", [128, 32])
def test_native_rope_kv_write_with_longrope_tables_matches_ref(max_positions):
    from test_native_kernels import assert_matches

    heads, kv_heads, t, scaling = 4, 2, 13, ours(max_positions)
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * HEAD_DIM, generator=g)
    positions, slots = torch.randint(0, 128, (t,), generator=g), torch.randperm(64, generator=g)[:t]
    attrs = dict(layer=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=HEAD_DIM)
    caches = [torch.zeros(2, 2, 4, kv_heads, 16, HEAD_DIM, dtype=dt) for dt in (torch.float32,) * 2 + (torch.float64,)]
    q_got, _ = rope_kv_write_cpu(qkv, positions, caches[0], slots, **attrs, tables=RopeTables(HEAD_DIM, THETA, scaling))
    q_want, _ = rope_kv_write_ref(qkv, positions, caches[1], slots, **attrs, theta=THETA, scaling=scaling)
    q_exact, _ = rope_kv_write_ref(qkv.double(), positions, caches[2], slots, **attrs, theta=THETA, scaling=scaling)
    assert_matches(q_got, q_want, q_exact, torch.float32, 2)
    assert_matches(caches[0], caches[1], caches[2], torch.float32, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_rope_kv_write_with_longrope_matches_ref(dtype):
    heads, kv_heads, scaling = 4, 2, ours(128)
    theirs, ref = make_case(STEPS["mixed"], heads, kv_heads, HEAD_DIM, dtype, packed=True, seed=3)
    attrs = dict(layer=LAYER, num_heads=heads, num_kv_heads=kv_heads, head_dim=HEAD_DIM)
    q_got, cache_got = rope_kv_write_triton(*theirs, **attrs, inv_freq=rope_inv_freq(HEAD_DIM, THETA, scaling).to(DEVICE),
                                            attention_factor=rope_attention_factor(scaling))
    q_want, cache_want = rope_kv_write_ref(*ref, **attrs, theta=THETA, scaling=scaling)
    torch.testing.assert_close(q_got.cpu().float(), q_want.to(dtype).float(), **rope_tolerance(dtype))
    torch.testing.assert_close(cache_got.cpu().float(), cache_want.to(dtype).float(), **rope_tolerance(dtype))
