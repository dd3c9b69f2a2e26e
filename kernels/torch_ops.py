"""The torch backend's op tables, derived from the op records (compiler/ops): the references are
the meaning of the IR and the table the torch backend runs by default (kernels/native_ops.py
swaps native CPU kernels in).

Every entry takes a node's inputs by operand name (`Operands`) and its attributes, and returns its
result or results. `bound(impl, record, count, attrs)` makes the positional launch a program
calls from a named one, deciding the names once per node.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from llmc.compiler.ops import OPS, Operands, OpRecord, bind

OpImpl = Callable[[Operands, dict[str, Any]], "torch.Tensor | tuple[torch.Tensor, ...]"]
Launch = Callable[[list, dict[str, Any]], Any]


def reference_impls() -> dict[str, OpImpl]:
    """A fresh table of every op's torch reference (leaves have none)."""
    return {name: r.reference for name, r in OPS.items() if r.reference is not None}


def bound(impl: OpImpl, record: OpRecord, count: int, attrs: dict) -> Launch:
    """`impl` as a launch taking a node's `count` inputs by position: the names, decided here once."""
    slots = bind(record, list(range(count)), attrs)
    if any(isinstance(i, list) for i in slots.values()):
        return lambda args, a: impl(Operands({k: [args[j] for j in i] if isinstance(i, list) else args[i]
                                              for k, i in slots.items()}), a)
    pairs = tuple(slots.items())
    return lambda args, a: impl(Operands({k: args[i] for k, i in pairs}), a)


def run_op(op: str, inputs: list, attrs: dict, impls: dict[str, OpImpl] | None = None):
    """One op applied to positional `inputs` (for tools and tests): `impls`' entry, else the reference."""
    record = OPS[op]
    impl = (impls or {}).get(op) or record.reference
    return impl(bind(record, inputs, attrs), attrs)
