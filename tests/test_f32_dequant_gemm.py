"""A prompt's quantized GEMM in fp32 (kernels/cpu/f32_dequant_gemm.h: x times the weight its quads hold,
dequantized to fp32 once per call, in the float panel GEMM's tiles) and the choice of it (`f32`
activations).

The op with prompts 2 against kernels/quant.py's qlinear_ref (float64 sums of the same weight) from
F32_PROMPT_MIN_TOKENS tokens on, at token counts within and across the float tiles and token blocks,
across chunks of panels, int8 per channel and in groups, int4 in groups of 32 and 128, N within and
across a panel, bias, bf16 x: fp32 sums over K terms (tests/tolerances.py; bf16 x: one rounding of
the output), a bound int8 activations' rounding misses by far, so it also shows which path ran. Below
F32_PROMPT_MIN_TOKENS the int8-activation kernel's numbers bit for bit. A tiny int8 / int4 model's
prefill and decode steps through the step plan with f32 prompts against float activations (whose
meaning is the same qlinear: only fp32 rounding apart), a step below 16 tokens as int8's, and the
executor's kernel line; the gate_up GEMM fused with its SiLU (qlinear_epilogue) against op by op, bit
for bit, in an fp32 and a bf16 model. On every CPU."""

from __future__ import annotations

import pytest
import torch

from llmc.kernels.gemv import F32_PROMPT_MIN_TOKENS, gemv_ref
from llmc.kernels.quant import qlinear_ref
from llmc.runtime.step_plan import StepPlanProgram
import test_amx_qgemm
import test_int8_activations
from tolerances import tolerance

pytestmark = pytest.mark.usefixtures("native_kernels_built")
tiny_quantized = test_int8_activations.tiny_quantized   # the fixture: a tiny Llama per recipe (and dtype)

# (N, K, bits, group): group None is int8's one scale per output channel
SHAPES = [(45, 96, 8, None), (40, 192, 8, 64), (70, 256, 4, 32), (33, 256, 4, 128)]


def operands(n: int, k: int, bits: int, group: int | None, tokens: int, dtype=torch.float32):
    """test_amx_qgemm's operands, the quads with f32 prompts."""
    return test_amx_qgemm.operands(n, k, bits, group, tokens, dtype, activations="f32")


def executor(art, activations: str, step_plans: bool = True):
    """test_int8_activations' executor with room for 17 sequences (a block each) and 3 longer prompts."""
    return test_int8_activations.executor(art, activations, num_blocks=32, step_plans=step_plans)


def f32_prompts(x, w, n, bias, bits, prompts=2) -> torch.Tensor:
    return torch.ops.llmc.qdot_gemm(x, w.weight, w.scales, w.mins, n, bias, bits, w.group_size, True, prompts)


def assert_meets_qlinear(got: torch.Tensor, weight, x: torch.Tensor, bias: torch.Tensor, bits: int) -> None:
    codes, scales, mins, _ = weight
    exact = qlinear_ref(x.double(), codes, scales, mins, bias.double(), bits=bits)
    terms = 1 if x.dtype == torch.bfloat16 else x.shape[1]                 # bf16: one rounding of the output
    assert got.dtype == x.dtype and got.shape == exact.shape
    torch.testing.assert_close(got.double(), exact, **tolerance(x.dtype, terms, scale=exact.abs().max().item()))


@pytest.mark.parametrize("tokens", [F32_PROMPT_MIN_TOKENS, 17, 50])
@pytest.mark.parametrize("n,k,bits,group", SHAPES)
def test_kernel_matches_qlinear(n, k, bits, group, tokens):
    weight, w, x, bias = operands(n, k, bits, group, tokens)
    got = f32_prompts(x, w, n, bias, bits)
    assert_meets_qlinear(got, weight, x, bias, bits)
    torch.testing.assert_close(got, gemv_ref(x, w, bias), **tolerance(torch.float32, k, scale=got.abs().max().item()))


@pytest.mark.parametrize("bits,group", [(8, None), (4, 32)])
def test_kernel_token_blocks_panel_chunks_and_bf16_x(bits, group):
    """K 4096: a panel (512 KiB of fp32) is more than a chunk, so every chunk is one panel, and token
    blocks of 16 (x of 256 KiB), so 40 tokens meet three; K 576: chunks of 3 panels, N 200 (7 panels) as
    3, 3 and 1 per thread's range; bf16 x (widened, out rounded once) at K 128."""
    for n, tokens, k, dtype in ((200, 40, 4096, torch.float32), (200, 23, 576, torch.float32),
                                (48, 20, 128, torch.bfloat16)):
        weight, w, x, bias = operands(n, k, bits, group, tokens, dtype)
        assert_meets_qlinear(f32_prompts(x, w, n, bias, bits), weight, x, bias, bits)


