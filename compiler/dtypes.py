"""IR element types: every fact about each one, in one table (the one place that knows them).

  IR     torch           ONNX       bytes  kind   user name
  f32    torch.float32   FLOAT      4      float  float32
  bf16   torch.bfloat16  BFLOAT16   2      float  bfloat16
  f16    torch.float16   FLOAT16    2      float  float16
  i64    torch.int64     INT64      8      int
  i32    torch.int32     INT32      4      int
  i8     torch.int8      INT8       1      int    int8
  u8     torch.uint8     UINT8      1      int
  u4x2   torch.uint8     UINT8      1      int    packed: a byte holds two 4-bit codes
  bool   torch.bool      BOOL       1      bool

A u4x2 element is one byte of int4 codes (compiler/quant_format.py states their nibble order), so
a u4x2 tensor's shape counts bytes and its torch and ONNX types are those of the packed bytes;
torch's uint8 maps back to u8, never to u4x2. The ONNX type is TensorProto's name for it, so this
module needs no onnx. The user name is what `--dtype` and `--kv-dtype` spell.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DType:
    """One IR element type and what it is in torch, in ONNX and in memory."""

    name: str                        # as the IR prints it
    torch_dtype: torch.dtype         # the tensor that stores it (u4x2: its packed bytes)
    onnx: str                        # onnx.TensorProto's name for the stored element
    element_size: int                # bytes of one stored element (u4x2: one byte, two codes)
    kind: str                        # "float", "int" or "bool"
    user_name: str | None = None     # what a user types for it, where a user can choose it
    codes_per_element: int = 1       # values one stored element holds (u4x2: 2)
    note: str = ""                   # what a reader of an exported graph should know about it

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def is_integer(self) -> bool:
        return self.kind == "int"


_PACKED = ("packed int4: each byte holds two 4-bit codes, the low nibble then the high one, "
           "in blocks of 32 codes (llmc's compiler/quant_format.py)")
DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("f32", torch.float32, "FLOAT", 4, "float", "float32"),
    DType("bf16", torch.bfloat16, "BFLOAT16", 2, "float", "bfloat16"),
    DType("f16", torch.float16, "FLOAT16", 2, "float", "float16"),
    DType("i64", torch.int64, "INT64", 8, "int"),
    DType("i32", torch.int32, "INT32", 4, "int"),
    DType("i8", torch.int8, "INT8", 1, "int", "int8"),
    DType("u8", torch.uint8, "UINT8", 1, "int"),
    DType("u4x2", torch.uint8, "UINT8", 1, "int", codes_per_element=2, note=_PACKED),
    DType("bool", torch.bool, "BOOL", 1, "bool"),
)}
FLOAT_DTYPES = tuple(name for name, d in DTYPES.items() if d.is_float)
# Names users type on the command line for the compute dtype (in the order error messages list them).
USER_DTYPES = {d.user_name: name for name, d in DTYPES.items() if d.is_float}
_FROM_TORCH = {d.torch_dtype: name for name, d in DTYPES.items() if d.codes_per_element == 1}


def dtype_info(dtype: str) -> DType:
    """The facts of IR element type `dtype` (KeyError for a name that is none)."""
    return DTYPES[dtype]


def to_torch(dtype: str) -> torch.dtype:
    return DTYPES[dtype].torch_dtype


def from_torch(dtype: torch.dtype) -> str:
    if dtype not in _FROM_TORCH:
        from .ir import IRError          # ir reads this table, so its error is imported late

        raise IRError(f"torch dtype {dtype} has no llmc IR element type")
    return _FROM_TORCH[dtype]
