"""The real embedded SmolLM2-135M-Instruct: llmc's compiled artifact generates exactly what
transformers generates from the same GGUF (greedy, 32 tokens, three chat prompts)."""

from __future__ import annotations

import pytest
import torch

from llmc.models.embedded import EMBEDDED_FILE, embedded_model_path
from llmc.runtime.engine import Engine
from llmc.runtime.sampling_params import SamplingParams
from llmc.tools.bench_hf import dense_gguf_kwargs

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about the ocean.",
    "List three colors.",
]


@pytest.fixture(scope="module")
def engine(smollm2_artifact):
    return Engine(smollm2_artifact)


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    folder = embedded_model_path().parent
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=EMBEDDED_FILE)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              **dense_gguf_kwargs(EMBEDDED_FILE)).eval()
    return tok, model


def hf_chat_ids(tok, prompt: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_chat_prompt_tokens_match_transformers(engine, hf):
    tok, _ = hf
    for prompt in PROMPTS:
        ours = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        assert ours == hf_chat_ids(tok, prompt)


def test_greedy_generation_matches_transformers(engine, hf):
    tok, model = hf
    prompts = [hf_chat_ids(tok, p) for p in PROMPTS]
    model.generation_config.eos_token_id = None  # both sides run all 32 steps, past any EOS
    ours = [c.token_ids for c in engine.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True,
                                                                         temperature=0.0))]
    for ids, got in zip(prompts, ours):
        with torch.no_grad():
            # an explicit mask: the prompt holds <|im_end|> (= pad id), which transformers
            # would otherwise mask out of the prompt once EOS is off
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=2)
        assert got == out[0, len(ids):].tolist()


def test_answer_mentions_paris(engine):
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": PROMPTS[0]}])
    (out,) = engine.generate([ids], SamplingParams(max_tokens=32, temperature=0.0))
    assert out.finish_reason == "stop"             # EOS, well before 32 tokens
    assert "Paris" in out.text and out.text == engine.tokenizer.decode(out.token_ids)
