"""Every Triton kernel compiles for an H100/H200 (sm_90) here, without a GPU, in bf16 and fp16.

kernels/triton/aot_compile.py runs the template launchers, and the generated kernel modules of
artifacts compiled for cuda (compiler/codegen/aot.py), on meta tensors under a Triton driver that
compiles for sm_90 and launches nothing: each kernel is built to a cubin by the wheel's own ptxas
with the arguments a GPU step gives it. That catches what the interpreter lets through (dot
operand types and sizes, broadcasts, pointer casts), and it is the only check of the bf16 GPU path
on a CPU: the interpreter's bf16 dot is wrong, so the interpreted tests give bf16 fp32 dots.
Each check runs in a child process because conftest puts this one's Triton in interpreter mode.
Two checks read the PTX: the int8 KV writer's exact division, and fp16/bf16 dots on tensor cores;
and every compile is loaded as on a GPU, failing on a register spill or shared memory over 227 KiB
(tests/test_triton_spills.py tests that check on its own).
Default: one or two shapes of each template and a tiny model's kernels, in bf16 and fp16, and two
planted bugs (~40-70 s with a cold Triton cache on two busy cores, ~10 s warm); `slow`: every
shape, fp32 too, every M specialization of every GEMM tile, and six tiny artifacts (about 570
compiles, ~4 minutes cold, ~30 s warm).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llmc.compiler.driver import CompileConfig, compile_model
from llmc.compiler.quant_recipe import QuantRecipe
from llmc.kernels.triton.aot_compile import _exact_division, _tensor_core_dots

TEMPLATE_KERNELS = ("_linear_kernel", "_qlinear_kernel", "_rope_kv_write_kernel", "_decode_split_kernel",
                    "_decode_merge_kernel", "_prefill_kernel", "_gather_rows_kernel", "_qembedding_kernel")
COMPILED = re.compile(r"^(OK  |FAIL) (.*?): (\S+)", re.MULTILINE)
REPO = Path(__file__).resolve().parents[1]


def run_child(*argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


def compiled(stdout: str) -> list[tuple[str, str, str]]:
    """(status, case, kernel) of each compile the child printed."""
    return [(status.strip(), case, kernel) for status, case, kernel in COMPILED.findall(stdout)]


def assert_all_ok(run: subprocess.CompletedProcess) -> list[tuple[str, str, str]]:
    done = compiled(run.stdout)
    assert run.returncode == 0 and done and all(status == "OK" for status, _, _ in done), \
        run.stdout[-20000:] + run.stderr[-5000:]
    return done


@pytest.fixture(scope="module")
def cuda_artifact(tiny_family, tmp_path_factory):
    """(family, dtype, quant recipe, disabled passes) -> that tiny model compiled for cuda."""
    cache = {}

    def get(family: str, dtype: str, quant: QuantRecipe = QuantRecipe(), disabled: tuple[str, ...] = ()) -> Path:
        key = (family, dtype, quant, disabled)
        if key not in cache:
            name = f"{family}-{dtype}-{quant.weights}-kv{quant.kv_dtype}" + "-ungrouped" * bool(disabled)
            out = tmp_path_factory.mktemp("aot") / name            # aot_compile labels its cases with the name
            cache[key] = compile_model(tiny_family(family)[1], out, CompileConfig(
                target="cuda", dtype=dtype, quant=quant, disabled_passes=disabled))
        return cache[key]

    return get


def test_templates_and_a_tiny_models_kernels_compile_for_sm90(cuda_artifact):
    """qwen2: its qkv GEMM has a bias; bf16 and fp16, one prefill and one decode step."""
    artifacts = [cuda_artifact("qwen2", dtype) for dtype in ("bfloat16", "float16")]
    done = assert_all_ok(run_child("-m", "llmc.kernels.triton.aot_compile", "--quick", *map(str, artifacts)))
    for dtype in ("bf16", "fp16"):
        kernels = {kernel for _, case, kernel in done if case.startswith(("gemm", "qgemm", "rope", "paged", "gather",
                                                                          "qembedding")) and f" {dtype} " in case}
        assert kernels == set(TEMPLATE_KERNELS), (dtype, kernels)
        assert any(case.startswith(f"paged decode {dtype}") and "int8 cache" in case for _, case, _ in done)
    for artifact in artifacts:           # every generated pointwise module's kernel, compiled for this artifact
        generated = {p.stem + "_kernel" for p in (artifact / "kernels").glob("pointwise_*.py")}
        assert generated and generated <= {kernel for _, case, kernel in done if case.startswith(artifact.name)}


POINTWISE_CHILD = """
import sys
sys.path.insert(0, "tests")
from test_codegen_kernels import CASES, graph_of
from triton.backends.compiler import GPUTarget
from llmc.compiler.codegen.aot import graph_cases
from llmc.kernels.triton.aot_compile import SM90, AheadOfTime, report, summary

