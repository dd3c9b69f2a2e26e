"""The device check's correctness rule on the CPU, through the check's own code (gpu_check_parts'
anchor and runners, gpu_check_correct's rule): a candidate with one op planted wrong by a few
units of fp16 is flagged, a correct candidate that rounds differently passes.

The model is the check's own random model (gpu_check_model) on a tiny llama's shapes, compiled in
fp16; the candidate is the torch backend built while one op record's reference is replaced (the
runner binds each op's function when it is built, so only the candidate carries the change)."""

from __future__ import annotations

import dataclasses
from argparse import Namespace

import pytest
import torch

from llmc.compiler.driver import CompileConfig, compile_model
from llmc.compiler.ops import OPS
from llmc.runtime.artifact import load_artifact
from llmc.tools import gpu_check, gpu_check_parts as parts
from llmc.tools.gpu_check_correct import (FACTOR, FLOOR_ULPS, greedy_against_anchor, judge_logits, logits_run,
                                          quality, resolution)
from llmc.tools.gpu_check_model import write_random_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FP16_EPS = torch.finfo(torch.float16).eps           # 2^-10: a plant of 4 eps is "a few units of fp16"


@pytest.fixture(scope="module")
def check(tiny_family, tmp_path_factory):
    """The check's args, its fp32 anchor, an fp16 compile and torch's own fp16 logits run."""
    root = tmp_path_factory.mktemp("gpu-check-correct")
    bundle = tiny_family("llama_hd32")[1]
    args = gpu_check.parse_args(["--bundle", str(bundle), "--device", "cpu", "--backend", "torch",
                                 "--batches", "1", "--greedy-tokens", "6"])
    args.work = root
    folder = write_random_model(bundle, root / "model", seed=0)
    anchor = parts.build_anchor(args, folder)
    artifact = load_artifact(compile_model(folder, root / "fp16", CompileConfig(dtype="float16")))
    blocks = parts.num_blocks(args, anchor.prompts)
    torch_runner = parts.make_runner(args, artifact, blocks, "torch", False)
    own = logits_run(torch_runner, anchor.prompts, anchor.forced, blocks)
    return args, anchor, artifact, blocks, own


def candidate_with(check, op: str, reference):
    """A candidate runner whose `op` runs `reference(original)` instead of the op's torch reference."""
    args, _, artifact, blocks, _ = check
    record = OPS[op]
    OPS[op] = dataclasses.replace(record, reference=reference(record.reference))
    try:
        return parts.make_runner(args, artifact, blocks, "torch", False)
    finally:
        OPS[op] = record


def scaled(factor: float):
    """An op's reference with its (first) result multiplied by `factor`, rounded to its dtype."""
    def plant(original):
        def wrong(x, a):
            out = original(x, a)
            return (out[0] * factor, *out[1:]) if isinstance(out, tuple) else out * factor
        return wrong
    return plant


def in_float64(original):
    """The same op computed from float64 inputs, rounded once to the op's dtype: a correct kernel
    that rounds at fewer points than torch does (as a fused Triton unit keeping fp32 inside)."""
    def precise(x, a):
        wide = type(x)({k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                        for k, v in x.items()})
        out = original(wide, a)
        dtype = x.x.dtype
        return tuple(o.to(dtype) for o in out) if isinstance(out, tuple) else out.to(dtype)
    return precise


def judged(check, runner) -> dict:
    _, anchor, _, blocks, own = check
    return judge_logits(logits_run(runner, anchor.prompts, anchor.forced, blocks), own, anchor.logits, torch.float16)


@pytest.mark.parametrize("op,factor", [("add_rmsnorm", 1 + 4 * FP16_EPS), ("linear", 1 - 4 * FP16_EPS)])
def test_an_op_planted_a_few_fp16_units_wrong_is_flagged(check, op, factor):
    verdict = judged(check, candidate_with(check, op, scaled(factor)))
    assert not verdict["ok"] and verdict["finite"], verdict
    assert verdict["candidate_error"] > verdict["bound"] > FACTOR * verdict["torch_error"]


@pytest.mark.parametrize("op", ["add_rmsnorm", "linear"])
def test_a_correct_fp16_candidate_that_rounds_differently_passes(check, op):
    args, anchor, _, blocks, _ = check
    runner = candidate_with(check, op, in_float64)
    verdict = judged(check, runner)
    assert verdict["ok"] and 0 < verdict["vs_torch"], verdict           # another implementation, still correct
    fp32 = parts.make_runner(args, anchor.artifact, blocks, "torch", False)
    rows = greedy_against_anchor(runner, fp32, anchor.prompts, args.greedy_tokens, blocks, 2 * verdict["bound"])
    assert all(r["ok"] for r in rows)


