"""The engine end to end on tiny random models: greedy output equals transformers' generate,
batching changes nothing, seeded sampling reproduces, KV blocks come back, streamed text is
exactly the decoded output."""

from __future__ import annotations

import pytest
import torch

from llmc.models.config import TokenizerFiles
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.tokenizer import IncrementalDetokenizer, Tokenizer
from tiny_models import byte_tokenizer

SMALL_CACHE = EngineConfig(kv_cache_bytes=2**20)  # ~100 blocks of 16 tokens for the tiny models
PROMPT_LENS = (5, 1, 17)
GREEDY_12 = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def new_engine(artifact) -> Engine:
    return Engine(artifact, SMALL_CACHE)


def make_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts of byte tokens (ids 3..258), so they also decode to text."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 259, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def sampling(seed: int, max_tokens: int = 20) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)


# ----------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("family", ["llama_gqa", "qwen2"])
def test_greedy_batch_equals_transformers_generate(tiny_family, family):
    model, _, artifact = tiny_family(family)
    prompts = make_prompts()
    batched = [c.token_ids for c in new_engine(artifact).generate(prompts, GREEDY_12)]
    for prompt, got in zip(prompts, batched):
        assert len(got) == 12
        assert got == hf_greedy(model, prompt, 12)


def test_greedy_is_batch_invariant(tiny_family):
    _, _, artifact = tiny_family("llama_gqa")
    prompts = make_prompts(1)
    batched = [c.token_ids for c in new_engine(artifact).generate(prompts, GREEDY_12)]
    alone = [new_engine(artifact).generate([p], GREEDY_12)[0].token_ids for p in prompts]
    assert batched == alone


# ----------------------------------------------------------------------------- sampling


def test_seeded_sampling_reproduces_alone_and_batched(tiny_family):
    _, _, artifact = tiny_family("llama_gqa")
    p0, p1, p2 = make_prompts(2)
    engine = new_engine(artifact)
    first = engine.generate([p1], sampling(seed=7))[0].token_ids
    assert engine.generate([p1], sampling(seed=7))[0].token_ids == first            # same engine, again
    assert new_engine(artifact).generate([p1], sampling(seed=7))[0].token_ids == first  # a fresh engine
    batched = engine.generate([p0, p1, p2], [GREEDY_12, sampling(seed=7), sampling(seed=8)])
    assert batched[1].token_ids == first


def test_different_seeds_sample_differently(tiny_family):
    _, _, artifact = tiny_family("llama_gqa")
    prompt = make_prompts(3)[0]
    engine = new_engine(artifact)
    outs = [engine.generate([prompt], sampling(seed))[0].token_ids for seed in (1, 2, 3)]
    assert len({tuple(o) for o in outs}) == 3


# ----------------------------------------------------------------------------- KV blocks


def assert_all_blocks_free(engine: Engine) -> None:
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not engine.has_unfinished()


def test_blocks_are_free_after_generate(tiny_family):
    _, _, artifact = tiny_family("llama_gqa")
    engine = new_engine(artifact)
    engine.generate(make_prompts(4), [GREEDY_12, sampling(1), SamplingParams(max_tokens=3, temperature=0.0)])
    assert_all_blocks_free(engine)


def test_blocks_are_free_after_abort_of_running_and_waiting_requests(tiny_family):
    _, _, artifact = tiny_family("llama_gqa")
    engine = new_engine(artifact)
    p0, p1, p2 = make_prompts(5)
    running = engine.add_request(p0, SamplingParams(max_tokens=50, temperature=0.0))
    other = engine.add_request(p1, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill both
    engine.step()  # one decode
    assert engine.blocks.num_free_blocks < engine.blocks.num_blocks
    engine.abort(running)
    waiting = engine.add_request(p2, SamplingParams(max_tokens=8, temperature=0.0))
    engine.abort(waiting)  # never scheduled
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {other}
    assert_all_blocks_free(engine)


# ----------------------------------------------------------------------------- streaming text


def test_streamed_text_equals_decoded_output(tiny_family):
    """Random byte tokens include incomplete UTF-8: held back mid-stream, flushed at the end."""
    _, _, artifact = tiny_family("llama_gqa")
    engine = new_engine(artifact)
    tok = engine.tokenizer
    prompt = tok.encode("hello world")
    ends_incomplete = 0
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for params in [greedy] + [sampling(s) for s in range(4)]:
        outs = list(engine.stream(prompt, params))
        ids = [t for o in outs for t in o.new_token_ids]
        assert len(ids) == 20 and outs[-1].finished and outs[-1].finish_reason == "length"
        assert "".join(o.new_text for o in outs) == tok.decode(ids)
        assert not any(o.new_text.endswith("\ufffd") for o in outs[:-1])  # incomplete: held back
        ends_incomplete += tok.decode(ids).endswith("\ufffd")
    assert ends_incomplete, "no stream ended inside a character; pick other seeds to cover the flush"
    assert_all_blocks_free(engine)


@pytest.fixture(scope="module")
def byte_tok() -> Tokenizer:
    return Tokenizer(TokenizerFiles(tokenizer_json=byte_tokenizer().to_str(), chat_template=None))


TEXT = "héllo wörld 你好 🎉"


def test_incremental_detokenizer_never_splits_a_character(byte_tok):
    ids = byte_tok.encode(TEXT)
    assert len(ids) == len(TEXT.encode("utf-8"))  # one token per byte
    detok = IncrementalDetokenizer(byte_tok)
    deltas = [detok.push(t) for t in ids]
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # the multi-byte characters were held back at least once
    assert detok.flush() == ""


def test_incremental_detokenizer_flushes_an_unfinished_character(byte_tok):
    ids = byte_tok.encode(TEXT)[:-2]  # cut inside the 4-byte emoji
    detok = IncrementalDetokenizer(byte_tok, prompt_ids=byte_tok.encode("say: "))
    text = "".join(detok.push(t) for t in ids)
    assert text == TEXT[:-1]
    assert text + detok.flush() == byte_tok.decode(ids)
