"""The AMX bf16 panel GEMM (kernels/cpu/amx_gemm.h) and the choice of path (kernels/amx.py).

The kernel against the contract's meaning (F.linear in fp32 on the bf16 values, rounded once) at
token counts below, at and across its 16-token tiles and its token blocks, K with and without a tail
below 32 inputs, N within, at and across a panel, with and without bias: as close to float64 as that
ref, rounded to bf16, is (tests/tolerances.py). The AVX-512 fallback, forced with LLMC_CPU_AMX=off,
against the same; a refused tile-state request (the LLMC_AMX_TEST_REFUSE hook, in a fresh process,
since the request is made once per process) falls back with one INFO line that says why. A tiny bf16
Llama through the step plan on AMX and on the forced fallback: the same greedy tokens and logits as
close to an fp32 run of the same weights; llmc inspect names the path. The AMX tests skip, saying
why, where AMX is not usable here.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from llmc.compiler.driver import CompileConfig, compile_model
from llmc.kernels.amx import AMX_MIN_TOKENS, AMX_OVERRIDE, AMX_REFUSE_HOOK, cpu_gemm_path, describe_gemm_path
from llmc.kernels.panels import to_panels
from llmc.runtime.artifact import load_artifact
from llmc.runtime.step_plan import StepPlanProgram
from llmc.tools.inspect import torch_plans
from test_step_plan import decode_steps, executor
from tolerances import assert_as_close_as_ref

BF16 = torch.bfloat16
SHAPES = [(t, k, n) for t in (1, 15, 16, 33, 130) for k in (64, 90, 96, 600, 608) for n in (16, 48, 100)]
SHAPES += [(130, 4096, 48)]      # token blocks of 128 (x of 1 MiB): a second block of 2 tokens


def amx_or_skip() -> None:
    path, why = cpu_gemm_path()
    if path != "amx-bf16" and why != "LLMC_CPU_AMX=off":
        pytest.skip(f"AMX is not usable here: {why}")


def operands(t: int, k: int, n: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).to(BF16)
    w = torch.randn(n, k, generator=g).to(BF16)
    b = torch.randn(n, generator=g).to(BF16) if bias else None
    return x, w, b


def assert_meets_contract(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """got as close to float64 as the fp32 F.linear rounded once to bf16 (the contract's meaning)."""
    want = F.linear(x.float(), w.float(), None if b is None else b.float()).to(BF16)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == BF16 and got.shape == want.shape
    assert_as_close_as_ref(got, want, exact, BF16)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("t,k,n", SHAPES)
def test_amx_gemm_meets_the_panel_contract(t, k, n, bias, monkeypatch):
    monkeypatch.delenv(AMX_OVERRIDE, raising=False)
    amx_or_skip()
    x, w, b = operands(t, k, n, bias)
    assert_meets_contract(torch.ops.llmc.amx_panel_gemm(x, to_panels(w), n, b), x, w, b)


@pytest.mark.parametrize("forced", [False, True])
@pytest.mark.parametrize("t,k,n", [(1, 96, 48), (AMX_MIN_TOKENS, 608, 100), (33, 64, 16), (130, 608, 100)])
def test_panel_gemm_meets_the_contract_on_the_chosen_path(t, k, n, forced, monkeypatch):
    """The op as the executors call it: AMX from AMX_MIN_TOKENS tokens where usable, the AVX-512
    panel kernel below that and wherever LLMC_CPU_AMX=off forces the fallback."""
    if forced:
        monkeypatch.setenv(AMX_OVERRIDE, "off")
        assert cpu_gemm_path()[0] != "amx-bf16"
    else:
        monkeypatch.delenv(AMX_OVERRIDE, raising=False)
    x, w, b = operands(t, k, n, True, seed=1)
    assert_meets_contract(torch.ops.llmc.panel_gemm(x, to_panels(w), n, b), x, w, b)


REFUSED = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
from llmc.kernels.amx import cpu_gemm_path
from llmc.kernels.native import load_native_kernels
from llmc.kernels.panels import to_panels
load_native_kernels()
x, w = torch.randn(40, 96).bfloat16(), torch.randn(48, 96).bfloat16()
got = torch.ops.llmc.panel_gemm(x, to_panels(w), 48, None)
want = torch.nn.functional.linear(x.float(), w.float()).bfloat16()
print(cpu_gemm_path()[0], (got.float() - want.float()).abs().max().item())
"""


def run_refused(script: str) -> tuple[str, float, str]:
    """`script` in a fresh process whose tile-state request the kernel is made to refuse (the test
    hook, no override): (the path it printed, the error it printed, its stderr)."""
    env = dict(os.environ, **{AMX_REFUSE_HOOK: "1"})
    env.pop(AMX_OVERRIDE, None)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    path, err = proc.stdout.split()
    return path, float(err), proc.stderr


def test_a_refused_tile_state_falls_back_with_one_info_line(monkeypatch):
    monkeypatch.delenv(AMX_OVERRIDE, raising=False)
    amx_or_skip()
    path, err, stderr = run_refused(REFUSED)
    assert path == "avx512-bf16" and err <= 0.0625          # one bf16 rounding of values ~8
    said = [line for line in stderr.splitlines() if "bf16 GEMMs run on" in line]
    assert said == ["INFO AMX tile state refused by the kernel (arch_prctl errno 22): bf16 GEMMs run on avx512-bf16"]


@pytest.fixture(scope="module")
def llama_bf16(tiny_family, tmp_path_factory):
    """The tiny Llama (head_dim 32: every graph a step plan) compiled bf16, and its fp32 artifact."""
    _, folder, fp32 = tiny_family("llama_hd32")
    return compile_model(folder, tmp_path_factory.mktemp("amx") / "art", CompileConfig(dtype="bfloat16")), fp32


def test_a_bf16_model_through_the_step_plan_on_amx_and_on_the_fallback(llama_bf16, monkeypatch):
    """Prefill of 4 prompts (97 tokens: AMX), then decode steps of 4 sequences (AMX) in one plan;
    the forced fallback runs the same steps. Both against the fp32 artifact's logits (RMS: the
    rule of tests/test_step_plan.py), and the same greedy token at every step."""
    monkeypatch.delenv(AMX_OVERRIDE, raising=False)
    amx_or_skip()
    bf16, fp32 = (load_artifact(path) for path in llama_bf16)
    lens = [1, 15, 17, 64]
    amx_plan, exact_run = executor(bf16), executor(fp32)
    assert isinstance(amx_plan.programs["decode"], StepPlanProgram)
    amx, exact = decode_steps([amx_plan, exact_run], lens)
    monkeypatch.setenv(AMX_OVERRIDE, "off")
    fallback, = decode_steps([executor(bf16)], lens)
    for got, want, ref in zip(amx, fallback, exact):
        assert_as_close_as_ref(got.float(), want.float(), ref, BF16, norm="rms")
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_inspect_names_the_path_of_a_bf16_artifacts_gemms(llama_bf16, monkeypatch):
    monkeypatch.setenv(AMX_OVERRIDE, "off")
    bf16, fp32 = (torch_plans(path) for path in llama_bf16)
    assert bf16.endswith(f"; {describe_gemm_path()}") and "-bf16 (" in bf16
    assert "bf16 GEMMs" not in fp32                                  # fp32 GEMMs never take AMX
