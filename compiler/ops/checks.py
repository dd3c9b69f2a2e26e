"""Shared pieces of the ops' type rules: each check raises IRError with the rule it found broken."""

from __future__ import annotations

from ..dtypes import FLOAT_DTYPES
from ..ir import IRError, TensorType

INDEX_DTYPES = ("i64", "i32")      # the integer types an index operand (ids, slots, lengths) may have


def expect(cond: bool, message: str) -> None:
    if not cond:
        raise IRError(message)


def float_(t: TensorType, what: str) -> None:
    expect(t.dtype in FLOAT_DTYPES, f"{what} must be a float tensor, got {t}")


def index_tensor(t: TensorType, what: str, rank: int = 1) -> None:
    expect(t.dtype in INDEX_DTYPES and len(t.shape) == rank,
            f"{what} must be an integer tensor of rank {rank}, got {t}")


def same(a: TensorType, b: TensorType, what: str) -> None:
    expect(a == b, f"{what}: operand types differ, {a} vs {b}")


def heads_width(t: TensorType, heads: int, head_dim: int, what: str) -> None:
    expect(len(t.shape) == 2 and t.shape[1] == heads * head_dim,
           f"{what} must be [T, {heads}*{head_dim}], got {t}")
