"""compiler/dtypes.py: every IR element type's facts agree with torch and with ONNX, and what is
derived from the table (the IR parser's names, the user names) follows it."""

from __future__ import annotations

import pytest
import torch

from llmc.compiler.dtypes import DTYPES, FLOAT_DTYPES, USER_DTYPES, dtype_info, from_torch, to_torch
from llmc.compiler.ir import IRError, parse_type


@pytest.mark.parametrize("name", list(DTYPES))
def test_a_dtype_parses_and_is_stored_as_its_torch_type(name):
    d = dtype_info(name)
    assert parse_type(f"{name}[T,4]").dtype == name and to_torch(name) is d.torch_dtype
    assert torch.empty(0, dtype=d.torch_dtype).element_size() == d.element_size
    assert d.is_float == d.torch_dtype.is_floating_point
    if d.codes_per_element == 1:
        assert from_torch(d.torch_dtype) == name


def test_packed_int4_is_bytes_of_two_codes_and_uint8_reads_back_as_u8():
    packed = dtype_info("u4x2")
    assert (packed.torch_dtype, packed.onnx, packed.element_size, packed.codes_per_element) == (torch.uint8, "UINT8",
                                                                                               1, 2)
    assert "two 4-bit codes" in packed.note and from_torch(torch.uint8) == "u8"


@pytest.mark.parametrize("name", list(DTYPES))
def test_the_onnx_type_names_a_tensorproto_type_of_the_same_width(name):
    onnx = pytest.importorskip("onnx")
    d = dtype_info(name)
    elem = getattr(onnx.TensorProto, d.onnx)
    assert onnx.helper.tensor_dtype_to_np_dtype(elem).itemsize == d.element_size


def test_user_names_and_float_types_come_from_the_table():
    assert USER_DTYPES == {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}   # the order errors list
    assert set(FLOAT_DTYPES) == {"f32", "bf16", "f16"} and dtype_info("i8").user_name == "int8"
    with pytest.raises(IRError, match="torch.complex64 has no llmc IR element type"):
        from_torch(torch.complex64)
    with pytest.raises(IRError, match="expected a type"):
        parse_type("u4[T]")
