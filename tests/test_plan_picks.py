"""Greedy picks in a step plan (kernels/cpu/step_plan_gemm.h's GemmPicks, row_picks.h): a GEMM given
an index output picks in each row of the columns each thread makes, and the team's picks merge into
torch.argmax's meaning, whatever thread made which panel. Hand-built plans of one GEMM over float
panels, int8 / int4 panels and quads, at N not a multiple of a panel, on one thread and on two, for
decode-sized steps (panels claimed) and larger ones (panels shared); ties across the threads' shares
go to the first index and NaNs win, as torch.argmax's do. A lowered graph picks only in the GEMM
that writes its logits, and the executor hands them beside the logits (StepOutput.greedy)."""

from __future__ import annotations

import pytest
import torch

from llmc.kernels.gemv import prepare_linear_weight, prepare_qlinear_weight
from llmc.kernels.native import load_native_kernels
from llmc.kernels.quant import quantize_int4, quantize_int8
from llmc.kernels.step_plan_isa import encode

K, N = 64, 2000                  # N: 62.5 panels of 32, so the last is partial
FORMATS = ["f32", "bf16", "int8-panels", "int4-panels", "int8-quads", "int4-quads"]


def prepared(w: torch.Tensor, fmt: str):
    """`w` [N, K] fp32 as the plan's GEMM takes it in `fmt`."""
    if fmt in ("f32", "bf16"):
        return prepare_linear_weight(w.to(torch.float32 if fmt == "f32" else torch.bfloat16))
    acts = "bf16" if fmt.endswith("quads-bf16") else "int8" if fmt.endswith("quads") else "float"
    if fmt.startswith("int8"):
        return prepare_qlinear_weight(*quantize_int8(w, 32), None, bits=8, group_size=32, activations=acts)
    return prepare_qlinear_weight(*quantize_int4(w, 32), bits=4, group_size=32, activations=acts)


def picking_gemm(w: torch.Tensor, fmt: str):
    """A plan of one GEMM x [T, K] -> out [T, N] that picks in out: (plan, x's dtype)."""
    load_native_kernels()
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    g = prepared(w, fmt)
    plan = torch.classes.llmc.StepPlan(dtype == torch.bfloat16, False)
    x = plan.input(0, torch.empty(0, dtype=dtype))
    out, picks = plan.output(N, False), plan.index_output(False)
    panels = [-1 if t is None else plan.constant(t) for t in (g.weight, g.scales, g.mins)]
    common = dict(out=out, picks=picks, x=x, bias=-1, k=K, n=N, num_panels=g.weight.shape[0])
    if not g.bits:
        ins = encode("linear", **common, panels=panels[0])
    else:
        ins = encode("qlinear", **common, codes=panels[0], scales=panels[1], mins=panels[2], bits=g.bits,
                     group=32, layout=int(g.layout == "quads"), prompts=int(g.prompts == "bf16"))
    plan.add(ins.opcode, ins.args, ins.f)
    return plan, dtype


def run(plan, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits, picks = plan.run([x], x.shape[0], x.shape[0])
    return logits, picks


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("tokens", [1, 3, 9])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_picks_are_the_argmax_of_the_logits_the_gemm_made(fmt, tokens, threads):
    g = torch.Generator().manual_seed(tokens)
    plan, dtype = picking_gemm(torch.randn(N, K, generator=g), fmt)
    for _ in range(3):
        logits, picks = run(plan, torch.randn(tokens, K, generator=g).to(dtype))
        assert picks.dtype == torch.int64 and picks.shape == (tokens,)
        assert torch.equal(picks, logits.float().argmax(dim=-1))


@pytest.mark.parametrize("threads", [2], indirect=True)
@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8-quads-bf16", "int4-quads-bf16"])
def test_a_prompt_sized_gemm_picks_too(fmt, threads):
    """160 rows: a bf16 GEMM splits by tokens on AMX tiles where the CPU has them (each thread all the
    panels of its rows), by panels elsewhere; quads with bf16 prompts take AMX-BF16 where the CPU has it
    (amx_dequant_gemm.h), int8 activations elsewhere; the picks are the argmax either way."""
    g = torch.Generator().manual_seed(160)
    plan, dtype = picking_gemm(torch.randn(N, K, generator=g), fmt)
    logits, picks = run(plan, torch.randn(160, K, generator=g).to(dtype))
    assert torch.equal(picks, logits.float().argmax(dim=-1))


def tied_weight(columns: list[int], value: float = 3.0) -> torch.Tensor:
    """A weight whose rows `columns` are the same row, `value` times larger than any other's."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(N, K, generator=g) * 0.01
    w[columns] = torch.full((K,), value / K)
    return w


@pytest.mark.parametrize("threads", [2], indirect=True)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_tie_across_the_threads_shares_goes_to_the_first_index(fmt, threads):
    """Columns 900 (the first thread's share of the 63 panels) and 1900 (the second's) hold the same
    largest logit, and 1500 too: whichever thread made which, the pick is 900."""
    plan, dtype = picking_gemm(tied_weight([900, 1500, 1900]), fmt)
    for tokens in (1, 2, 9):
        logits, picks = run(plan, torch.ones(tokens, K, dtype=dtype))
        assert logits[0, 900] == logits[0, 1900] == logits.max()
        assert picks.tolist() == [900] * tokens


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_the_first_nan_wins_as_torch_argmax_has_it(threads):
    w = tied_weight([10])
    w[1200], w[1700] = float("nan"), float("nan")
    plan, _ = picking_gemm(w, "f32")
    logits, picks = run(plan, torch.ones(2, K))
    assert logits[:, 1200].isnan().all() and picks.tolist() == [1200, 1200] == logits.argmax(dim=-1).tolist()


def test_picks_that_are_not_an_index_output_are_refused():
    load_native_kernels()
    plan = torch.classes.llmc.StepPlan(False, False)
    x = plan.input(0, torch.empty(0))
    panels = plan.constant(prepare_linear_weight(torch.randn(64, K)).weight)
    out, activations = plan.output(64, False), plan.output(64, False)
    ins = encode("linear", out=out, picks=activations, x=x, panels=panels, bias=-1, k=K, n=64, num_panels=2)
    with pytest.raises(RuntimeError, match="a GEMM's picks must be an index output"):
        plan.add(ins.opcode, ins.args, ins.f)
