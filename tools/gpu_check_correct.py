"""The device check's correctness rule, anchored to fp32 (tools/gpu_check_parts.py applies it).

Two low-precision runs differ by the sum of their errors, so a candidate compared with the torch
backend in the same dtype fails on correct kernels: on the check's random model in fp16 torch
alone is ~0.3 from fp32 in the logits, and a correct Triton run as far on another side. So each
backend is compared with the anchor instead: the torch backend in fp32 on the same device, the
same source compiled in fp32 (for a quantized recipe, the same recipe in fp32), the same prompts
and forced tokens.

  logits   error = max |logit - anchor's| over a prefill of the prompts and the forced decode steps.
           Pass when  error(candidate) <= FACTOR x error(torch, same artifact) + floor,
           floor = FLOOR_ULPS units in the last place of the dtype at the anchor's largest |logit|
           (so an exact match of torch, as in fp32 where torch's run is the anchor itself, leaves a
           bound above zero). FACTOR = 2 (tests/tolerances.py's rule for kernels that round at other
           points than their ref): both backends round every op's output to the same dtype and sum
           in fp32, in other orders, so their errors are the same kind and size, and the largest of
           tens of thousands stays well within 2x of the other's; an op wrong by a few units of the
           dtype throughout the model moves the logits by more (tests/test_gpu_check_correct.py plants
           add_rmsnorm x (1 + 4 eps), every linear with the LM head x (1 - 4 eps), an int8 GEMM reading
           its codes one step high, and sees each flagged; a 4-eps scale on a 2-layer model's inner
           GEMMs alone moves its logits ~2 units of fp16 and passes, a 16-eps one is flagged). In
           fp32 the rule is the floor alone: a correct kernel
           that sums a long row in another order can exceed it there, which the table then shows as
           a finding about fp32 exactness, not a verdict on the half-precision kernels.
  greedy   the candidate decodes greedily; the anchor reads the tokens it picked. A step is off when
           the candidate's pick is not the anchor's top token, and fails when the anchor puts it more
           than 2 x the logits bound below its top (each of the two logits may be off by the bound, so
           a closer pick is a near-tie that fp32 itself calls close). Torch's own picks are judged the
           same way, for comparison.
  quality  (quantized recipes) as `llmc eval` measures a recipe (tools/quality.py): the first
           HELD_TOKENS tokens of its held text (Python's help topics) in one prefill with logits at
           every position, each predicting the next token; perplexity against the anchor's, mean
           KL(anchor || run) and top-1 agreement. On random weights the perplexities are near the
           vocabulary's size, but what a recipe and its kernels do to the distribution shows the
           same way (gpu_check_parts says which share of it a recipe's budget bounds).
"""

from __future__ import annotations

import torch

from llmc.runtime.model_runner import ModelRunner

from .gpu_check_measure import Batch, greedy
from .quality import score

FACTOR = 2.0
FLOOR_ULPS = 2
TIE_FACTOR = 2.0        # a pick fails when the anchor's gap to its top exceeds this x the logits bound
HELD_TOKENS = 512       # `llmc eval`'s window


def forced_tokens(prompts: int, steps: int) -> list[list[int]]:
    """Per decode step, the token each prompt is fed (fixed, so every run reads the same context)."""
    return [[(7 + 13 * step + p) % 250 + 3 for p in range(prompts)] for step in range(steps)]


def logits_run(runner: ModelRunner, prompts: list[list[int]], forced: list[list[int]], num_blocks: int
               ) -> list[torch.Tensor]:
    """The logits [prompts, vocab] of a prefill of `prompts` and of one decode step per `forced` row."""
    batch = Batch(runner, prompts, len(forced) + 1, num_blocks)
    return [batch.prefill()] + [batch.decode(tokens) for tokens in forced]


def resolution(value: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype`'s numbers near `value` (one unit in the last place)."""
    exponent = torch.frexp(torch.tensor(abs(value) or 1.0))[1].item() - 1
    return torch.finfo(dtype).eps * 2.0 ** exponent


def errors(run: list[torch.Tensor], anchor: list[torch.Tensor]) -> dict:
    """Max and root-mean-square |run - anchor| over every step's logits."""
    diffs = torch.cat([(got.double() - want.double()).flatten() for got, want in zip(run, anchor, strict=True)])
    return {"max": diffs.abs().max().item(), "rms": diffs.square().mean().sqrt().item()}


def judge_logits(candidate: list[torch.Tensor], torch_run: list[torch.Tensor], anchor: list[torch.Tensor],
                 dtype: torch.dtype) -> dict:
    """The logits rule (module docstring) on three runs over the same prompts and forced tokens."""
    scale = max(a.abs().max().item() for a in anchor)
    got, own = errors(candidate, anchor), errors(torch_run, anchor)
    floor = FLOOR_ULPS * resolution(scale, dtype)
    bound = FACTOR * own["max"] + floor
    finite = all(bool(x.isfinite().all()) for x in candidate)
    return {"candidate_error": got["max"], "candidate_rms": got["rms"], "torch_error": own["max"],
            "torch_rms": own["rms"], "vs_torch": errors(candidate, torch_run)["max"], "scale": scale,
            "factor": FACTOR, "floor": floor, "bound": bound, "finite": finite,
            "ok": finite and got["max"] <= bound}


def greedy_against_anchor(runner: ModelRunner, anchor: ModelRunner, prompts: list[list[int]], tokens: int,
                          num_blocks: int, tie: float) -> list[dict]:
    """Per prompt: how many of `runner`'s greedy picks are not the anchor's top token (the anchor
    reading the same tokens), the largest gap there, and whether every gap is within `tie`."""
    picks, _ = greedy(runner, prompts, tokens, num_blocks)             # [prompt][step]
    fed = [list(step) for step in zip(*picks)][:-1]                    # [step][prompt]
    seen = logits_run(anchor, prompts, fed, num_blocks)                # step i's logits choose pick i
    rows = []
    for p, chosen in enumerate(picks):
        gaps = [(step, (seen[step][p].max() - seen[step][p][token]).item()) for step, token in enumerate(chosen)]
        off = [(step, gap) for step, gap in gaps if gap > 0]
        step, gap = max(off, key=lambda sg: sg[1]) if off else (None, 0.0)
        rows.append({"prompt": p, "tokens": tokens, "off_top": len(off), "worst_step": step, "worst_gap": gap,
                     "tie": tie, "ok": gap <= tie})
    return rows


def held_logits(runner: ModelRunner, tokens: list[int], num_blocks: int) -> torch.Tensor:
    """Logits [len(tokens), vocab] of one prefill of `tokens`, at every position."""
    return Batch(runner, [tokens], 1, num_blocks).prefill(every_position=True)


def quality(run: list[torch.Tensor], anchor: list[torch.Tensor], targets: list[list[int]]) -> dict:
    """Perplexity of the targets (row r of each run's logits predicts targets[.][r]) for `run` and the
    anchor, mean KL(anchor || run) and top-1 agreement, over every row, in float64 (`llmc eval`'s
    quality.score)."""
    s = score(zip(run, anchor, targets, strict=True), torch.float64)
    s["anchor_perplexity"] = s.pop("reference_perplexity")
    return s
