"""The CPU back end: every generated CPU unit (cpu_units.py) of the lowered graphs as a C++ function,
all of them in one translation unit that the artifact keeps as kernels/cpu/generated.cpp.

Functions with the same body are one function, named after their ops and a digest of the body
(as codegen/__init__.py names Triton modules), so the 30 layers of a model share a handful; each
function's comment lists the IR lines of the units it serves. `lower_cpu(graphs)` is
deterministic: the compiler writes its source into the artifact, and the runtime lowers the
artifact's IR again to know which function each unit calls and to check that the file is the one
this llmc generates (runtime/cpu_program.py). Template units (GEMMs, attention, RoPE + KV write,
gathers) call no generated function: their plan entry is None. A column-local function also has
its window form, NAME_cols (cpp.py), listed in `windows` with what it reads.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from llmc.compiler.ir import Graph, TensorType, Value

from .cpp import INCLUDE, ColumnReads, cpp_function_source, cpp_window_source
from .cpu_units import cpu_units, is_generated
from .units import KernelUnit

MAX_LISTED_UNITS = 6
PLACEHOLDER = "LLMC_KERNEL"


@dataclass(frozen=True)
class CpuLowering:
    functions: dict[str, str]                    # function name -> its C++ (comment and definition)
    plan: dict[str, list[str | None]]            # graph entry -> each CPU unit's function (None: a template)
    units: dict[str, list[KernelUnit]]           # graph entry -> its CPU units in launch order
    windows: dict[str, ColumnReads] = field(default_factory=dict)   # function -> what its NAME_cols reads

    def units_of(self, function: str) -> list[KernelUnit]:
        return [u for entry, names in self.plan.items() for u, n in zip(self.units[entry], names) if n == function]

    def source(self) -> str:
        """The translation unit: every function, in the order they were first needed."""
        head = ["// Generated CPU kernels: written by llmc codegen (compiler/codegen/cpp.py) from the artifact's IR;",
                "// do not edit (the artifact's manifest hashes this file, and the runtime checks it is what its llmc",
                f"// generates). {len(self.functions)} function(s); their ABI is compiler/codegen/cpp.py's contract.",
                "#include <cstdint>", "", INCLUDE]
        return "\n".join(head) + "".join(f"\n\n{text}" for text in self.functions.values()) + "\n"


def _types(graph: Graph) -> dict[Value, TensorType]:
    return {node.value(i): t for node in graph.nodes for i, t in enumerate(node.types)}


def _comment(name: str, units: list[KernelUnit]) -> str:
    lines = [f"// {name}: serves {len(units)} unit(s)"]
    for unit in units[:MAX_LISTED_UNITS]:
        lines += ["//", f"// {unit.label}:", *(f"//     {line}" for line in unit.ir_lines())]
    if len(units) > MAX_LISTED_UNITS:
        rest = ", ".join(f"{u.entry} {u.index}" for u in units[MAX_LISTED_UNITS:])
        lines += ["//", f"// and the same ops with the same shapes in units {rest}"]
    return "\n".join(lines)


def lower_cpu(graphs: dict[str, Graph]) -> CpuLowering:
    """A C++ function for every generated CPU unit of `graphs` (CodegenError names one it cannot write)."""
    bodies: dict[str, str] = {}                         # body text -> function name
    windows: dict[str, tuple[str, ColumnReads] | None] = {}     # body text -> its window form
    plan: dict[str, list[str | None]] = {}
    units = {entry: cpu_units(graph) for entry, graph in graphs.items()}
    for entry, graph in graphs.items():
        types = _types(graph)
        plan[entry] = []
        for unit in units[entry]:
            if not is_generated(unit):
                plan[entry].append(None)
                continue
            body = cpp_function_source(unit, types, PLACEHOLDER)
            if body not in bodies:
                ops = "_".join(dict.fromkeys(n.op for n in unit.nodes))
                bodies[body] = f"llmc_{ops}_{hashlib.sha256(body.encode()).hexdigest()[:8]}"
                windows[body] = cpp_window_source(unit, types, PLACEHOLDER + "_cols")
            plan[entry].append(bodies[body])
    lowering = CpuLowering({}, plan, units)
    for body, name in bodies.items():
        text = _comment(name, lowering.units_of(name)) + "\n" + body.replace(PLACEHOLDER, name)
        if windows[body] is not None:
            window, reads = windows[body]
            text += "\n\n" + window.replace(PLACEHOLDER, name)
            lowering.windows[name] = reads
        lowering.functions[name] = text
    return lowering
