"""Quantized SmolLM2-135M-Instruct (the real embedded GGUF) against its dequantized fp32 weights:
the issue's quality targets on the held text, and greedy generation."""

from __future__ import annotations

import pytest
import torch

from llmc.compiler.driver import CompileConfig, compile_model
from llmc.compiler.quant_recipe import QuantRecipe
from llmc.runtime.artifact import load_artifact
from llmc.runtime.engine import Engine
from llmc.runtime.sampling_params import SamplingParams
from llmc.tools.quality import WindowScorer, evaluate_artifacts
from test_smollm2 import PROMPTS

pytestmark = pytest.mark.slow

RECIPES = {
    "fp32": QuantRecipe(),
    "int8": QuantRecipe.parse("int8"),                       # requantized from Q4_1's float values
    "int4-kept": QuantRecipe.parse("int4"),                  # the file's Q4_1 blocks, bit for bit
    # round to nearest from the float values: on these weights, groups of 32 find Q4_1's own blocks
    # again (each group's min and max are codes 0 and 15 of the file's block), so it scores 0 too
    "int4-rtn": QuantRecipe.parse("int4", requantize=True),
    "kv8": QuantRecipe.parse("none", "int8"),
}
TARGETS = {"int8": 1.0, "int4-rtn": 5.0, "kv8": 0.5}        # Δperplexity, percent, at most


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2-quant")
    return {name: compile_model(None, root / name, CompileConfig(quant=recipe)) for name, recipe in RECIPES.items()}


@pytest.fixture(scope="module")
def quality(artifacts):
    return {name: evaluate_artifacts(artifacts[name], artifacts["fp32"], 1024, 512)
            for name in ("int8", "int4-kept", "int4-rtn", "kv8")}


def test_quality_targets(quality):
    for name, limit in TARGETS.items():
        q = quality[name]
        print(f"{name}: perplexity {q.perplexity:.4f} vs {q.reference_perplexity:.4f} "
              f"({q.delta_perplexity_percent:+.3f}%), KL {q.mean_kl:.5f}, top-1 {q.top1_agreement:.4f}")
        assert abs(q.delta_perplexity_percent) <= limit, name
    assert quality["int8"].mean_kl > 0 and quality["kv8"].mean_kl > 0   # those recipes really changed the numbers


def test_gguf_q4_1_pass_through_changes_nothing(quality):
    kept = quality["int4-kept"]
    assert kept.delta_perplexity_percent == 0 and kept.mean_kl == 0 and kept.top1_agreement == 1


def greedy(artifact) -> list[list[int]]:
    engine = Engine(artifact)
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    outs = engine.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.0))
    return [o.token_ids for o in outs]


NEAR_TIE = 0.005          # fp32's top two logits closer than this fraction of the top one


def test_int8_greedy_tokens_equal_fp32_for_32_steps_but_at_near_ties(artifacts):
    """int8 must pick fp32's token at every step where fp32 is not close to a tie. Measured: two
    prompts equal for 32 steps; 'Write one sentence about the ocean.' splits at step 28, where
    fp32's top two logits are 22.026 and 21.972 (0.24% apart) and int8 swaps them."""
    fp32 = load_artifact(artifacts["fp32"])
    scorer = WindowScorer(fp32.graphs["prefill"], fp32.weights)
    engine = Engine(artifacts["fp32"])
    for prompt, got, want in zip(PROMPTS, greedy(artifacts["int8"]), greedy(artifacts["fp32"])):
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if first is None:
            continue
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}]) + want[:first]
        top = torch.topk(scorer(ids)[-1], 2).values.tolist()
        print(f"int8 {prompt!r}: first differs at step {first}; fp32's top two logits {top[0]:.3f}, {top[1]:.3f}")
        assert top[0] - top[1] < NEAR_TIE * abs(top[0]), (prompt, first, top)


def test_int4_first_divergence_is_reported(artifacts):
    """int4 (round to nearest) may pick another token somewhere; this prints where, per prompt.
    The kept Q4_1 blocks must not diverge at all."""
    want = greedy(artifacts["fp32"])
    assert greedy(artifacts["int4-kept"]) == want
    for prompt, got, ref in zip(PROMPTS, greedy(artifacts["int4-rtn"]), want):
        first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        print(f"int4-rtn {prompt!r}: " + ("identical for 32 steps" if first is None else f"first differs at step {first}"))
