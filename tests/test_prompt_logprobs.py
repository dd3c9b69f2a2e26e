"""Prompt logprobs (SamplingParams.prompt_logprobs; the server's echo with logprobs): each prompt
token's logprob equals the one computed one position at a time (1-token prefill chunks) and
transformers' (within fp32 tolerance), also when the prompt's blocks sit in the prefix cache; the
server returns them before the generated tokens', streamed as whole."""

from __future__ import annotations

import httpx
import pytest
import torch

from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.sampling_params import SamplingParams
from live_server import LiveServer
from tolerances import tolerance

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = list(range(40, 77))            # 37 byte tokens: more than two blocks of 16
ASK = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=4, ignore_eos=True)


def prompt_logprobs(engine: Engine, prompt: list[int], params: SamplingParams = ASK) -> list:
    outs = list(engine.stream(prompt, params))
    scored = [out.prompt_logprobs for out in outs if out.prompt_logprobs is not None]
    assert len(scored) == 1, "prompt logprobs come once"
    return scored[0]


def hf_logprobs(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]


def test_prompt_logprobs_equal_one_position_at_a_time_and_transformers(tiny_family):
    model, _, artifact = tiny_family("llama_gqa")
    whole = prompt_logprobs(Engine(artifact, EngineConfig(kv_cache_bytes=2**20)), PROMPT)
    one_by_one = prompt_logprobs(Engine(artifact, EngineConfig(kv_cache_bytes=2**20, max_batched_tokens=1)), PROMPT)
    assert len(whole) == len(PROMPT) and whole[0].logprob is None and whole[0].token_id == PROMPT[0]
    assert [r.token_id for r in whole] == PROMPT and [r.token_id for r in one_by_one] == PROMPT
    got = torch.tensor([r.logprob for r in whole[1:]])
    step = torch.tensor([r.logprob for r in one_by_one[1:]])
    want = hf_logprobs(model, PROMPT)
    hidden = model.config.hidden_size
    torch.testing.assert_close(got, step, **tolerance(torch.float32, hidden, scale=want.abs().max().item()))
    torch.testing.assert_close(got, want, **tolerance(torch.float32, hidden, scale=want.abs().max().item()))
    for r in whole[1:]:
        assert len(r.top_logprobs) == 4 and r.top_logprobs[0][1] >= r.logprob - 1e-6


def test_a_cached_prompt_is_computed_again_for_its_logprobs(tiny_family):
    """Cached tokens have no logits: a prompt-logprobs request skips the prefix cache (as vLLM), so it
    needs no copy-on-write of shared blocks, and scores its prompt as a fresh engine does."""
    artifact = tiny_family("llama_gqa")[2]
    engine = Engine(artifact, EngineConfig(kv_cache_bytes=2**20))
    engine.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0.0))       # fills the prefix cache
    hits = engine.blocks.prefix_hits
    again = prompt_logprobs(engine, PROMPT)
    fresh = prompt_logprobs(Engine(artifact, EngineConfig(kv_cache_bytes=2**20)), PROMPT)
    assert engine.blocks.prefix_hits == hits
    engine.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0.0))
    assert engine.blocks.prefix_hits > hits                   # the cache was there all along
    assert [r.logprob for r in again] == pytest.approx([r.logprob for r in fresh], abs=1e-5)


def test_the_server_echoes_the_prompt_logprobs_whole_and_streamed(tiny_family):
    artifact = tiny_family("llama_gqa")[2]
    server = LiveServer(Engine(artifact, EngineConfig(kv_cache_bytes=2**20)))
    try:
        body = {"prompt": PROMPT[:9], "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2}
        whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        lp = whole["logprobs"]
        assert len(lp["tokens"]) == 9 + 3 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
        assert lp["text_offset"][:10] == list(range(10))      # one character a prompt byte; output after them
        events = []
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body | {"stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(httpx.Response(200, content=line[6:]).json())
        streamed = {"tokens": [], "token_logprobs": []}
        for event in events:
            chunk_lp = event["choices"][0]["logprobs"]
            for key in streamed:
                streamed[key] += chunk_lp[key] if chunk_lp else []
        assert streamed == {"tokens": lp["tokens"], "token_logprobs": lp["token_logprobs"]}
    finally:
        server.stop()
