"""Mapping between IR element types and torch dtypes (the one place that knows both)."""

from __future__ import annotations

import torch

from .ir import IRError

_TO_TORCH = {
    "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
    "i64": torch.int64, "i32": torch.int32, "i8": torch.int8, "u8": torch.uint8, "bool": torch.bool,
    "u4x2": torch.uint8,          # packed: two 4-bit codes per byte (kernels/quant.py)
}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items() if k != "u4x2"}
# Names users type on the command line for the compute dtype.
USER_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def to_torch(dtype: str) -> torch.dtype:
    return _TO_TORCH[dtype]


def from_torch(dtype: torch.dtype) -> str:
    if dtype not in _FROM_TORCH:
        raise IRError(f"torch dtype {dtype} has no llmc IR element type")
    return _FROM_TORCH[dtype]
