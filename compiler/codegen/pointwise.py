"""Triton source for a unit of elementwise and row-wise ops, written from the IR.

Contract of every generated kernel: one program per row (token) of [T, C] tensors; each value
of the unit is a vector of one row in registers, BLOCK = next_power_of_2(widest value) lanes,
masked to its own width; 1-D inputs (norm weights) are per-column vectors. Math is fp32; each
op's result is rounded to its IR dtype, as the op-by-op torch reference rounds it, so a fused
kernel computes what the unfused ops compute. Loads, the op chain (each op under its IR line,
written over the kernel's own value names, as a comment), and stores of the unit's outputs.

Lowered here: every op whose record has a formula (compiler/formula.py), rendered as Triton;
an op reading column ranges of an operand (a one-input silu_mul, a split) needs that operand
from outside the unit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import triton

from llmc.compiler.dtypes import FLOAT_DTYPES, to_torch
from llmc.compiler.formula import Expr, Row
from llmc.compiler.ir import Node, TensorType, Value
from llmc.compiler.ops import OPS, operands_of

from .errors import CodegenError
from .units import KernelUnit

# the float types a generated kernel computes in, as its source spells them: torch.float32, tl.float32
TORCH_DTYPES = {d: str(to_torch(d)) for d in FLOAT_DTYPES}
TL_DTYPES = {d: "tl." + name.removeprefix("torch.") for d, name in TORCH_DTYPES.items()}
_CALLS = {"exp": "tl.exp({})", "sigmoid": "tl.sigmoid({})", "rsqrt": "tl.rsqrt({})", "sqrt": "tl.sqrt({})",
          "tanh": "(2.0 * tl.sigmoid(2.0 * {}) - 1.0)", "neg": "-{}", "max": "tl.maximum({}, {})",
          "min": "tl.minimum({}, {})", "add": "{} + {}", "sub": "{} - {}", "mul": "{} * {}", "div": "{} / {}"}


def pointwise_ops() -> tuple[str, ...]:
    """The ops this generator lowers: every op with a formula."""
    return tuple(name for name, r in OPS.items() if r.formula is not None)


@dataclass
class _Emitter:
    unit: KernelUnit
    types: dict[Value, TensorType]
    lines: list[str] = field(default_factory=list)
    names: dict[Value, str] = field(default_factory=dict)   # value -> register vector name
    args: dict[Value, str] = field(default_factory=dict)    # input value -> pointer argument name

    def width(self, v: Value) -> int:
        width = self.types[v].shape[-1]
        if not isinstance(width, int):
            raise CodegenError(f"{self.unit.label}: value {v} has a symbolic width {width}; codegen needs a "
                               "fixed row width")
        return width

    def round(self, expr: str, v: Value) -> str:
        dtype = self.types[v].dtype
        return expr if dtype == "f32" else f"({expr}).to({TL_DTYPES[dtype]}).to(tl.float32)"

    def load(self, v: Value, start: int = 0, width: int | None = None) -> str:
        """A register vector of input `v`'s columns [start, start + width) of this program's row."""
        arg = self.args[v]
        width = self.width(v) if width is None else width
        row = "" if len(self.types[v].shape) == 1 else f"row * {arg}_stride + "
        offset = f"{start} + " if start else ""
        name = f"{arg}_{start}" if start else arg
        self.lines.append(f"{name} = tl.load({arg}_ptr + {row}{offset}cols, mask=cols < {width}, "
                          f"other=0.0).to(tl.float32)")
        return name

    def operand(self, v: Value) -> str:
        if v in self.names:
            return self.names[v]
        if v not in self.args:
            raise CodegenError(f"{self.unit.label}: value {v} is used before it is computed")
        self.names[v] = self.load(v)
        return self.names[v]

    def external(self, v: Value, op: str) -> None:
        if v not in self.args:
            raise CodegenError(f"{self.unit.label}: {op} reads column ranges of {v}, which this unit computes; "
                               "codegen needs it from outside the unit")

    def define(self, v: Value, expr: str) -> None:
        name = f"t{len(self.names)}"          # numbered, not named after nodes: layers share the source
        self.lines.append(f"{name} = {self.round(expr, v)}")
        self.names[v] = name

    def comment(self, node) -> None:
        """The op as an IR line over this kernel's own names (so identical layers give identical text)."""
        operands = [self.names.get(v) or self.args.get(v) or str(v) for v in node.inputs]
        attrs = "".join(f", {k}={v!r}" for k, v in node.attrs.items() if k != "group")
        self.lines.append(f"# {node.op}({', '.join(operands)}{attrs}) : {', '.join(map(str, node.types))}")

    def leaf(self, node: Node, operands: dict, leaf) -> str:
        """A register vector of a formula leaf: an operand's whole row, or a column range of one
        from outside the unit."""
        v = operands[leaf.name]
        if leaf.start == 0 and leaf.width == self.width(v) or len(self.types[v].shape) == 1:
            return self.operand(v)
        self.external(v, node.op)
        return self.load(v, leaf.start, leaf.width)

    def render(self, node: Node, operands: dict, e: Expr, memo: dict) -> tuple[str, int | None]:
        """(Triton expression of `e`, its width; None for a per-row scalar)."""
        if id(e) in memo:
            return memo[id(e)]
        if e.op == "operand":
            out = self.leaf(node, operands, e.value), e.value.width
        elif e.op == "const":
            out = repr(float(e.value)), None
        else:
            args = [self.render(node, operands, a, memo) for a in e.args]
            width = max((w for _, w in args if w is not None), default=None)
            if e.op == "row_sum":
                text = f"tl.sum(tl.where(cols < {args[0][1]}, {args[0][0]}, 0.0), axis=0)"
                width = None
            elif e.op == "round":
                text = args[0][0] if e.value == "f32" else f"({args[0][0]}).to({TL_DTYPES[e.value]}).to(tl.float32)"
            else:
                text = _CALLS[e.op].format(*(f"({t})" for t, _ in args))
            name = f"e{len(self.lines)}"
            self.lines.append(f"{name} = {text}")
            out = name, width
        memo[id(e)] = out
        return out


