"""One place per op: every op in OPS has a kind, a torch implementation, and a codegen answer
(a kernel, or a named reason why the pipeline never leaves it for codegen)."""

from __future__ import annotations

from llmc.compiler.codegen import LOWERED_OPS, NOT_LOWERED
from llmc.compiler.ops import OP_KINDS, OPS
from llmc.kernels.native_ops import native_op_impls
from llmc.kernels.torch_ops import OP_IMPLS

LEAVES = {"input", "weight"}


def test_ops_the_torch_table_and_codegen_name_the_same_ops():
    ops = set(OPS) - LEAVES
    assert set(OP_IMPLS) == ops
    assert set(LOWERED_OPS) | set(NOT_LOWERED) - LEAVES == ops
    assert not set(LOWERED_OPS) & set(NOT_LOWERED)
    assert set(native_op_impls()) == ops        # the native table is the ref table with swaps


def test_every_op_has_a_known_kind_and_leaves_are_the_only_leaf_kind():
    assert all(op.kind in OP_KINDS for op in OPS.values())
    assert {name for name, op in OPS.items() if op.kind == "leaf"} == LEAVES
