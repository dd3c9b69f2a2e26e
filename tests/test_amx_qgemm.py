"""The int8-activation GEMM on AMX-INT8 tiles (kernels/cpu/amx_qgemm.h) and the choice of path
(kernels/amx.py's cpu_qgemm_path).

The AMX kernel against kernels/quant.py's qlinear_int8act_ref (float64) at token counts below, at
and across its 16-token tiles and its token blocks, int8 per channel and in groups, int4 in groups
of 32 and 128, N within and across a panel, bias, bf16 x. Its integer part is exact (int32 dots of
codes per block of 32 inputs), so it differs from the float64 ref only by fp32's rounding of one
product per block and of the sums over blocks and groups: tests/tolerances.py's fp32 bound over
K/32 + K/G terms, as for the VNNI kernel. Beyond that the claim is bit-for-bit: AMX does the VNNI
kernel's fp32 operations in its order on the same int32 dots, so both paths give equal outputs.
The op as the executors call it (AMX from AMX_INT8_MIN_TOKENS tokens, VNNI below and wherever
LLMC_CPU_AMX=off forces it) meets the ref on every CPU; a refused tile-state request (the
LLMC_AMX_TEST_REFUSE hook, in a fresh process) falls back with one INFO line that says why; a tiny
int4 Llama's prefill through the step plan gives the same logits on AMX and on the forced fallback,
and its executor's kernel line names the path. The AMX tests skip, saying why, without AMX-INT8.
"""

from __future__ import annotations

import pytest
import torch

from llmc.kernels.amx import (AMX_INT8_MIN_TOKENS, AMX_OVERRIDE, cpu_qgemm_path,
                              describe_qgemm_path)
from llmc.kernels.gemv import prepare_qlinear_weight
from llmc.kernels.quant import qlinear_int8act_ref
from llmc.runtime.step_plan import StepPlanProgram
import test_int8_activations
from test_amx_gemm import run_refused
from test_int8_activations import executor, quantized
from tolerances import tolerance

pytestmark = pytest.mark.usefixtures("native_kernels_built")
tiny_quantized = test_int8_activations.tiny_quantized        # the fixture: a tiny Llama compiled per recipe

# (N, K, bits, group): group None is int8's one scale per output channel
SHAPES = [(45, 96, 8, None), (40, 192, 8, 64), (70, 256, 4, 32), (33, 256, 4, 128)]
TOKENS = [1, 15, 16, 17, 33, 50]


def amx_int8_or_skip() -> None:
    path, why = cpu_qgemm_path()
    if path != "amx-int8" and why != "LLMC_CPU_AMX=off":
        pytest.skip(f"AMX-INT8 is not usable here: {why}")


def operands(n: int, k: int, bits: int, group: int | None, tokens: int, dtype=torch.float32, activations="int8"):
    """(quantized weight, its quads for `activations`, x, bias) with x ~ 3 N(0, 1) and a bias, in `dtype`."""
    codes, scales, mins, g = quantized(n, k, bits, group)
    w = prepare_qlinear_weight(codes, scales, mins, bits=bits, group_size=g, activations=activations)
    x = (torch.randn(tokens, k, generator=torch.Generator().manual_seed(tokens)) * 3).to(dtype)
    return (codes, scales, mins, g), w, x, torch.randn(n).to(dtype)


def assert_meets_the_ref(got: torch.Tensor, weight, x: torch.Tensor, bias: torch.Tensor, bits: int) -> None:
    codes, scales, mins, g = weight
    exact = qlinear_int8act_ref(x.double(), codes, scales, mins, bias.double(), bits=bits)
    k = x.shape[1]
    terms = 1 if x.dtype == torch.bfloat16 else k // 32 + k // g           # bf16: one rounding of the output
    assert got.dtype == x.dtype and got.shape == exact.shape
    torch.testing.assert_close(got.double(), exact, **tolerance(x.dtype, terms, scale=exact.abs().max().item()))


def vnni_path(x, w, n, bias, bits, monkeypatch) -> torch.Tensor:
    monkeypatch.setenv(AMX_OVERRIDE, "off")
    try:
        return torch.ops.llmc.qdot_gemm(x, w.weight, w.scales, w.mins, n, bias, bits, w.group_size, True)
    finally:
        monkeypatch.delenv(AMX_OVERRIDE)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("n,k,bits,group", SHAPES)
def test_amx_kernel_matches_the_ref_and_the_vnni_path(n, k, bits, group, tokens, monkeypatch):
    monkeypatch.delenv(AMX_OVERRIDE, raising=False)
    amx_int8_or_skip()
    weight, w, x, bias = operands(n, k, bits, group, tokens)
    got = torch.ops.llmc.amx_qdot_gemm(x, w.weight, w.scales, w.mins, n, bias, bits, w.group_size)
    assert_meets_the_ref(got, weight, x, bias, bits)
    assert torch.equal(got, vnni_path(x, w, n, bias, bits, monkeypatch))