def test_the_floor_keeps_an_exact_torch_from_a_zero_bound():
    anchor = [torch.tensor([[3.0, -1.0, 0.5]]), torch.tensor([[2.0, 0.0, -3.5]])]
    verdict = judge_logits(anchor, anchor, anchor, torch.float16)
    ulp = resolution(3.5, torch.float16)                                # 2^-10 * 2
    assert verdict["torch_error"] == 0 and verdict["bound"] == verdict["floor"] == FLOOR_ULPS * ulp and verdict["ok"]
    off = [a + torch.tensor([[0.0, 0.0, (FLOOR_ULPS + 1) * ulp]]) for a in anchor]
    assert not judge_logits(off, anchor, anchor, torch.float16)["ok"]
    assert not judge_logits([a * float("nan") for a in anchor], anchor, anchor, torch.float16)["ok"]


def test_quality_is_zero_against_itself_and_grows_with_noise():
    g = torch.Generator().manual_seed(0)
    anchor = [torch.randn(3, 50, generator=g) * 3 for _ in range(3)]
    forced = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    same = quality(anchor, anchor, forced)
    assert same["delta_perplexity_percent"] == 0 and same["mean_kl"] == 0 and same["top1_agreement"] == 1
    assert same["positions"] == 9
    noisy = quality([a + torch.randn(a.shape, generator=g) for a in anchor], anchor, forced)
    assert noisy["mean_kl"] > 0.05 and noisy["delta_perplexity_percent"] != 0 and noisy["top1_agreement"] < 1


class Scripted:
    """A runner that returns the given logits [prompts, vocab] step after step."""

    def __init__(self, steps: list[list[list[float]]]):
        self.steps = iter(torch.tensor(s) for s in steps)

    def run(self, entry, step_inputs):
        return next(self.steps)


def test_greedy_forgives_a_near_tie_that_fp32_calls_close_and_flags_a_clear_miss():
    # the candidate picks token 1, then token 2; the anchor reads those picks and prefers token 0 at step 0
    candidate = Scripted([[[0.0, 1.0, 0.0]], [[0.0, 0.0, 1.0]]])
    near = Scripted([[[1.00, 0.99, 0.0]], [[0.0, 0.0, 1.0]]])
    rows = greedy_against_anchor(candidate, near, [[5, 6]], 2, 8, tie=0.05)
    assert rows == [{"prompt": 0, "tokens": 2, "off_top": 1, "worst_step": 0, "worst_gap": pytest.approx(0.01),
                     "tie": 0.05, "ok": True}]
    candidate = Scripted([[[0.0, 1.0, 0.0]], [[0.0, 0.0, 1.0]]])
    clear = Scripted([[[1.0, 0.0, 0.0]], [[0.0, 0.0, 1.0]]])
    assert not greedy_against_anchor(candidate, clear, [[5, 6]], 2, 8, tie=0.05)[0]["ok"]


def codes_off_by_one(original):
    """A quantized GEMM that reads every int8 code one step high (a zero point off by one)."""
    def wrong(x, a):
        return original(type(x)({**x, "codes": x.codes.clamp(max=126) + 1}), a)
    return wrong


@pytest.mark.parametrize("planted", [False, True])
def test_a_quantized_gemm_planted_wrong_is_flagged_against_the_recipes_fp32_anchor(check, monkeypatch, planted):
    """check_recipe itself, its candidate (the runner it asks for with graphs=None) reading every int8
    code one step high where planted: the int8 recipe's own fp32 anchor shares the quantization, so
    the bound stays within 4 units of fp16 at the logits' scale and the plant shows."""
    args, anchor = Namespace(**vars(check[0])), check[1]
    args.decode_steps, args.context, args.dtypes, args.copy_bandwidth = 1, 8, ["float16"], 1e10
    build = parts.make_runner

    def runner(args, artifact, blocks, backend, graphs):
        if graphs is not None or not planted:
            return build(args, artifact, blocks, backend, graphs)
        record = OPS["qlinear"]
        monkeypatch.setitem(OPS, "qlinear", dataclasses.replace(record, reference=codes_off_by_one(record.reference)))
        try:
            return build(args, artifact, blocks, backend, graphs)
        finally:
            monkeypatch.setitem(OPS, "qlinear", record)

    monkeypatch.setattr(parts, "make_runner", runner)
    monkeypatch.setitem(parts.RECIPES, "int8", (parts.RECIPES["int8"][0], 0.0))   # a budget of 0: the kernels' share
    out = parts.check_recipe(args, args.work / "model", anchor, "int8")
    assert out["logits"]["ok"] is not planted and out["logits"]["bound"] < 4 * (anchor.logits[0].abs().max() / 1024)
    quality = out["quality"]
    assert quality["ok"] is not planted and quality["delta_perplexity_percent"] != 0   # the recipe's own cost is not
    assert quality["kernels_delta_perplexity_percent"] == quality["delta_perplexity_percent"] - \
        quality["torch_delta_perplexity_percent"]
