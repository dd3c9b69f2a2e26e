"""Async scheduling: the engine loop plans step N+1 while step N computes, records N's tokens
before N+1 launches, and detokenises N's outputs while N+1 computes. None of it may change what a
request gets: each workload below gives the same tokens, text and finish reasons as the loop
without overlap, and the ordering itself is checked (N+1 planned during N; no placeholder token
ever reaches a computed step; a stop string found while the next step runs costs one dropped token).
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

import llmc.runtime.sequence as sequence_module
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.engine_loop import EngineLoop
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.step_pipeline import choose_async_scheduling, leaves_a_core
from test_engine_runtime import block_bytes, prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def artifact(tiny_family):
    return tiny_family("llama_hd32")[2]


def generate(artifact, batch, params, async_scheduling: bool, then=(), **config):
    """(completions, engine) of `batch`, then of the prompts `then`, through one EngineLoop with or
    without overlap."""
    engine = Engine(artifact, EngineConfig(**{"kv_cache_bytes": 2**22, "async_scheduling": async_scheduling, **config}))
    with EngineLoop(engine) as loop:
        done = loop.generate(batch, params)
        done += loop.generate(then, params) if then else []
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    return done, engine


def summary(completions) -> list[tuple]:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in completions]


SHARED = prompts(1, seed=3, lo=40, hi=41)[0]        # 40 tokens: two full blocks of 16
WORKLOADS = {
    "batching": (prompts(16), GREEDY, {}),
    "chunked prefill": (prompts(6, seed=2, lo=30, hi=90), GREEDY, {"max_batched_tokens": 7}),
    "preemption": (prompts(12, seed=1), GREEDY, {"kv_cache_bytes": "12 blocks"}),
    "prefix cache": ([SHARED], GREEDY, {"then": [SHARED + p for p in prompts(5, seed=4)] + [SHARED[:32]] * 2}),
    "seeded sampling": (prompts(8, seed=5), SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7), {}),
    "stop strings and eos": (prompts(8, seed=6), SamplingParams(max_tokens=16, temperature=0.0, stop=("a", "e")), {}),
    "prompt logprobs": (prompts(4, seed=8), SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=2,
                                                           logprobs=1), {}),
}


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_overlap_changes_no_output(artifact, workload):
    batch, params, config = WORKLOADS[workload]
    if config.get("kv_cache_bytes") == "12 blocks":
        config = {"kv_cache_bytes": 12 * block_bytes(Engine(artifact, EngineConfig(kv_cache_bytes=2**22)))}
    plain, _ = generate(artifact, batch, params, False, **config)
    overlapped, engine = generate(artifact, batch, params, True, **config)
    assert summary(overlapped) == summary(plain)
    if workload == "preemption":
        assert engine.scheduler.num_preemptions > 0
    if workload == "prefix cache":
        assert engine.blocks.hit_rate() > 0.5


def test_the_next_step_is_planned_while_a_step_computes(artifact):
    """The k-th step's forward pass waits (up to 5 s) until the loop thread has planned k + 1 steps:
    with overlap, step k + 1 is planned while step k computes, so no step waits out the timeout."""
    engine = Engine(artifact, EngineConfig(async_scheduling=True))
    plans, computes, overlapped, changed = [0], [0], [], threading.Condition()
    real_plan, real_compute = engine.plan_step, engine._compute

    def plan_step():
        with changed:
            plans[0] += 1
            changed.notify_all()
        return real_plan()

    def compute(entry, inputs):
        computes[0] += 1
        with changed:
            overlapped.append(changed.wait_for(lambda: plans[0] > computes[0], timeout=5.0))
        return real_compute(entry, inputs)

    engine.plan_step, engine._compute = plan_step, compute
    with EngineLoop(engine) as loop:
        done = loop.generate(prompts(3), GREEDY)
    assert len(overlapped) >= GREEDY.max_tokens and all(overlapped)
    assert summary(done) == summary(generate(artifact, prompts(3), GREEDY, False)[0])


def test_no_placeholder_token_reaches_a_computed_step(artifact, monkeypatch):
    """A token the step in flight has not sampled yet is a placeholder in the next step's inputs until
    launch fills it in; with an impossible placeholder (-1) every launched step's ids are real."""
    monkeypatch.setattr(sequence_module, "PENDING_TOKEN", -1)
    engine = Engine(artifact, EngineConfig(async_scheduling=True))
    seen, real_run = [], engine.runner.run_step
    engine.runner.run_step = lambda entry, step: (seen.append(step.input_ids.clone()), real_run(entry, step))[1]
    with EngineLoop(engine) as loop:
        done = loop.generate(prompts(6, seed=9), GREEDY)
    assert len(seen) >= GREEDY.max_tokens and all(int(ids.min()) >= 0 for ids in seen)
    assert summary(done) == summary(generate(artifact, prompts(6, seed=9), GREEDY, False)[0])


def test_a_stop_string_found_while_the_next_step_computes_drops_that_steps_token(artifact):
    """The stop string is found in the output stage, after the next step (which computes one more
    token for the request) was launched: that token is dropped, the request ends where it must and
    its blocks are freed."""
    prompt = prompts(1, seed=5)[0]
    free_text = generate(artifact, [prompt], SamplingParams(max_tokens=24, temperature=0.0), False)[0][0].text
    stop = free_text[6:8]
    params = SamplingParams(max_tokens=24, temperature=0.0, stop=(stop,))
    plain, _ = generate(artifact, [prompt], params, False)
    engine = Engine(artifact, EngineConfig(async_scheduling=True))
    last_position, real_run = [0], engine.runner.run_step
    engine.runner.run_step = lambda entry, step: (last_position.append(int(step.positions.max())),
                                                       real_run(entry, step))[1]
    with EngineLoop(engine) as loop:
        done = loop.generate([prompt], params)
    assert summary(done) == summary(plain) and done[0].finish_reason == "stop" and done[0].text == \
        free_text[:free_text.index(stop)]
    last = len(prompt) + len(done[0].token_ids) - 1     # the position of its last kept token
    assert max(last_position) == last                     # a step fed it and sampled one more: dropped
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_async_scheduling_by_default_only_where_the_forward_leaves_the_host_a_core(monkeypatch):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores)
    assert choose_async_scheduling(None, torch.device("cuda"), speculating=False)
    assert not choose_async_scheduling(None, torch.device("cpu"), speculating=False)   # OpenMP takes every core
    assert choose_async_scheduling(True, torch.device("cpu"), speculating=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores - 1)
    assert choose_async_scheduling(None, torch.device("cpu"), speculating=False) == (cores > 1)
    assert not choose_async_scheduling(True, torch.device("cuda"), speculating=True)    # drafts need the newest token


def test_async_scheduling_counts_the_threads_of_every_tensor_parallel_rank_on_the_machine(monkeypatch):
    assert leaves_a_core(cores=2, threads=1, local_ranks=1)
    assert not leaves_a_core(cores=2, threads=1, local_ranks=2)     # TP 2 on 2 cores: the ranks take both
    assert not leaves_a_core(cores=16, threads=8, local_ranks=2)
    assert leaves_a_core(cores=16, threads=7, local_ranks=2)
    assert not leaves_a_core(cores=2, threads=1, local_ranks=3)     # TP 3 on 2 cores oversubscribes already
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert choose_async_scheduling(None, torch.device("cpu"), False, local_ranks=cores) is False
    assert choose_async_scheduling(None, torch.device("cpu"), False, local_ranks=cores - 1) is (cores > 1)
    assert choose_async_scheduling(None, torch.device("cuda"), False, local_ranks=cores)