@pytest.mark.parametrize("tokens", [1, 7, F32_PROMPT_MIN_TOKENS - 1])
def test_below_the_prompt_tokens_the_op_is_int8s(tokens):
    for n, k, bits, group in SHAPES[1:3]:
        _, w, x, bias = operands(n, k, bits, group, tokens)
        assert torch.equal(f32_prompts(x, w, n, bias, bits), f32_prompts(x, w, n, bias, bits, prompts=0))


def test_the_op_refuses_an_unknown_prompts_value():
    _, w, x, bias = operands(40, 192, 8, 64, 16)
    with pytest.raises(RuntimeError, match="prompts must be 0 \\(int8\\), 1 \\(bf16\\) or 2 \\(f32\\), not 3"):
        f32_prompts(x, w, 40, bias, 8, prompts=3)


@pytest.mark.parametrize("recipe", ["int8", "int4-g32"])
def test_tiny_model_steps_with_f32_prompts(tiny_quantized, recipe):
    """Through the step plan, f32 prompts against float activations (the same qlinear meaning): decode
    steps of 17 sequences, every GEMM of 17 rows, give logits fp32 rounding apart, far below int8
    activations' 2^-7 per GEMM input; a prefill step of 3 sequences (52 tokens) differs by the LM head's
    int8 activations only (3 rows), under half of what int8 activations in all 9 GEMMs move; and a
    14-token prefill step gives int8's logits bit for bit."""
    from llmc.runtime.model_runner import build_step_inputs
    from llmc.runtime.scheduler import Chunk
    from test_step_plan import decode_steps, sequences

    art = tiny_quantized(recipe)
    f32, int8, flt = executor(art, "f32"), executor(art, "int8"), executor(art, "float")
    assert isinstance(f32.programs["prefill"], StepPlanProgram)
    assert isinstance(f32.programs["decode"], StepPlanProgram)
    assert f"f32 prompts (fp32 from {F32_PROMPT_MIN_TOKENS} tokens)" in f32.capabilities().kernels
    rms = lambda t: t.double().square().mean().sqrt().item()     # noqa: E731
    seqs, blocks = sequences([5, 17, 30])
    step = build_step_inputs([Chunk(s, 0, s.num_tokens) for s in seqs], blocks)
    got, want = f32.run("prefill", step), flt.run("prefill", step)
    print(rms(got - want) / rms(want), rms(int8.run("prefill", step) - want) / rms(want))
    assert rms(got - want) <= 2.0**-7 * rms(want)
    assert rms(got - want) < rms(int8.run("prefill", step) - want) / 2
    for got, want in zip(*decode_steps([f32, flt], [3 + i // 2 for i in range(17)], steps=2, num_blocks=32)):
        assert rms(got - want) <= 2.0**-16 * rms(want)
    seqs, blocks = sequences([4, 10])
    small = build_step_inputs([Chunk(s, 0, s.num_tokens) for s in seqs], blocks)
    assert torch.equal(f32.run("prefill", small), int8.run("prefill", small))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("recipe", ["int8", "int4-g32"])
def test_gate_up_with_its_silu_in_the_plan_bit_for_bit(tiny_quantized, recipe, dtype):
    """The plan runs each layer's gate_up qlinear with the SiLU x up after it as one qlinear_epilogue
    (with f32 prompts from 16 rows: each window's gate and up panels dequantized, the product made a
    few rows at a time; a bf16 model's x widened, the GEMM's result rounded to bf16 before the SiLU
    reads it); op by op the GEMM writes its result and silu_mul reads it. The same logits bit for bit:
    a prefill of 52 tokens, decode steps of 17 sequences (fused) and of 3 (GEMM, barrier, SiLU)."""
    from llmc.runtime.model_runner import build_step_inputs
    from llmc.runtime.scheduler import Chunk
    from test_step_plan import decode_steps, sequences

    art = tiny_quantized(recipe, dtype)
    plan, ops = executor(art, "f32"), executor(art, "f32", step_plans=False)
    labels = {entry: [launch.label for launch in program._launches] for entry, program in plan.programs.items()}
    assert all(names.count("qlinear+silu_mul") == 2 for names in labels.values()), labels   # 2 layers' gate_up
    seqs, blocks = sequences([5, 17, 30])
    step = build_step_inputs([Chunk(s, 0, s.num_tokens) for s in seqs], blocks)
    assert torch.equal(plan.run("prefill", step), ops.run("prefill", step))
    for lens in ([3 + i // 2 for i in range(17)], [3, 9, 20]):
        for got, want in zip(*decode_steps([plan, ops], lens, steps=2, num_blocks=32)):
            assert torch.equal(got, want)