@pytest.mark.parametrize("bits,group", [(8, None), (4, 32)])
def test_amx_kernel_bf16_x_and_a_second_token_block(bits, group, monkeypatch):
    """K 4096: token blocks of 64 (x codes of 256 KiB), so 70 tokens meet a second block of 6."""
    monkeypatch.delenv(AMX_OVERRIDE, raising=False)
    amx_int8_or_skip()
    for tokens, k, dtype in ((20, 128, torch.bfloat16), (70, 4096, torch.float32)):
        weight, w, x, bias = operands(48, k, bits, group, tokens, dtype)
        got = torch.ops.llmc.amx_qdot_gemm(x, w.weight, w.scales, w.mins, 48, bias, bits, w.group_size)
        assert_meets_the_ref(got, weight, x, bias, bits)
        assert torch.equal(got, vnni_path(x, w, 48, bias, bits, monkeypatch))


@pytest.mark.parametrize("forced", [False, True])
@pytest.mark.parametrize("tokens", [1, AMX_INT8_MIN_TOKENS - 1, AMX_INT8_MIN_TOKENS, 70])
def test_qdot_gemm_meets_the_ref_on_the_chosen_path(tokens, forced, monkeypatch):
    """The op as the executors call it, on every CPU: AMX from AMX_INT8_MIN_TOKENS tokens where
    usable, the VNNI (or portable) kernel below that and wherever LLMC_CPU_AMX=off forces it."""
    if forced:
        monkeypatch.setenv(AMX_OVERRIDE, "off")
        assert cpu_qgemm_path()[0] != "amx-int8"
    else:
        monkeypatch.delenv(AMX_OVERRIDE, raising=False)
    for n, k, bits, group in SHAPES[1:3]:
        weight, w, x, bias = operands(n, k, bits, group, tokens)
        got = torch.ops.llmc.qdot_gemm(x, w.weight, w.scales, w.mins, n, bias, bits, w.group_size, True)
        assert_meets_the_ref(got, weight, x, bias, bits)


REFUSED = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
from llmc.kernels.amx import cpu_qgemm_path
from llmc.kernels.native import load_native_kernels
from llmc.kernels.gemv import prepare_qlinear_weight
from llmc.kernels.quant import qlinear_int8act_ref, quantize_int4
load_native_kernels()
codes, scales, mins = quantize_int4(torch.randn(48, 128), 32)
w = prepare_qlinear_weight(codes, scales, mins, bits=4, group_size=32, activations="int8")
x = torch.randn(40, 128)
got = torch.ops.llmc.qdot_gemm(x, w.weight, w.scales, w.mins, 48, None, 4, 32, True)
want = qlinear_int8act_ref(x.double(), codes, scales, mins, bits=4)
print(cpu_qgemm_path()[0], (got.double() - want).abs().max().item() / want.abs().max().item())
"""


def test_a_refused_tile_state_falls_back_with_one_info_line(monkeypatch):
    monkeypatch.delenv(AMX_OVERRIDE, raising=False)
    amx_int8_or_skip()
    path, err, stderr = run_refused(REFUSED)
    assert path == "avx512-vnni" and err <= 1e-5                 # fp32 sums over 8 terms, relative
    said = [line for line in stderr.splitlines() if "int8-activation GEMMs run on" in line]
    assert said == ["INFO AMX tile state refused by the kernel (arch_prctl errno 22): "
                    "int8-activation GEMMs run on avx512-vnni"]


def test_an_int4_prefill_through_the_step_plan_on_amx_and_on_the_fallback(tiny_quantized, monkeypatch):
    """A prefill step of 3 sequences (52 tokens: AMX) through the step plan: the same logits as the
    forced VNNI fallback (the bit-for-bit claim), and the executor's kernel line names the path."""
    from llmc.runtime.model_runner import build_step_inputs
    from llmc.runtime.scheduler import Chunk
    from test_step_plan import sequences

    monkeypatch.delenv(AMX_OVERRIDE, raising=False)
    amx_int8_or_skip()
    art = tiny_quantized("int4-g32")
    seqs, blocks = sequences([5, 17, 30])
    step = build_step_inputs([Chunk(s, 0, s.num_tokens) for s in seqs], blocks)
    amx = executor(art, "int8")
    assert isinstance(amx.programs["prefill"], StepPlanProgram)
    assert f"int8 activations (amx-int8 from {AMX_INT8_MIN_TOKENS} tokens" in amx.capabilities().kernels
    got = amx.run("prefill", step)
    monkeypatch.setenv(AMX_OVERRIDE, "off")
    fallback = executor(art, "int8")
    assert f"int8 activations ({describe_qgemm_path()})" in fallback.capabilities().kernels
    assert "no AMX-INT8: LLMC_CPU_AMX=off" in fallback.capabilities().kernels
    assert torch.equal(got, fallback.run("prefill", step))
