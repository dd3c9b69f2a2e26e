"""The step plan's instruction set, described once (kernels/step_plan_isa.py): the encoder takes
every arg by name and refuses a missing, unknown or ill-typed one; opcodes and the generated C++
header's enum both follow the description's order, so reordering it changes the numbering on both
sides and nothing else; C++ that names an arg the description lacks does not compile; the loaded
build's description hash is checked; the C++ side's own checks name the instruction and the arg."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess

import pytest
import torch

from llmc.kernels.native import NativeBuildError, check_isa_hash, load_native_kernels, loaded_isa_hash, write_isa_header
from llmc.kernels.step_plan_isa import (STEP_PLAN_ISA, STEP_PLAN_INSTRUCTIONS, ISAError, InstructionSet, encode,
                                        float_bits)
from llmc.kernels.step_plan_isa_header import HEADER_NAME, enum_name, render_header

GXX = shutil.which("g++") or shutil.which("c++")
needs_compiler = pytest.mark.skipif(GXX is None, reason="no C++ compiler")


def linear_args(**changes) -> dict:
    return dict(dict(out=5, picks=-1, x=1, panels=2, bias=-1, k=64, n=32, num_panels=1), **changes)


def attention_args() -> dict:
    return dict(out=3, q=1, cache=2, block_tables=4, seq_lens=5, layer=0, heads=4, kv_heads=2, head_dim=32, window=0,
                softcap=0.0)


def test_encode_takes_every_arg_by_name_in_the_descriptions_order():
    got = encode("linear", **dict(reversed(linear_args().items())))       # the order given does not matter
    assert got.opcode == STEP_PLAN_ISA.opcodes["linear"] and got.args == [5, -1, 1, 2, -1, 64, 32, 1] and got.f == 0.0
    attention = encode("paged_decode_attention", **attention_args(), scale=0.125)   # the float arg by its meaning
    assert attention.args == [3, 1, 2, 4, 5, 0, 4, 2, 32, 0, 0] and attention.f == 0.125
    capped = encode("paged_decode_attention", **dict(attention_args(), window=4096, softcap=50.0), scale=0.125)
    assert capped.args[-2:] == [4096, float_bits(50.0)]            # a float arg travels as its IEEE-754 bits
    assert struct.unpack("<d", struct.pack("<q", capped.args[-1]))[0] == 50.0
    unit = encode("generated", fn=4096, num_inputs=2, values=[1, 2, 3])
    assert unit.args == [4096, 2, 1, 2, 3]


@pytest.mark.parametrize("name,args,message", [
    ("linear", linear_args(bias=None), r"arg bias \(optional\) of linear is None"),
    ("linear", {k: v for k, v in linear_args().items() if k != "bias"}, r"missing \['bias'\]"),
    ("linear", linear_args(scale=1.0), r"unknown \['scale'\]"),
    ("linear", linear_args(x=-1), r"arg x \(value\) of linear is -1, not an int >= 0"),
    ("linear", linear_args(k=True), r"arg k \(int\) of linear is True, not an int"),
    ("paged_decode_attention", attention_args(), r"missing \['scale'\]"),
    ("paged_decode_attention", dict(attention_args(), softcap=float("inf"), scale=1.0),
     r"arg softcap \(float\) of paged_decode_attention is inf, not a finite number"),
    ("paged_decode_attention", dict(attention_args(), softcap="50", scale=1.0), r"arg softcap \(float\)"),
    ("index_select", dict(out=1, x=0, indices=2, width=16, col=-4), r"unknown \['col'\]"),
    ("rope_kv_write", dict(q_out=1, q=0, k=0, v=0, q_col=-4, k_col=8, v_col=16, row_width=24, cos=2, sin=3,
                           positions=6, cache=4, slots=5, layer=0, heads=1, kv_heads=1, head_dim=8, q_norm=-1, k_norm=-1, norm_span=0,
                           norm_product=0, rotary_dim=8, norm_eps=0.0), r"q_col \(column\)"),
    ("generated", dict(fn=0, num_inputs=1, values=[1, 2]), r"arg fn \(address\) of generated is 0"),
    ("generated", dict(fn=8, num_inputs=1, values=3), r"not a list of value ids"),
    ("gemm", {}, r"no instruction 'gemm'"),
])
def test_encode_refuses_what_the_description_does_not_say(name, args, message):
    with pytest.raises(ISAError, match=message):
        encode(name, **args)


def reordered() -> InstructionSet:
    """The description with its first two instructions swapped."""
    first, second, *rest = STEP_PLAN_INSTRUCTIONS
    return InstructionSet([second, first, *rest])


def enum_of(header: str) -> dict[str, int]:
    return {name: int(n) for name, n in re.findall(r"^  (k\w+) = (\d+),?$", header, re.M) if name != "kNumOps"}


def arg_layouts(header: str) -> set[str]:
    return set(re.findall(r"^namespace \w+ \{ constexpr int [^}]*\}$", header, re.M))


def test_opcodes_and_the_headers_enum_both_follow_the_descriptions_order():
    for isa in (STEP_PLAN_ISA, reordered()):
        header = render_header(isa)
        assert enum_of(header) == {enum_name(ins): i for i, ins in enumerate(isa.instructions)}
        assert isa.opcodes == {ins.name: i for i, ins in enumerate(isa.instructions)}
        assert f'kIsaHash = "{isa.hash()}"' in header


def test_a_reordered_description_renumbers_both_sides_and_changes_nothing_else():
    isa, swapped = STEP_PLAN_ISA, reordered()
    a, b = isa.instructions[0].name, isa.instructions[1].name
    assert (swapped.opcodes[a], swapped.opcodes[b]) == (isa.opcodes[b], isa.opcodes[a])
    assert arg_layouts(render_header(isa)) == arg_layouts(render_header(swapped))     # every arg's index
    rows = dict(out=1, x=0, indices=2, width=16)
    assert swapped.encode("index_select", **rows) == encode("index_select", **rows)     # not one of the two
    assert swapped.encode(a, **_some_args(a)).opcode == enum_of(render_header(swapped))[enum_name(isa[a])] == 1
    assert swapped.hash() != isa.hash()                      # a build of one is refused by the other


def _some_args(name: str) -> dict:
    ins = STEP_PLAN_ISA[name]
    args = {a.name: [0] if a.role == "values" else 1 for a in ins.args}
    return dict(args, **({ins.f: 0.5} if ins.f else {}))


def compile_snippet(tmp_path, body: str) -> subprocess.CompletedProcess:
    """`body` in a C++ file beside the rendered header, checked by the compiler (syntax only)."""
    write_isa_header(tmp_path)
    source = tmp_path / "snippet.cpp"
    source.write_text(f'#include "{HEADER_NAME}"\nusing namespace llmc_plan;\n{body}\n')
    return subprocess.run([GXX, "-std=c++17", "-fsyntax-only", "-I", str(tmp_path), str(source)],
                          capture_output=True, text=True)


@needs_compiler
def test_cpp_naming_an_arg_the_description_lacks_does_not_compile(tmp_path):
    good = compile_snippet(tmp_path, "static_assert(arg::linear::bias == 4 && kFixedArgs[kLinear] == 8);\n"
                                     "static_assert(kVariadic[kGenerated] && arg::generated::values == 2);")
    assert good.returncode == 0, good.stderr
    bad = compile_snippet(tmp_path, "int64_t scale(const int64_t* a) { return a[arg::linear::scale]; }")
    assert bad.returncode != 0 and "scale" in bad.stderr


def test_the_header_is_rewritten_only_when_its_text_changes(tmp_path):
    path = write_isa_header(tmp_path)
    assert path.read_text() == render_header()
    stamp = path.stat().st_mtime_ns
    write_isa_header(tmp_path)
    assert path.stat().st_mtime_ns == stamp and sorted(p.name for p in tmp_path.iterdir()) == [HEADER_NAME]


def test_the_loaded_build_follows_this_description_and_another_is_refused(tmp_path):
    load_native_kernels()
    assert loaded_isa_hash() == STEP_PLAN_ISA.hash()
    check_isa_hash(loaded_isa_hash(), tmp_path)
    with pytest.raises(NativeBuildError, match=f"built for step-plan instruction set {reordered().hash()}, not this "
                                               f"checkout's {STEP_PLAN_ISA.hash()}; delete that folder"):
        check_isa_hash(reordered().hash(), tmp_path)


@pytest.mark.parametrize("opcode,args,message", [
    (99, [], "plan op 99 is not one of step_plan_isa.h's"),
    ("linear", [0, -1, 0, 0, -1, 16, 16], "plan instruction linear takes 8 args, not 7"),
    ("linear", [0, -1, 0, 7, -1, 16, 16, 1], "arg panels of linear is not a value"),
    ("linear", [0, -1, 0, 0, -2, 16, 16, 1], "arg bias of linear is neither -1 nor a value"),
    ("linear", [0, 1, 0, 0, -1, 16, 16, 1], "a GEMM's picks must be an index output (index_output) with the rows"),
    ("generated", [8], "plan instruction generated takes 2 args and a list of values, not 1"),
    ("generated", [8, 0], "a generated kernel of 0 values cannot take 0 of them as inputs and write at least one"),
    ("generated", [8, 1, 0], "cannot take 1 of them as inputs and write at least one"),
    ("generated", [8, 1, 1, 0], "output 0 of a generated kernel is not a temporary or an output"),
])
def test_the_plan_refuses_args_the_description_does_not_allow(opcode, args, message):
    load_native_kernels()
    plan = torch.classes.llmc.StepPlan(False, False)
    plan.input(0, torch.empty(0))                                   # value 0
    plan.constant(torch.ones(16))                                   # value 1
    opcode = STEP_PLAN_ISA.opcodes[opcode] if isinstance(opcode, str) else opcode
    with pytest.raises(RuntimeError, match=re.escape(message)):
        plan.add(opcode, args, 0.0)
