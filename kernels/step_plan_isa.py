"""The step plan's instruction set, described once: each instruction's name, its args in order with
the role of each, and what its one float arg means. Both sides follow from it: `encode` (what
runtime/step_plan.py's lowerings call, naming every arg) and the C++ header that
kernels/cpu/step_plan.h, step_plan.cpp and step_plan_checks.cpp read args through (step_plan_isa_header.py renders it;
kernels/native.py writes it before every build).

Contract: an instruction's opcode is its place in `STEP_PLAN_ISA`; its args travel as one list of
int64 in the order given here, a variadic list of value ids last; `f` is a double, 0.0 where the
instruction has no float arg. `InstructionSet.hash()` names the layout (names, roles, order), so a
build of the C++ side for another description is refused at load (native.py).

Roles: "value" a plan value id; "optional" a value id or -1 (none); "int" an integer; "column" an
element offset within a row; "address" a C function's address; "float" a finite double, travelling
as its IEEE-754 bits in the int64 (`float_bits`; C++ reads it back with step_plan.h's float_arg);
"values" a variadic list of value ids (the last arg only).
"""

from __future__ import annotations

import hashlib
import keyword
import math
import re
import struct
from dataclasses import dataclass

ROLES = ("value", "optional", "int", "column", "address", "float", "values")
NAME = re.compile(r"[a-z][a-z0-9_]*\Z")


class ISAError(ValueError):
    """An instruction named or given args that the description does not have."""


@dataclass(frozen=True)
class Arg:
    name: str
    role: str
    doc: str = ""


@dataclass(frozen=True)
class Instruction:
    """One instruction: `f` names what its float arg means ("" where it has none)."""

    name: str
    args: tuple[Arg, ...]
    f: str = ""
    doc: str = ""

    def __post_init__(self):
        names = [self.name, *(a.name for a in self.args), *([self.f] if self.f else [])]
        for name in names:
            if not NAME.match(name) or keyword.iskeyword(name):
                raise ISAError(f"instruction {self.name}: {name!r} is not a lowercase identifier")
        if len(set(names[1:])) != len(names) - 1:
            raise ISAError(f"instruction {self.name} names an arg twice: {names[1:]}")
        for i, a in enumerate(self.args):
            if a.role not in ROLES or (a.role == "values" and i != len(self.args) - 1):
                raise ISAError(f"instruction {self.name}: arg {a.name} has role {a.role!r}, not one of {ROLES} "
                               "(\"values\" only last)")

    @property
    def variadic(self) -> bool:
        return bool(self.args) and self.args[-1].role == "values"

    @property
    def fixed(self) -> tuple[Arg, ...]:
        """The args before a variadic list (all of them where there is none)."""
        return self.args[:-1] if self.variadic else self.args

    def text(self) -> str:
        args = ", ".join(f"{a.name}:{a.role}" for a in self.args)
        return f"{self.name}({args})" + (f" f={self.f}" if self.f else "")


@dataclass(frozen=True)
class Encoded:
    """One instruction as the plan's `add` takes it."""

    opcode: int
    args: list[int]
    f: float


class InstructionSet:
    """Instructions in opcode order."""

    def __init__(self, instructions: list[Instruction]):
        self.instructions = tuple(instructions)
        self.opcodes = {ins.name: i for i, ins in enumerate(self.instructions)}
        if len(self.opcodes) != len(self.instructions):
            raise ISAError("two instructions share a name")

    def text(self) -> str:
        """One instruction a line, in opcode order: what the hash names."""
        return "\n".join(ins.text() for ins in self.instructions) + "\n"

    def hash(self) -> str:
        return hashlib.sha256(self.text().encode()).hexdigest()[:16]

    def __getitem__(self, name: str) -> Instruction:
        if name not in self.opcodes:
            raise ISAError(f"the step plan has no instruction {name!r}; it has {sorted(self.opcodes)}")
        return self.instructions[self.opcodes[name]]

    def encode(self, name: str, **given) -> Encoded:
        """Instruction `name` with its args (and its float arg) given by name: every one, no other."""
        ins = self[name]
        wanted = [a.name for a in ins.args] + ([ins.f] if ins.f else [])
        missing, unknown = [n for n in wanted if n not in given], sorted(set(given) - set(wanted))
        if missing or unknown:
            raise ISAError(f"instruction {name} takes {wanted}; missing {missing}, unknown {unknown}")
        args = []
        for a in ins.args:
            args.extend(_check_arg(ins, a, given[a.name]))
        return Encoded(self.opcodes[name], args, float(given[ins.f]) if ins.f else 0.0)


