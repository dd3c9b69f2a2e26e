"""Speculative decoding on the real embedded SmolLM2-135M-Instruct: greedy output with n-gram
drafts and with a draft model (the artifact itself, so every draft is the target's own choice) is
token for token greedy output without speculation, on the test prompts and on rewrite-like ones;
and an acceptance gate, as SGLang's CI keeps one: on a fixed repetitive prompt n-gram lookup's mean
accepted length stays above a stated floor (measured 2.9 tokens a step at K = 4, 2026-12-01)."""

from __future__ import annotations

import pytest

from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.speculative.speculator import SpeculativeConfig

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about the ocean.",
    "Repeat this list exactly, one item per line:\napples\nbananas\ncherries\ndates\nelderberries\nfigs",
    "Rewrite this code with x renamed to count:\ndef total(items):\n    x = 0\n    for item in items:\n"
    "        x = x + item.price\n    return x",
]
REPETITIVE = ("Repeat this list exactly, one item per line:\napples\nbananas\ncherries\ndates\nelderberries\nfigs\n"
              "grapes\nhoneydew melons\nkiwis\nlemons")
MEAN_ACCEPTED_FLOOR = 2.0           # tokens a verifying step gives; 1.0 would mean nothing is accepted
GREEDY = SamplingParams(max_tokens=64, temperature=0.0)


def chat(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


@pytest.fixture(scope="module")
def plain(smollm2_artifact):
    return Engine(smollm2_artifact)


@pytest.fixture(scope="module")
def reference(plain):
    return [out.token_ids for out in plain.generate([chat(plain, p) for p in PROMPTS], GREEDY)]


@pytest.mark.parametrize("source", ["ngram", "target"])
def test_speculative_greedy_is_plain_greedy(smollm2_artifact, plain, reference, source):
    source = f"draft:{smollm2_artifact}" if source == "target" else source
    engine = Engine(smollm2_artifact, EngineConfig(speculative=SpeculativeConfig(source, 4)))
    got = [out.token_ids for out in engine.generate([chat(plain, p) for p in PROMPTS], GREEDY)]
    assert got == reference
    assert engine.stats().speculation.accepted > 0


def test_ngram_acceptance_stays_above_its_floor(smollm2_artifact, plain):
    engine = Engine(smollm2_artifact, EngineConfig(speculative=SpeculativeConfig("ngram", 4)))
    engine.generate([chat(plain, REPETITIVE)], SamplingParams(max_tokens=120, temperature=0.0))
    stats = engine.stats().speculation
    assert stats.mean_accepted_length >= MEAN_ACCEPTED_FLOOR, stats