aot = AheadOfTime(GPUTarget(*SM90)).install()
for ir_dtype, dtype in (("bf16", "bf16"), ("f16", "fp16")):
    for case in CASES:
        for c in graph_cases({case: graph_of(case, ir_dtype)}, f"{case} {dtype}", dtype, {case: (5,)}):
            for done in aot.run(c):
                print(report(done))
print(summary(aot.compiles))
"""


def test_every_pointwise_op_compiles_for_sm90_in_bf16_and_fp16():
    """The codegen test's graphs (tests/test_codegen_kernels.py CASES: every op pointwise.py lowers,
    split GEMM outputs, GEMM epilogues), which it runs in the interpreter in fp32 and fp16 only."""
    from test_codegen_kernels import CASES

    done = assert_all_ok(run_child("-c", POINTWISE_CHILD))
    for dtype in ("bf16", "fp16"):
        assert {case.split()[0] for _, case, _ in done if case.split()[1] == dtype} == set(CASES)
    assert sum(kernel.startswith("pointwise_") for _, _, kernel in done) >= len(CASES)


PLANTED_KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def narrow_dot_kernel(x_ptr, out_ptr):
    """[16, 8] @ [8, 16]: the interpreter takes it, a GPU's tl.dot needs K >= 16."""
    rows, k = tl.arange(0, 16), tl.arange(0, 8)
    a = tl.load(x_ptr + rows[:, None] * 8 + k[None, :])
    b = tl.load(x_ptr + k[:, None] * 16 + rows[None, :])
    tl.store(out_ptr + rows[:, None] * 16 + rows[None, :], tl.dot(a, b))
