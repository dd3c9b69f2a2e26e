"""A prompt's quantized GEMM on AMX-BF16 (kernels/cpu/amx_dequant_gemm.h: x and the weight its quads
hold rounded to bf16, products summed in fp32) and the choice of it (`bf16` activations).

The kernel against kernels/quant.py's qlinear_bf16_ref (float64 sums of the same bf16 products) at
token counts below, at and across its 16-token tiles, across its token blocks and its chunks of
panels, int8 per channel and in groups, int4 in groups of 32 and 128, N within and across a panel,
bias, bf16 x. Each product of two bf16 values is exact in fp32, so the kernel differs from the ref
only by fp32's rounding of its K-term sums: tests/tolerances.py's fp32 bound over K terms (bf16 x:
one bf16 rounding of the output). The op as the executors call it (qdot_gemm with prompts 1)
takes it from PROMPT_MIN_TOKENS tokens where AMX-BF16 is usable and equals the int8-activation
kernel below that and wherever LLMC_CPU_AMX=off forces it; on every CPU. A tiny int8 / int4 model's
prefill through the step plan with bf16 prompts: near float activations (closer than int8's
bound), the int8 path's logits at a step below 32 tokens, and the executor's kernel line. The
activations choice: auto takes bf16 where AMX-BF16 is usable, `bf16` without it says why at INFO.
The AMX tests skip, saying why, without AMX-BF16."""

from __future__ import annotations

import logging

import pytest
import torch

from llmc.kernels.amx import AMX_OVERRIDE
from llmc.kernels.gemv import PROMPT_MIN_TOKENS
from llmc.kernels.native_ops import choose_activations
from llmc.kernels.quant import qlinear_bf16_ref, qlinear_int8act_ref
from llmc.runtime.step_plan import StepPlanProgram
import test_amx_qgemm
import test_int8_activations
from test_int8_activations import executor
from tolerances import tolerance

pytestmark = pytest.mark.usefixtures("native_kernels_built")
tiny_quantized = test_int8_activations.tiny_quantized        # the fixture: a tiny Llama compiled per recipe

# (N, K, bits, group): group None is int8's one scale per output channel
SHAPES = [(45, 96, 8, None), (40, 192, 8, 64), (70, 256, 4, 32), (33, 256, 4, 128)]
TOKENS = [1, 15, 16, 17, 33, 50]


def prompt_path() -> tuple[str, str]:
    path, why = torch.ops.llmc.cpu_prompt_qgemm_path()
    return path, why


def amx_bf16_or_skip() -> None:
    path, why = prompt_path()
    if path != "amx-bf16":
        pytest.skip(f"AMX-BF16 is not usable here: {why}")


def operands(n: int, k: int, bits: int, group: int | None, tokens: int, dtype=torch.float32):
    """test_amx_qgemm's operands, the quads with bf16 prompts."""
    return test_amx_qgemm.operands(n, k, bits, group, tokens, dtype, activations="bf16")


def assert_meets_the_ref(got: torch.Tensor, weight, x: torch.Tensor, bias: torch.Tensor, bits: int) -> None:
    codes, scales, mins, _ = weight
    exact = qlinear_bf16_ref(x.double(), codes, scales, mins, bias.double(), bits=bits)
    terms = 1 if x.dtype == torch.bfloat16 else x.shape[1]                 # bf16: one rounding of the output
    assert got.dtype == x.dtype and got.shape == exact.shape
    torch.testing.assert_close(got.double(), exact, **tolerance(x.dtype, terms, scale=exact.abs().max().item()))


def amx_bf16(x, w, n, bias, bits) -> torch.Tensor:
    return torch.ops.llmc.amx_bf16_qgemm(x, w.weight, w.scales, w.mins, n, bias, bits, w.group_size)


def chosen(x, w, n, bias, bits, prompts=1) -> torch.Tensor:
    return torch.ops.llmc.qdot_gemm(x, w.weight, w.scales, w.mins, n, bias, bits, w.group_size, True, prompts)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("n,k,bits,group", SHAPES)
def test_amx_kernel_matches_the_bf16_ref(n, k, bits, group, tokens, monkeypatch):
    monkeypatch.delenv(AMX_OVERRIDE, raising=False)
    amx_bf16_or_skip()
    weight, w, x, bias = operands(n, k, bits, group, tokens)
    assert_meets_the_ref(amx_bf16(x, w, n, bias, bits), weight, x, bias, bits)


@pytest.mark.parametrize("bits,group", [(8, None), (4, 32)])
def test_amx_kernel_bf16_x_token_blocks_and_panel_chunks(bits, group, monkeypatch):
    """K 4096: token blocks of 128 (x of 1 MiB) and chunks of 2 panels (512 KiB of bf16), so 140
    tokens meet a second block of 12 and N 200 (7 panels) chunks of 2, 2, 2 and 1; bf16 x at K 128."""
    monkeypatch.delenv(AMX_OVERRIDE, raising=False)
    amx_bf16_or_skip()
    for n, tokens, k, dtype in ((48, 20, 128, torch.bfloat16), (200, 140, 4096, torch.float32)):
        weight, w, x, bias = operands(n, k, bits, group, tokens, dtype)
        assert_meets_the_ref(amx_bf16(x, w, n, bias, bits), weight, x, bias, bits)


