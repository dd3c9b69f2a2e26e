"""C++ source for a generated CPU unit (cpu_units.py): its ops' formulas rendered over 16-lane fp32 vectors.

Contract of every generated function (the op-by-op launcher kernels/cpu/generated_call.cpp and the
step plan's `generated` instruction call it):

    extern "C" void NAME(char* const* ptrs, const int64_t* strides, int64_t first, int64_t last);

ptrs[i] is the base address of the unit's i-th value: its inputs in unit order, then its outputs
in unit order. Row r of a [rows, C] value i is at `(T*)ptrs[i] + r * strides[i]` (strides in
elements); a 1-D value is one per-column vector for every row (its stride is not read). The
function computes rows [first, last) of every output and writes nothing else; widths, dtypes
(f32, bf16, f16) and attributes are constants of its text; it never fails or allocates (a row's
intermediates live on the stack) and runs concurrently on disjoint row ranges.

A generated unit whose ops are column-local (no row sums: output column j reads only input
columns start + j, one pass width for all of them) also gets a window function, which a GEMM calls
as its epilogue on the columns it has just computed (kernels/cpu/amx_epilogue.h):

    extern "C" void NAME_cols(char* const* ptrs, const int64_t* strides, int64_t first, int64_t last,
                              int64_t col0, int64_t col1);

the same values, rows [first, last) and output columns [col0, col1) only (col0 a multiple of 16,
col1 a multiple of 16 or the width); `ColumnReads` says which columns of each input it reads.

Inside, each op is its record's formula (compiler/formula.py) in fp32 over Vec16 chunks of a row
(kernels/cpu/vec16.h and generated_rows.h: a partial last chunk where a width is not a multiple
of 16): a row sum is a pass over the row before the pass that uses it; each op's result is
rounded to its IR dtype, as the op-by-op reference rounds it, and stored to the unit's output or,
where only later ops of the unit read it, to a row of stack scratch. Each op's IR line, written
over the function's own value names (in0, out1, t0), is a comment above its code, so identical
layers give identical text and share one function.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmc.compiler.formula import Expr, Row
from llmc.compiler.ir import Node, TensorType, Value
from llmc.compiler.ops import OPS, operands_of

from .errors import CodegenError
from .units import KernelUnit

CPP_TYPES = {"f32": "float", "bf16": "c10::BFloat16", "f16": "c10::Half"}
ROUNDS = {"f32": "{}", "bf16": "round_bf16({})", "f16": "round_f16({})"}
# every formula primitive but operand, const, round and row_sum, as Vec16 code (generated_rows.h)
CALLS = {"add": "{} + {}", "sub": "{} - {}", "mul": "{} * {}", "div": "{} / {}", "neg": "-{}",
         "exp": "exp16({})", "tanh": "tanh16({})", "sigmoid": "sigmoid16({})", "rsqrt": "rsqrt16({})",
         "sqrt": "sqrt16({})", "max": "max16({}, {})", "min": "min16({}, {})"}
MAX_SCRATCH_BYTES = 512 * 1024       # a unit's stack rows (intermediates only later ops of it read)
INCLUDE = '#include "generated_rows.h"'


@dataclass(frozen=True)
class ColumnReads:
    """What a window function reads: for each input of the unit (in unit order) the column offsets
    of its reads (output column j reads input column start + j), and the width of every output."""

    starts: tuple[tuple[int, ...], ...]
    width: int


class NotColumnLocal(Exception):
    """A unit with a row sum or passes of several widths: it has no window function."""


@dataclass(frozen=True)
class Home:
    """Where one row of a value lives in a generated function: `name` points at it."""

    name: str
    dtype: str
    scratch: bool = False             # a stack row of fp32 holding values rounded to `dtype`


def row_type(t: TensorType) -> str:
    """`t` with its rows written R: prefill's T and decode's S give the same text."""
    return f"{t.dtype}[{','.join(['R', *map(str, t.shape[1:])])}]" if len(t.shape) == 2 else str(t)


def const(value: float) -> str:
    """A formula constant as Vec16 code: the double rounded to fp32, as torch rounds a Python float."""
    text = {float("inf"): "__builtin_inff()", float("-inf"): "-__builtin_inff()"}.get(value)
    if text is None:
        text = "__builtin_nanf(\"\")" if value != value else f"float({value!r})"
    return f"splat({text})"


@dataclass
class _Function:
    """The lines of one generated function as they are written (see module docstring)."""

    unit: KernelUnit
    types: dict[Value, TensorType]
    homes: dict[Value, Home] = field(default_factory=dict)
    prologue: list[str] = field(default_factory=list)      # before the row loop: 1-D inputs, scratch rows
    lines: list[str] = field(default_factory=list)         # the body of the row loop
    scratch_bytes: int = 0
    names: int = 0
    window: int | None = None                              # the output width of a window function
    starts: dict[Value, set[int]] = field(default_factory=dict)   # input -> the column offsets read

    def fail(self, why: str) -> CodegenError:
        return CodegenError(f"{self.unit.label} ({'+'.join(n.op for n in self.unit.nodes)}): {why}")

    def name(self, stem: str) -> str:
        self.names += 1
        return f"{stem}{self.names - 1}"

    def width(self, v: Value) -> int:
        t = self.types[v]
        if len(t.shape) not in (1, 2) or not isinstance(t.shape[-1], int):
            raise self.fail(f"value {v} is {t}; a generated CPU kernel takes [rows, C] or [C] values of a fixed C")
        if t.dtype not in CPP_TYPES:
            raise self.fail(f"value {v} is {t}; a generated CPU kernel computes in {', '.join(CPP_TYPES)}")
        return t.shape[-1]

    def pointer(self, index: int, v: Value, name: str, writes: bool) -> None:
        """The home of the unit's `index`-th value, pointing at this row of it."""
        self.width(v)
        t, c = self.types[v], CPP_TYPES[self.types[v].dtype]
        cast = f"reinterpret_cast<{'' if writes else 'const '}{c}*>(ptrs[{index}])"
        if len(t.shape) == 1:
            if writes:
                raise self.fail(f"output {v} is {t}, not a [rows, C] tensor")
            self.prologue.append(f"const {c}* {name} = {cast};  // {t}: per column")
        else:
            self.lines.append(f"{'' if writes else 'const '}{c}* {name} = {cast} + r * strides[{index}];  "
                              f"// {row_type(t)}")
        self.homes[v] = Home(name, t.dtype)

    def scratch(self, v: Value) -> None:
        """A stack row for an intermediate that later ops of the unit read (stored rounded, as fp32)."""
        width, name = self.width(v), self.name("t")
        self.scratch_bytes += 4 * width
        if self.scratch_bytes > MAX_SCRATCH_BYTES:
            raise self.fail(f"its intermediates need more than {MAX_SCRATCH_BYTES} bytes of stack a row")
        self.prologue.append(f"alignas(64) float {name}[{width}];  // a row of {row_type(self.types[v])}")
        self.homes[v] = Home(name, self.types[v].dtype, scratch=True)

    def comment(self, node: Node) -> None:
        """The op's IR line over this function's names, rows as R (so prefill and decode share text)."""
        names = [self.homes[v].name if v in self.homes else str(v) for v in node.inputs]
        attrs = [f"{k}={v!r}" for k, v in node.attrs.items() if k != "group"]
        results = [self.homes[v].name if v in self.homes else "_" for v in map(node.value, range(len(node.types)))]
        types = ", ".join(map(row_type, node.types))
        self.lines.append(f"// {', '.join(results)} = {node.op}({', '.join(names + attrs)}) : {types}")


