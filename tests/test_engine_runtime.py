"""The engine over a compiled tiny model: scheduling choices never change greedy output.

The invariance tests (batching, preemption, chunking, prefix caching with copy-on-write) run on
two tiny models: llama_gqa (head_dim 12: the native kernels decline it, the torch refs run) and
llama_hd32, whose shapes every native kernel takes (run with kernels="native", as the CLI does
where they build)."""

from __future__ import annotations

import pytest
import torch

from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
KERNELS = {"llama_gqa": "auto", "llama_hd32": "native"}


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, 300, (k,), generator=g).tolist() for k in lens]


@pytest.fixture(scope="module")
def artifact(tiny_family):
    return tiny_family("llama_gqa")[2]


@pytest.fixture(scope="module", params=list(KERNELS))
def family_artifact(request, tiny_family):
    """(artifact, kernels) of each invariance model."""
    return tiny_family(request.param)[2], KERNELS[request.param]


def block_bytes(engine: Engine) -> int:
    """block_size x K,V x layers x kv_heads x head_dim x element size."""
    return engine.runner.kv_cache.element_size() * engine.runner.kv_cache[:, :, 0].numel()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def config_of(kernels: str = "auto", **config) -> EngineConfig:
    """The tests' engine: a 4 MiB cache, the torch backend's `kernels`, and `config`."""
    return EngineConfig(**{"kv_cache_bytes": 2**22, "backend_options": {"kernels": kernels}, **config})


def run(artifact, batch, params=GREEDY, **config):
    engine = Engine(artifact, config_of(**config))
    outputs = [c.token_ids for c in engine.generate(batch, params)]
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    return engine, outputs


def run_in_this_thread(artifact, batch, params=GREEDY, **config) -> list[list[int]]:
    """`run`, but stepping the engine here rather than in an EngineLoop thread (the profiler sees
    only this thread's ops)."""
    engine = Engine(artifact, config_of(**config))
    tokens = {engine.add_request(p, params): [] for p in batch}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return list(tokens.values())


def test_sixteen_requests_together_equal_each_alone(family_artifact):
    artifact, kernels = family_artifact
    batch = prompts(16)
    with torch.profiler.profile() as prof:
        together = run_in_this_thread(artifact, batch, kernels=kernels)
    ran = {e.name for e in prof.events()}
    assert kernels != "native" or {"llmc::step_plan.prefill", "llmc::step_plan.decode"} <= ran   # both graphs
    alone = [run(artifact, [p], kernels=kernels)[1][0] for p in batch]
    assert together == alone


def test_preempted_requests_give_the_same_greedy_output(family_artifact):
    artifact, kernels = family_artifact
    batch = prompts(12, seed=1)
    engine, reference = run(artifact, batch, kernels=kernels)
    engine, squeezed = run(artifact, batch, kernels=kernels, kv_cache_bytes=12 * block_bytes(engine))
    assert engine.scheduler.num_preemptions > 0
    assert squeezed == reference


def test_small_token_budget_chunks_prompts_without_changing_output(family_artifact):
    artifact, kernels = family_artifact
    batch = prompts(6, seed=2, lo=30, hi=90)
    _, reference = run(artifact, batch, kernels=kernels)
    engine, chunked = run(artifact, batch, kernels=kernels, max_batched_tokens=7)
    assert chunked == reference


def test_prefix_cache_hits_and_copy_on_write_give_the_same_output(family_artifact):
    artifact, kernels = family_artifact
    system = prompts(1, seed=3, lo=40, hi=41)[0]              # 40 shared tokens: 2 full blocks
    batch = [system + p for p in prompts(5, seed=4)] + [system[:32]] * 2   # last two: fully cached
    _, uncached = run(artifact, batch, kernels=kernels, enable_prefix_caching=False)
    engine = Engine(artifact, EngineConfig(backend_options={"kernels": kernels}))
    copied = []
    copy_blocks = engine.runner.copy_blocks
    engine.runner.copy_blocks = lambda copies: (copied.extend(copies), copy_blocks(copies))
    first = [c.token_ids for c in engine.generate(batch[:1], GREEDY)]    # caches the shared blocks
    cached = first + [c.token_ids for c in engine.generate(batch[1:], GREEDY)]
    assert engine.blocks.hit_rate() > 0.5
    assert copied  # the two fully cached prompts share their last block and recompute a token into it
    assert cached == uncached


def test_stop_string_ends_the_text_before_it(artifact):
    engine = Engine(artifact)
    prompt = prompts(1, seed=5)[0]
    full = "".join(o.new_text for o in engine.stream(prompt, SamplingParams(max_tokens=24, temperature=0.0)))
    stop = full[5:8]
    outs = list(engine.stream(prompt, SamplingParams(max_tokens=24, temperature=0.0, stop=(stop,))))
    text = "".join(o.new_text for o in outs)
    assert text == full[:full.index(stop)]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop


def test_logprobs_and_metrics_are_reported(artifact):
    engine = Engine(artifact)
    outs = list(engine.stream(prompts(1, seed=6)[0], SamplingParams(max_tokens=5, temperature=0.0, logprobs=2,
                                                                    ignore_eos=True)))
    assert all(len(o.logprobs) == 1 and len(o.logprobs[0].top_logprobs) == 2 for o in outs)
    assert all(o.logprobs[0].token_id == o.logprobs[0].top_logprobs[0][0] for o in outs)  # greedy = top-1
    metrics = outs[-1].metrics
    assert metrics.output_tokens == 5 and metrics.ttft > 0 and metrics.e2e >= metrics.ttft
    stats = engine.stats()
    assert stats.running == 0 and stats.kv_blocks_used == 0 and stats.steps >= 5


def test_priority_request_is_served_first(artifact):
    engine = Engine(artifact, EngineConfig(max_num_seqs=1))
    low = engine.add_request(prompts(1, seed=7)[0], SamplingParams(max_tokens=3, temperature=0.0))
    high = engine.add_request(prompts(1, seed=8)[0], SamplingParams(max_tokens=3, temperature=0.0), priority=-1)
    first = engine.step()
    assert [o.request_id for o in first] == [high]
    while engine.has_unfinished():
        engine.step()
    assert low != high


def test_generate_returns_text_reason_and_metrics(artifact):
    engine = Engine(artifact)
    a, b = engine.generate(prompts(2, seed=9), [GREEDY, SamplingParams(max_tokens=3, temperature=0.0)])
    assert len(a.token_ids) == 24 and a.finish_reason == "length" and a.metrics.output_tokens == 24
    assert b.text == engine.tokenizer.decode(b.token_ids) and b.prompt_ids == prompts(2, seed=9)[1]


def test_greedy_tokens_picked_in_the_step_plans_equal_transformers(tiny_family):
    """llama_hd32 runs as step plans whose LM head picks each logit row's greedy token as it makes the
    logits (StepOutput.greedy), and the sampler takes those picks: the engine's greedy output, three
    prompts together, equals transformers' generate of each."""
    model, _, art = tiny_family("llama_hd32")
    engine, outputs = run(art, prompts(3, seed=4), kernels="native")
    assert all(engine.runner.executor.programs[entry].picks for entry in ("prefill", "decode"))
    for prompt, got in zip(prompts(3, seed=4), outputs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
        assert got == want[0, len(prompt):].tolist()