@pytest.mark.parametrize("forced", [False, True])
@pytest.mark.parametrize("tokens", [1, PROMPT_MIN_TOKENS - 1, PROMPT_MIN_TOKENS, 70])
def test_the_op_takes_bf16_for_a_prompt_where_amx_is_usable(tokens, forced, monkeypatch):
    """On every CPU: below PROMPT_MIN_TOKENS, where LLMC_CPU_AMX=off forces it and where AMX-BF16 is
    not usable, the int8-activation kernel's numbers bit for bit (and its ref); else the AMX kernel's."""
    monkeypatch.delenv(AMX_OVERRIDE, raising=False)
    if forced:
        unforced = prompt_path()                                 # where AMX is not usable, its reason comes first
        monkeypatch.setenv(AMX_OVERRIDE, "off")
        assert prompt_path() == ("", "LLMC_CPU_AMX=off" if unforced[0] == "amx-bf16" else unforced[1])
    bf16 = tokens >= PROMPT_MIN_TOKENS and prompt_path()[0] == "amx-bf16"
    for n, k, bits, group in SHAPES[1:3]:
        weight, w, x, bias = operands(n, k, bits, group, tokens)
        got = chosen(x, w, n, bias, bits)
        if bf16:
            assert torch.equal(got, amx_bf16(x, w, n, bias, bits))
            continue
        assert torch.equal(got, chosen(x, w, n, bias, bits, prompts=0))
        codes, scales, mins, g = weight
        exact = qlinear_int8act_ref(x.double(), codes, scales, mins, bias.double(), bits=bits)
        torch.testing.assert_close(got.double(), exact, **tolerance(torch.float32, k // 32 + k // g,
                                                                    scale=exact.abs().max().item()))


def test_auto_activations_take_bf16_prompts_where_amx_bf16_is_usable(monkeypatch, caplog):
    """bf16 prompts where AMX-BF16 is usable, else int8 where the integer dots are AVX512-VNNI's or
    AVX2's, float without either."""
    monkeypatch.delenv(AMX_OVERRIDE, raising=False)
    isa = torch.ops.llmc.qdot_isa()
    vnni = isa != "portable"
    without_amx = "float" if isa == "portable" else "int8"
    want = "bf16" if vnni and prompt_path()[0] == "amx-bf16" else without_amx
    assert choose_activations("auto") == want
    monkeypatch.setenv(AMX_OVERRIDE, "off")
    with caplog.at_level(logging.INFO, logger="llmc"):
        assert choose_activations("bf16") == "int8"
    why = prompt_path()[1]                                   # LLMC_CPU_AMX=off, or the CPU's lack first
    assert f"a prompt's quantized GEMMs keep int8 activations: {why}" in caplog.text
    assert choose_activations("auto") == without_amx
    assert choose_activations("f32") == "f32" and choose_activations("int8") == "int8"


@pytest.mark.parametrize("recipe", ["int8", "int4-g32"])
def test_tiny_model_prefill_with_bf16_prompts(tiny_quantized, recipe, monkeypatch):
    """A prefill step of 3 sequences (52 tokens) through the step plan: bf16 prompts against float
    activations within a relative rms bound of bf16 rounding (2^-8 per GEMM input over the 9 GEMMs
    of int8's bound, which is 2x as wide), and a 20-token step gives int8's logits bit for bit."""
    from llmc.runtime.model_runner import build_step_inputs
    from llmc.runtime.scheduler import Chunk
    from test_step_plan import sequences

    monkeypatch.delenv(AMX_OVERRIDE, raising=False)
    amx_bf16_or_skip()
    art = tiny_quantized(recipe)
    bf16, int8, flt = executor(art, "bf16"), executor(art, "int8"), executor(art, "float")
    assert isinstance(bf16.programs["prefill"], StepPlanProgram)
    assert f"bf16 prompts (amx-bf16 from {PROMPT_MIN_TOKENS} tokens)" in bf16.capabilities().kernels
    rms = lambda t: t.double().square().mean().sqrt().item()     # noqa: E731
    seqs, blocks = sequences([5, 17, 30])
    step = build_step_inputs([Chunk(s, 0, s.num_tokens) for s in seqs], blocks)
    got, want = bf16.run("prefill", step), flt.run("prefill", step)
    assert 0 < rms(got - want) <= 9 * 2.0**-8 * rms(want)
    seqs, blocks = sequences([4, 16])
    small = build_step_inputs([Chunk(s, 0, s.num_tokens) for s in seqs], blocks)
    assert torch.equal(bf16.run("prefill", small), int8.run("prefill", small))
