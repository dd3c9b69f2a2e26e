"""One record per op: every backend lowers every op or says why not (`llmc ops`), and each
backend's own table agrees with the records: it has an implementation for exactly the ops the
records say it lowers with one."""

from __future__ import annotations

import pytest

from llmc.compiler.codegen import TEMPLATE_OPS, pointwise_ops
from llmc.compiler.ir import TensorType
from llmc.compiler.ops import OPS, OP_KINDS, Declined, Lowered, OpRecord, operands, registered
from llmc.compiler.ops.matrix import format_matrix, missing_cells, op_matrix
from llmc.kernels.native_ops import native_op_impls

LEAVES = {"input", "weight"}


def lowered_by(backend: str, where: str = "") -> set[str]:
    return {c.op for row in op_matrix() for c in row
            if c.backend == backend and c.status == "lowered" and c.detail.startswith(where)}


def test_no_op_is_missing_a_backend_answer():
    assert missing_cells() == []
    assert "missing" not in format_matrix()


def test_an_op_a_backend_neither_lowers_nor_declines_is_missing():
    """A deliberately incomplete registration: an elementwise op with no formula and no word
    from the native, step-plan or Triton backends."""
    half = OpRecord("half", (operands("x"),), (), lambda ts, a: (ts.x,), "elementwise", "x / 2",
                    reference=lambda x, a: x.x / 2, backends={"step_plan": Declined("not yet")})
    with registered(half):
        gaps = {(c.op, c.backend) for c in missing_cells()}
        assert gaps == {("half", "native"), ("half", "triton")}
        assert "! missing" in format_matrix()
        with pytest.raises(AssertionError):
            test_no_op_is_missing_a_backend_answer()
    assert "half" not in OPS


def test_the_backends_tables_are_the_records():
    assert set(pointwise_ops()) == lowered_by("triton", "generated")
    assert set(TEMPLATE_OPS) == lowered_by("triton", "template")
    native = lowered_by("native") - lowered_by("native", "the torch reference")
    assert set(native_op_impls()) - native == set()                 # no native kernel for an op the records deny
    assert native - lowered_by("native", "generated") <= set(native_op_impls())


def test_every_op_has_a_known_kind_and_leaves_are_the_only_leaf_kind():
    assert all(op.kind in OP_KINDS for op in OPS.values())
    assert {name for name, op in OPS.items() if op.kind == "leaf"} == LEAVES
    assert all(OPS[op].reference is not None for op in set(OPS) - LEAVES)


def test_a_record_names_its_operands_and_binds_them_by_attribute():
    f16 = TensorType("f16", (8, 2))
    x, codes, scales = TensorType("f32", ("T", 64)), TensorType("i8", (8, 64)), f16
    from llmc.compiler.ops import bind
    int8 = bind(OPS["qlinear"], [x, codes, scales, TensorType("f32", (8,))], {"bits": 8, "group_size": 32})
    assert list(int8) == ["x", "codes", "scales", "bias"]
    int4 = bind(OPS["qlinear"], ["x", "codes", "scales", "mins"], {"bits": 4, "group_size": 32})
    assert list(int4) == ["x", "codes", "scales", "mins"]
    assert Lowered("a") != Declined("a")


def test_the_step_plans_instructions_are_the_records():
    from llmc.kernels.step_plan_isa import STEP_PLAN_ISA
    from llmc.runtime.step_plan import LOWERINGS

    assert set(LOWERINGS) == lowered_by("step_plan", "instruction")
    named = {c.detail.split()[1] for row in op_matrix() for c in row
             if c.backend == "step_plan" and c.detail.startswith("instruction")}
    assert named <= {i.name for i in STEP_PLAN_ISA.instructions}