'''

PLANTED_CHILD = """
import sys
import torch
from triton.backends.compiler import GPUTarget
from llmc.kernels.triton.aot_compile import SM90, AheadOfTime, Case, report, summary
from llmc.kernels.triton.gemm import _linear_kernel
sys.path.insert(0, sys.argv[1])
from planted import narrow_dot_kernel

def gemm(dot_fp32):      # x [16, 64] @ w.T [64, 64] in bf16; the fp32 upcast is the interpreter's workaround
    x = torch.empty(16, 64, dtype=torch.bfloat16, device="meta")
    _linear_kernel[(1,)](x, x, x, x, x, x, x, x, 16, 64, 64, 64, 1, 64, 1, 0, 0, 64, 1, 0, 0, 0.0, 0.0, HAS_BIAS=False,
                         HAS_RESIDUAL=False, SILU=False, GELU=False, GATED=False, SOFTCAP=False, DOT_FP32=dot_fp32,
                         INPUT_PRECISION="ieee" if dot_fp32 else "tf32", NORM=0, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64,
                         GROUP_M=8)

aot = AheadOfTime(GPUTarget(*SM90)).install()
x = torch.empty(256, dtype=torch.bfloat16, device="meta")
for case in (Case("narrow dot", "bf16", lambda: narrow_dot_kernel[(1,)](x, x)),
             Case("upcast gemm", "bf16", lambda: gemm(True)), Case("bf16 gemm", "bf16", lambda: gemm(False))):
    for c in aot.run(case):
        print(report(c))
print(summary(aot.compiles))
"""


def test_planted_kernel_bugs_fail(tmp_path):
    """Two planted bugs, each one FAIL and not a crash: a dot with K = 8, which the interpreter runs
    (and gets right), and a bf16 GEMM with its dots upcast to fp32 (the interpreter's workaround
    leaking to the GPU), which compiles but takes no bf16 tensor-core instruction; the same GEMM
    with bf16 dots passes."""
    import torch

    (tmp_path / "planted.py").write_text(textwrap.dedent(PLANTED_KERNEL))
    sys.path.insert(0, str(tmp_path))
    try:
        from planted import narrow_dot_kernel
    finally:
        sys.path.remove(str(tmp_path))
    x, out = torch.randn(256), torch.empty(256)
    narrow_dot_kernel[(1,)](x, out)                                       # the interpreter runs it
    torch.testing.assert_close(out.view(16, 16), x[:128].view(16, 8) @ x[:128].view(8, 16))
    run = run_child("-c", PLANTED_CHILD, str(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert compiled(run.stdout) == [("FAIL", "narrow dot", "narrow_dot_kernel"),
                                    ("FAIL", "upcast gemm", "_linear_kernel"), ("OK", "bf16 gemm", "_linear_kernel")], \
        run.stdout
    assert "K >= 16" in run.stdout and "x_ptr is bf16 but no dot compiles to a bf16 tensor-core" in run.stdout
    assert "1 compiles for sm_90 OK (bf16 1) of 1 kernels; 2 failed" in run.stdout


def test_the_ptx_checks_bite():
    div = {"KV_INT8": True}
    assert _exact_division(div, {}, "div.rn.f32 %f1, %f2, %f3;") is None
    assert "div.full.f32" in _exact_division(div, {}, "div.rn.f32 ...; div.full.f32 %f1, %f2, %f3;")
    assert "no div.rn.f32" in _exact_division(div, {}, "mul.f32 %f1, %f2, %f3;")
    assert _exact_division({"KV_INT8": False}, {}, "div.full.f32") is None       # a float cache: no rounding rule
    dots = _tensor_core_dots("x_ptr")
    for instruction in ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}",
                        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f1}"):
        assert dots({}, {"x_ptr": "*bf16"}, instruction) is None
    assert "no dot compiles" in dots({}, {"x_ptr": "*bf16"}, "fma.rn.f32 %f1, %f2, %f3, %f4;")
    assert "no dot compiles" in dots({}, {"x_ptr": "*bf16"}, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32")
    assert dots({}, {"x_ptr": "*fp32"}, "fma.rn.f32 %f1, %f2, %f3, %f4;") is None     # fp32: IEEE FMAs


@pytest.mark.slow
def test_every_template_and_generated_kernel_compiles_for_sm90(cuda_artifact):
    """The whole sweep (each template shape in fp16, bf16 and fp32) and, at a step of each GEMM
    config bucket, the kernels of: qwen2 in bf16, fp16 and fp32; an ungrouped qwen2 (a pointwise
    silu_mul per MLP); int8 weights with an int8 KV cache; int4 weights and embeddings with one."""
    int8 = QuantRecipe.parse("int8", kv_dtype="int8")
    int4 = QuantRecipe.parse("int4-g32", kv_dtype="int8", embeddings=True)
    artifacts = [cuda_artifact("qwen2", dtype) for dtype in ("bfloat16", "float16", "float32")]
    artifacts += [cuda_artifact("qwen2", "bfloat16", disabled=("fusion_grouping",)),
                  cuda_artifact("llama_hd32", "bfloat16", int8), cuda_artifact("llama_hd32", "float16", int4)]
    done = assert_all_ok(run_child("-m", "llmc.kernels.triton.aot_compile", *map(str, artifacts), timeout=1800))
    assert {kernel for _, _, kernel in done} >= set(TEMPLATE_KERNELS)
    for artifact in artifacts:
        generated = {p.stem + "_kernel" for p in (artifact / "kernels").glob("pointwise_*.py")}
        assert generated <= {kernel for _, case, kernel in done if case.startswith(artifact.name)}
