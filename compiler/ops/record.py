"""One record per op (DESIGN decision 12): its definition, its torch reference, and what every
backend does with it.

An `OpRecord` holds the op's named operands (in one or more forms: an operand may be optional,
present only under an attribute, or variadic), its attributes, type rule and kind; its torch
reference (the meaning of the op, taking the operands by name); for elementwise and row-wise
ops, the row formula every code generator renders (compiler/formula.py) and the torch functions
the frontend traces into the op; and per backend either
`Lowered(where)` or `Declined(reason)`. Backends build their tables from these records: an op
they lower must have an implementation there, and nothing else may. An elementwise op with a
formula needs no entry for the backends that generate their kernels (`GENERATED_BY`).

`bind(record, inputs, attrs)` names a node's inputs; no code outside the records decodes an
op's inputs by position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypeVar

from ..formula import Formula
from ..ir import IRError, TensorType

TypeRule = Callable[["Operands", dict], tuple[TensorType, ...]]
Reference = Callable[["Operands", dict], Any]
OP_KINDS = ("leaf", "gemm", "elementwise", "rowwise", "attention", "data_movement", "collective")
# torch: the references (the meaning); native: the op-by-op CPU table; step_plan: one native call
# per step; triton: codegen for a GPU; onnx: graph export. A profile's kind is the op's kind.
BACKENDS = ("torch", "native", "step_plan", "triton", "onnx")
GENERATED_BY = ("native", "step_plan", "triton")      # backends that write a kernel from the formula
T = TypeVar("T")


@dataclass(frozen=True)
class Lowered:
    """The backend computes the op: `where` names its kernel, template or instruction."""

    where: str


@dataclass(frozen=True)
class Declined:
    """The backend leaves the op alone; `reason` says why and what to do instead."""

    reason: str


@dataclass(frozen=True)
class Operand:
    """One named input. `optional`: may be absent (then it is taken from the inputs left over,
    in order); `when`: present exactly when this holds of the attributes; `variadic`: one or
    more inputs (the last operand of its form)."""

    name: str
    optional: bool = False
    when: Callable[[dict], bool] | None = None
    variadic: bool = False


class Operands(dict):
    """A node's inputs (values, types or tensors) by operand name; a variadic operand is a list."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass(frozen=True)
class OpRecord:
    name: str
    forms: tuple[tuple[Operand, ...], ...]
    attrs: tuple[str, ...]
    infer: TypeRule
    kind: str
    doc: str
    reference: Reference | None = None
    formula: Formula | None = None
    backends: dict[str, Lowered | Declined] = field(default_factory=dict)
    side_effects: bool = False
    traced: tuple = ()          # torch functions the frontend maps to this op, tensor args = operands,
                                # a number argument = the op's one attribute (see compiler/frontend.py)
    traced_kwargs: dict = field(default_factory=dict)   # keywords the traced call must pass, with these values

    def __post_init__(self) -> None:
        assert self.kind in OP_KINDS, f"op {self.name} has unknown kind {self.kind!r}"
        assert not set(self.backends) - set(BACKENDS), f"op {self.name} names unknown backends"

    def lowering(self, backend: str) -> Lowered | Declined | None:
        """What `backend` does with the op; None where the record does not say (a gap)."""
        if backend == "torch":
            return Lowered("reference") if self.reference is not None else None
        if backend in self.backends:
            return self.backends[backend]
        if self.formula is not None and backend in GENERATED_BY:
            return Lowered("generated from the formula")
        if backend == "onnx":            # tools/graph_export.py writes any op so
            return Lowered("a node of the llmc domain, attributes as ONNX attributes")
        return None


def bind(record: OpRecord, inputs: Sequence[T], attrs: dict) -> Operands:
    """`inputs` named by the record's first form that takes this many under `attrs`; IRError if none."""
    for form in record.forms:
        named = _bind_form(form, list(inputs), attrs)
        if named is not None:
            return named
    forms = " or ".join("(" + ", ".join(_describe(o) for o in form) + ")" for form in record.forms)
    raise IRError(f"{record.name} takes {forms}, got {len(inputs)} inputs")


def _bind_form(form: tuple[Operand, ...], inputs: list, attrs: dict) -> Operands | None:
    present = [o for o in form if o.when is None or _holds(o.when, attrs)]
    required = sum(not o.optional and not o.variadic for o in present) + any(o.variadic for o in present)
    extra = len(inputs) - required
    if extra < 0 or (extra > sum(o.optional for o in present) and not any(o.variadic for o in present)):
        return None
    named, at = Operands(), 0
    for o in present:
        if o.variadic:
            named[o.name], at = inputs[at:], len(inputs)
        elif o.optional:
            if extra > 0:
                named[o.name], at, extra = inputs[at], at + 1, extra - 1
        else:
            named[o.name], at = inputs[at], at + 1
    return named if at == len(inputs) else None


def _holds(rule: Callable[[dict], bool], attrs: dict) -> bool:
    try:
        return bool(rule(attrs))
    except (KeyError, TypeError):
        return False


def _describe(o: Operand) -> str:
    return o.name + ("?" if o.optional else "") + ("..." if o.variadic else "") + (" (by attrs)" if o.when else "")


def operands(*names: str) -> tuple[Operand, ...]:
    """A form from names: `bias?` optional, `parts...` variadic."""
    return tuple(Operand(n.rstrip("?."), optional=n.endswith("?"), variadic=n.endswith("...")) for n in names)