def _emit_node(e: _Emitter, node: Node) -> None:
    record = OPS[node.op]
    if record.formula is None:
        raise CodegenError(f"{e.unit.label}: codegen cannot lower op {node.op!r} into a pointwise kernel")
    e.comment(node)
    operands = operands_of(node)
    row = Row({k: e.types[v].shape[-1] for k, v in operands.items()},
              {k: e.types[v].dtype for k, v in operands.items()}, [t.dtype for t in node.types])
    memo: dict = {}
    for i, expr in enumerate(record.formula(row, node.attrs)):
        text, _ = e.render(node, operands, expr, memo)
        e.define(node.value(i), text)


def _signature(e: _Emitter, outputs: list[str]) -> list[str]:
    args = [f"    {a}_ptr,  # {e.types[v]}" for v, a in e.args.items()]
    args += [f"    {o}_ptr,  # {e.types[v]} (written)" for v, o in zip(e.unit.outputs, outputs)]
    strides = [f"{a}_stride" for v, a in e.args.items() if len(e.types[v].shape) == 2]
    strides += [f"{o}_stride" for o in outputs]
    return args + [f"    {', '.join(strides)},", "    BLOCK: tl.constexpr,"]


def pointwise_kernel_source(unit: KernelUnit, types: dict[Value, TensorType], name: str) -> str:
    """The Triton kernel and launcher for `unit`, named `name` (see module docstring)."""
    e = _Emitter(unit, types)
    e.args = {v: f"in{i}" for i, v in enumerate(unit.inputs)}
    for node in unit.nodes:
        _emit_node(e, node)
    outputs = [f"out{i}" for i in range(len(unit.outputs))]
    for v, o in zip(unit.outputs, outputs):
        if len(types[v].shape) != 2:
            raise CodegenError(f"{unit.label}: output {v} is not a [T, C] row tensor")
        e.lines.append(f"tl.store({o}_ptr + row * {o}_stride + cols, {e.operand(v)}, mask=cols < {e.width(v)})")
    block = triton.next_power_of_2(max(e.width(v) for v in [*unit.inputs, *unit.outputs]))
    body = "\n".join(f"    {line}" for line in ["row = tl.program_id(0).to(tl.int64)",
                                                  "cols = tl.arange(0, BLOCK)", *e.lines])
    return "\n".join([
        "@triton.jit",
        f"def {name}_kernel(",
        *_signature(e, outputs),
        "):",
        body,
        "",
        "",
        _launcher(e, name, outputs, block),
    ])


def _launcher(e: _Emitter, name: str, outputs: list[str], block: int) -> str:
    unit, types = e.unit, e.types
    rows_of = next((a for v, a in e.args.items() if len(types[v].shape) == 2), None)
    if rows_of is None:
        raise CodegenError(f"{unit.label}: no [T, C] input gives the kernel its rows")
    params = ", ".join(e.args.values())
    allocs = [f"    {o} = torch.empty(({rows_of}.shape[0], {e.width(v)}), dtype={TORCH_DTYPES[types[v].dtype]}, "
              f"device={rows_of}.device)" for v, o in zip(unit.outputs, outputs)]
    strides = [f"{a}.stride(0)" for v, a in e.args.items() if len(types[v].shape) == 2] + \
              [f"{o}.stride(0)" for o in outputs]
    returns = ", ".join(outputs) + ("," if len(outputs) == 1 else "")
    return "\n".join([
        f"def launch({params}):",
        f'    """{len(unit.nodes)} op(s) in one kernel launch, one program per row; returns the outputs."""',
        *allocs,
        f"    if {rows_of}.shape[0]:",
        f"        {name}_kernel[({rows_of}.shape[0],)](",
        f"            {', '.join([*e.args.values(), *outputs])},",
        f"            {', '.join(strides)}, BLOCK={block})",
        f"    return {returns}",
    ])