def float_bits(x: float) -> int:
    """A double as the int64 of its IEEE-754 bits: how a "float" arg travels."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _check_arg(ins: Instruction, arg: Arg, value) -> list[int]:
    """`value` of `arg` as the ints it travels as, or ISAError naming it."""
    if arg.role == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ISAError(f"arg {arg.name} (float) of {ins.name} is {value!r}, not a finite number")
        return [float_bits(float(value))]
    if arg.role == "values" and not isinstance(value, (list, tuple)):
        raise ISAError(f"arg {arg.name} (values) of {ins.name} is {value!r}, not a list of value ids")
    values = list(value) if arg.role == "values" else [value]
    lowest = {"value": 0, "values": 0, "optional": -1, "column": 0, "address": 1}.get(arg.role)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or (lowest is not None and v < lowest):
            raise ISAError(f"arg {arg.name} ({arg.role}) of {ins.name} is {value!r}, not "
                           f"{'an int' if lowest is None else f'an int >= {lowest}'}")
    return values


def _args(spec: str, **docs: str) -> tuple[Arg, ...]:
    """Args from "name:role ..." (role "value" where none is given), each with its doc if any."""
    pairs = [item.split(":") if ":" in item else (item, "value") for item in spec.split()]
    return tuple(Arg(name, role, docs.get(name, "")) for name, role in pairs)


_ATTN_DOCS = {"window": "0 off; > 0: keys p - window < j <= p only",
              "softcap": "0 off; > 0: scores softcap * tanh(score / softcap)"}
# a GEMM's generated epilogue: the args linear_epilogue and qlinear_epilogue end with, and their docs
_EPILOGUE_ARGS = "fn:address window_fn:address source:int reads:int width:int num_inputs:int values:values"
_EPILOGUE_DOCS = {"fn": "the epilogue's generated kernel (as `generated`)",
                  "window_fn": "its window form (compiler/codegen/cpp.py's NAME_cols)",
                  "source": "which of values is out, the GEMM's result the epilogue reads",
                  "reads": "out's column groups of `width` it reads, at 0, width, ...",
                  "width": "the epilogue's output width, a multiple of 32 (a panel)",
                  "values": "the epilogue's inputs, then its outputs"}
_PICKS_DOC = ("-1: none; an index output [rows]: each row of out's greedy pick (its first largest value, as "
              "torch.argmax), taken as the panels are made")
STEP_PLAN_INSTRUCTIONS = [
    Instruction("embedding", _args("out table ids layout:int vocab:int width:int",
                                   layout="0: rows [V, W]; 1: float panels")),
    Instruction("linear", _args("out picks:optional x panels bias:optional k:int n:int num_panels:int",
                                picks=_PICKS_DOC)),
    Instruction("rope_kv_write", _args("q_out q k v q_col:column k_col:column v_col:column row_width:int cos sin "
                                       "positions cache slots layer:int heads:int kv_heads:int head_dim:int "
                                       "q_norm:optional k_norm:optional norm_span:int norm_product:int "
                                       "rotary_dim:int",
                                       row_width="the elements of a row of q, k and v",
                                       cos="[P, rotary_dim / 2] f32: row p the angles' cosines at position p",
                                       sin="[P, rotary_dim / 2] f32: row p their sines",
                                       positions="[T] int64, each below P: token t turns by row positions[t]",
                                       rotary_dim="the values of a head that turn (head_dim but for a partial "
                                                  "rotary)",
                                       norm_span="q/k norms before the rotation: 0 none, 1 per head, 2 whole row",
                                       norm_product="the norms' rounding: 0 the normed value, then the weight "
                                                    "product; 1 the fp32 product once (compiler/ops/norms.py)"),
                f="norm_eps"),
    Instruction("paged_decode_attention", _args("out q cache block_tables seq_lens layer:int heads:int "
                                                "kv_heads:int head_dim:int window:int softcap:float", **_ATTN_DOCS),
                f="scale"),
    Instruction("qlinear", _args("out picks:optional x codes scales mins:optional bias:optional k:int n:int "
                                 "num_panels:int bits:int group:int layout:int prompts:int",
                                 mins="-1: int8 codes have none", picks=_PICKS_DOC,
                                 layout="0: quantized panels (x widened to fp32); 1: quads (x quantized to int8 "
                                        "per block of 32: kernels/cpu/qdot_gemm.cpp)",
                                 prompts="quads: 1 from 32 rows x rounded to bf16 times the weight dequantized "
                                         "to bf16, on AMX-BF16 where usable (kernels/cpu/amx_dequant_gemm.h); "
                                         "2 from 16 rows x times the weight dequantized to fp32 "
                                         "(kernels/cpu/f32_dequant_gemm.h); 0 int8 at every row count")),
    Instruction("paged_attention", _args("out q cache block_tables seq_lens query_start_loc layer:int heads:int "
                                         "kv_heads:int head_dim:int window:int softcap:float", **_ATTN_DOCS),
                f="scale",
                doc="prompt chunks and decodes mixed; a decode is one query"),
    Instruction("index_select", _args("out x indices width:int"), doc="out row s = x row indices[s]"),
    Instruction("all_reduce", _args("out x width:int size:int", size="the ranks of the plan's process group"),
                doc="out = the sum of x over the ranks (c10d, on the group the plan was given)"),
    Instruction("all_gather", _args("out x width:int size:int", width="the elements of a row of x",
                                    size="the ranks of the plan's process group"),
                doc="out row r = every rank's row r of x side by side, in rank order (the last dim)"),
    Instruction("generated", _args("fn:address num_inputs:int values:values",
                                   fn="a generated kernel's C function (its ABI: runtime/step_plan.py)",
                                   values="the unit's inputs, then its outputs")),
    Instruction("linear_epilogue", _args("out x panels bias:optional k:int n:int num_panels:int " + _EPILOGUE_ARGS,
                                         **_EPILOGUE_DOCS),
                doc="linear, then a column-local generated kernel over its result: on AMX tiles split by "
                    "tokens the kernel runs on each 32 columns as the GEMM makes them (out never written); "
                    "otherwise the GEMM, a barrier, the kernel"),
    Instruction("qlinear_epilogue", _args("out picks:optional x codes scales mins:optional bias:optional k:int n:int "
                                          "num_panels:int bits:int group:int layout:int prompts:int " + _EPILOGUE_ARGS,
                                          picks="-1 (its args before fn are qlinear's, in qlinear's places)",
                                          **_EPILOGUE_DOCS),
                doc="qlinear, then a column-local generated kernel over its result: with f32 prompts on a step "
                    "of 16 or more rows each window's panels are dequantized once and the kernel runs on its 32 "
                    "columns as they are made (out never written); otherwise qlinear, a barrier, the kernel"),
    Instruction("qembedding", _args("out codes scales mins:optional ids layout:int vocab:int width:int bits:int "
                                    "group:int",
                                    layout="0: codes, scales, mins as the artifact stores them [V, ...]; "
                                           "1: quantized panels; 2: quads (kernels/panels.py)",
                                    mins="-1: int8 codes have none"),
                doc="out row t = row ids[t] of the table, dequantized in fp32 (qembedding_ref), then rounded"),
]
STEP_PLAN_ISA = InstructionSet(STEP_PLAN_INSTRUCTIONS)


def encode(name: str, **args) -> Encoded:
    """STEP_PLAN_ISA.encode: instruction `name` with every arg given by name."""
    return STEP_PLAN_ISA.encode(name, **args)