class _Chunk:
    """The body of one pass over a row: each expression a `const Vec16` of chunk j (n its lanes)."""

    def __init__(self, fn: _Function, node: Node, operands: dict[str, Value], width: int, scalars: dict):
        self.fn, self.node, self.operands, self.width = fn, node, operands, width
        self.scalars = scalars                 # the node's per-row values, shared by its passes
        self.lines: list[str] = []
        self.memo: dict[object, str] = {}

    def vector(self, e: Expr) -> str:
        if e.op == "const":
            return const(e.value)
        if e.scalar:
            return _scalar(self.fn, self.node, self.operands, e, self.scalars)
        if e.op == "operand" and self.fn.window is not None:
            self.fn.starts.setdefault(self.operands[e.value.name], set()).add(e.value.start)
        key = e.value if e.op == "operand" else e
        if key not in self.memo:
            self.memo[key] = self._define(e)
        return self.memo[key]

    def _define(self, e: Expr) -> str:
        if e.op == "round" and e.value == "f32":
            return self.vector(e.args[0])
        if e.op == "operand":
            text = self._load(e.value)
        elif e.op == "round":
            text = ROUNDS[e.value].format(self.vector(e.args[0]))
        else:
            text = CALLS[e.op].format(*(self.vector(a) for a in e.args))
        name = f"v{len(self.lines)}"
        self.lines.append(f"const Vec16 {name} = {text};")
        return name

    def _load(self, leaf) -> str:
        v = self.operands[leaf.name]
        home = self.fn.homes[v]
        if leaf.width != self.width:
            raise self.fn.fail(f"{self.node.op} reads {leaf.width} columns of {v} in a pass over {self.width}")
        return f"ld({home.name} + {leaf.start} + j, n)" if leaf.start else f"ld({home.name} + j, n)"

    def loop(self, tail: list[str]) -> list[str]:
        """The pass as a C++ statement, `tail` (stores, a sum) after the body."""
        body = [f"  {line}" for line in self.lines + tail]
        if self.fn.window is None:
            return [f"each_chunk<{self.width}>([&](int64_t j, auto n) {{", *body, "});"]
        if self.width != self.fn.window:
            raise NotColumnLocal(f"a pass over {self.width} columns beside outputs of {self.fn.window}")
        return [f"each_window<{self.width}>(col0, col1, [&](int64_t j, auto n) {{", *body, "});"]


def _leaf_width(e: Expr) -> int | None:
    """The width of the vector leaves under `e` (the first one found; the pass checks the rest)."""
    if e.op == "operand":
        return e.value.width
    return next((w for w in map(_leaf_width, e.args) if w is not None), None)


