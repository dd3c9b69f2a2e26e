"""The ops the passes produce: type rules that reject what they must, and torch references
whose packed and unpacked forms agree."""

from __future__ import annotations

import pytest
import torch

from llmc.compiler.ir import IRError, TensorType
from llmc.compiler.ops import infer_types
from llmc.kernels.activation import silu_mul_ref
from llmc.kernels.rope_kv_write import rope_kv_write_ref

F = lambda *shape: TensorType("f32", shape)  # noqa: E731
I64 = lambda *shape: TensorType("i64", shape)  # noqa: E731
CACHE = F(2, 2, "NB", 3, "BS", 12)
ROPE_KV = dict(layer=1, num_heads=6, num_kv_heads=3, head_dim=12, theta=10000.0, scaling=None)


def test_result_types_of_multi_result_ops():
    assert infer_types("split", [F("T", 144)], {"sizes": [72, 36, 36]}) == (F("T", 72), F("T", 36), F("T", 36))
    assert infer_types("add_rmsnorm", [F("T", 72), F("T", 72), F(72)], {"eps": 1e-5}) == (F("T", 72),) * 2
    got = infer_types("rope_kv_write", [F("T", 144), I64("T"), CACHE, I64("T")], ROPE_KV)
    assert got == (F("T", 72), CACHE)
    assert infer_types("silu_mul", [F("T", 240)], {}) == (F("T", 120),)
    assert infer_types("concat", [F(72, 72), F(36, 72)], {"dim": 0}) == (F(108, 72),)


@pytest.mark.parametrize("op, types, attrs, words", [
    ("split", [F("T", 144)], {"sizes": [72, 36]}, "do not add up"),
    ("silu_mul", [F("T", 121)], {}, "even last dim"),
    ("rope_kv_write", [F("T", 140), I64("T"), CACHE, I64("T")], ROPE_KV, "packed qkv"),
    ("rope_kv_write", [F("T", 144), I64("T"), CACHE], ROPE_KV, r"takes \(qkv, positions, kv_cache, slot_mapping, q_norm \(by attrs\), k_norm \(by attrs\)\) or \(q, k, v"),
    ("concat", [F("T", 72), F("T", 72)], {"dim": 0}, "symbolic dim"),
    ("add_rmsnorm", [F("T", 72), F("T", 36), F(72)], {"eps": 1e-5}, "operand types differ"),
])
def test_type_rules_reject_mismatches(op, types, attrs, words):
    with pytest.raises(IRError, match=words):
        infer_types(op, types, attrs)


def test_packed_and_separate_rope_kv_write_agree():
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 144, generator=g)
    positions, slots = torch.tensor([0, 1, 2, 7, 3]), torch.tensor([0, 1, 2, 5, -1])  # -1: padding
    caches = [torch.zeros(2, 2, 2, 3, 4, 12) for _ in range(2)]
    q1, c1 = rope_kv_write_ref(qkv, positions, caches[0], slots, **ROPE_KV)
    q, k, v = qkv.split([72, 36, 36], dim=-1)
    q2, c2 = rope_kv_write_ref(q, k, v, positions, caches[1], slots, **ROPE_KV)
    assert torch.equal(q1, q2) and torch.equal(c1, c2)
    assert c1[1].abs().sum() > 0 and c1[0].abs().sum() == 0  # only layer 1 written


def test_packed_and_separate_silu_mul_agree():
    x = torch.randn(3, 240)
    assert torch.equal(silu_mul_ref(x), silu_mul_ref(x[:, :120], x[:, 120:]))