def _scalar(fn: _Function, node: Node, operands: dict, e: Expr, scalars: dict) -> str:
    """A per-row value (a row sum, or math on row sums and constants) as a Vec16 of the row, defined
    before the pass that reads it; a row sum's own pass comes first."""
    if e.op == "const":
        return const(e.value)
    if fn.window is not None:
        raise NotColumnLocal(f"{node.op} computes a per-row value")
    if e in scalars:
        return scalars[e]
    if e.op == "row_sum":
        width = _leaf_width(e.args[0])
        if width is None:
            raise fn.fail(f"{node.op} sums a row with no operand in it")
        chunk = _Chunk(fn, node, operands, width, scalars)
        total, name = chunk.vector(e.args[0]), fn.name("s")
        fn.lines += [f"Vec16 {name}_acc{{}};", *chunk.loop([f"{name}_acc += keep({total}, n);"]),
                     f"const Vec16 {name} = splat(hsum({name}_acc));"]
    elif e.op == "round" and e.value == "f32":
        name = _scalar(fn, node, operands, e.args[0], scalars)
    else:
        args = [_scalar(fn, node, operands, a, scalars) for a in e.args]
        text = ROUNDS[e.value].format(*args) if e.op == "round" else CALLS[e.op].format(*args)
        name = fn.name("s")
        fn.lines.append(f"const Vec16 {name} = {text};")
    scalars[e] = name
    return name


def _emit_node(fn: _Function, node: Node) -> None:
    """One op: its row sums' passes, then one pass per result width storing every result kept."""
    record = OPS[node.op]
    operands = operands_of(node)
    for v in operands.values():
        if isinstance(v, list) or v not in fn.homes:
            raise fn.fail(f"{node.op} reads {v}, which the unit neither takes nor computes before it")
    row = Row({k: fn.width(v) for k, v in operands.items()}, {k: fn.types[v].dtype for k, v in operands.items()},
              [t.dtype for t in node.types])
    exprs = record.formula(row, node.attrs)
    kept = [i for i in range(len(exprs)) if node.value(i) in fn.homes]
    fn.comment(node)
    scalars: dict = {}
    for width in dict.fromkeys(fn.width(node.value(i)) for i in kept):
        chunk = _Chunk(fn, node, operands, width, scalars)
        stores = []
        for i in (i for i in kept if fn.width(node.value(i)) == width):
            home = fn.homes[node.value(i)]
            value = chunk.vector(exprs[i])            # a typed store rounds; a scratch row is fp32
            value = ROUNDS[home.dtype].format(value) if home.scratch else value
            stores.append(f"st({home.name} + j, {value}, n);")
        fn.lines += chunk.loop(stores)


def _write(unit: KernelUnit, types: dict[Value, TensorType], window: int | None) -> _Function:
    """The function's pointers, scratch rows and body (see module docstring)."""
    fn = _Function(unit, types, window=window)
    for i, v in enumerate(unit.inputs):
        fn.pointer(i, v, f"in{i}", writes=False)
    for i, v in enumerate(unit.outputs):
        fn.pointer(len(unit.inputs) + i, v, f"out{i}", writes=True)
    if not any(len(types[v].shape) == 2 for v in unit.inputs):
        raise fn.fail("no [rows, C] input gives the kernel its rows")
    read_later = {v for node in unit.nodes for v in node.inputs}
    for node in unit.nodes:
        if OPS[node.op].formula is None:
            raise fn.fail(f"op {node.op!r} has no formula to generate a CPU kernel from")
        for i in range(len(node.types)):
            if node.value(i) in read_later and node.value(i) not in fn.homes:
                fn.scratch(node.value(i))
        _emit_node(fn, node)
    return fn


def _text(fn: _Function, name: str, params: str) -> str:
    return "\n".join([
        f"extern \"C\" void {name}({params}) {{",
        "  using namespace llmc_gen;",
        *(f"  {line}" for line in fn.prologue),
        "  for (int64_t r = first; r < last; ++r) {",
        *(f"    {line}" for line in fn.lines),
        "  }",
        "}",
    ])


ROWS = "char* const* ptrs, const int64_t* strides, int64_t first, int64_t last"


def cpp_function_source(unit: KernelUnit, types: dict[Value, TensorType], name: str) -> str:
    """The C++ function of generated unit `unit`, named `name` (see module docstring)."""
    return _text(_write(unit, types, None), name, ROWS)


def cpp_window_source(unit: KernelUnit, types: dict[Value, TensorType], name: str) -> tuple[str, ColumnReads] | None:
    """The window function of `unit`, named `name`, and what it reads; None where the unit is not
    column-local or its outputs differ in width (see module docstring)."""
    widths = {types[v].shape[-1] for v in unit.outputs}
    if len(widths) != 1:
        return None
    try:
        fn = _write(unit, types, widths.pop())
    except NotColumnLocal:
        return None
    starts = tuple(tuple(sorted(fn.starts.get(v, {0}))) for v in unit.inputs)
    return _text(fn, name, ROWS + ", int64_t col0, int64_t col1"), ColumnReads(starts, fn.window)
