"""The engine loop: one owner thread, every output to its own request, failures contained."""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.engine_loop import EngineLoop, LoopStopped, QueueFull
from llmc.runtime.request import RequestOutput
from llmc.runtime.sampling_params import RequestError, SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
POISON = [7] * 9        # a prompt whose step the fault injector fails


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 300, (int(k),), generator=g).tolist() for k in torch.randint(3, 40, (n,), generator=g)]


@pytest.fixture(scope="module")
def artifact(tiny_family):
    return tiny_family("llama_hd32")[2]


@pytest.fixture(scope="module")
def alone(artifact):
    """Each prompt's greedy tokens, computed by a fresh engine with nothing else to do."""
    return {tuple(p): Engine(artifact).generate([p], GREEDY)[0].token_ids for p in prompts(12)}


def fail_steps_with_poison(engine: Engine) -> None:
    """Fault injection: the model run raises in any step that computes the poison prompt."""
    real_run = engine.runner.run_step

    def run(entry, step):
        if int((step.input_ids == POISON[0]).sum()) >= len(POISON):
            raise RuntimeError("injected fault")
        return real_run(entry, step)

    engine.runner.run_step = run


def test_concurrent_submitters_each_get_only_their_own_tokens(artifact, alone):
    """Eight threads submit and stream at once; each sees exactly its own request's tokens."""
    results: dict[tuple, list[int]] = {}

    def client(prompt: list[int]) -> None:
        results[tuple(prompt)] = [t for out in loop.stream(prompt, GREEDY) for t in out.new_token_ids]

    with EngineLoop(Engine(artifact)) as loop:
        threads = [threading.Thread(target=client, args=(p,)) for p in prompts(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert loop.engine.blocks.num_free_blocks == loop.engine.blocks.num_blocks
    assert results == alone


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(artifact, alone):
    engine = Engine(artifact, EngineConfig(max_num_seqs=2))
    fail_steps_with_poison(engine)
    batch = prompts(12)
    with EngineLoop(engine) as loop:
        outs = loop.generate([POISON, batch[0]] + batch[1:4], GREEDY)   # poison and batch[0] share a step
        assert [o.finish_reason for o in outs[:2]] == ["error", "error"]
        assert "injected fault" in outs[0].error and outs[1].token_ids == []
        assert [o.token_ids for o in outs[2:]] == [alone[tuple(p)] for p in batch[1:4]]
        assert [o.token_ids for o in loop.generate(batch, GREEDY)] == [alone[tuple(p)] for p in batch]
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks and not engine.requests


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_an_error_outside_the_model_fails_what_is_in_flight_and_the_loop_goes_on(artifact, alone, async_scheduling):
    engine = Engine(artifact, EngineConfig(async_scheduling=async_scheduling))
    real_plan, calls = engine.plan_step, []

    def plan_step():      # the scheduler, with a bug on its third call (a step is in flight then, with overlap)
        calls.append(1)
        if len(calls) == 3:
            raise KeyError("scheduler bug")
        return real_plan()

    engine.plan_step = plan_step
    with EngineLoop(engine) as loop:
        outs = loop.generate(prompts(3), GREEDY)
        assert {o.finish_reason for o in outs} == {"error"} and "scheduler bug" in outs[0].error
        p = prompts(12)[5]
        assert loop.generate([p], GREEDY)[0].token_ids == alone[tuple(p)]
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_bad_requests_are_refused_in_the_callers_thread(artifact):
    with EngineLoop(Engine(artifact)) as loop:
        with pytest.raises(RequestError, match="context"):
            loop.submit([5] * 10, SamplingParams(max_tokens=10_000), lambda out: None)
        with pytest.raises(RequestError, match="empty"):
            loop.submit([], GREEDY, lambda out: None)
        assert loop.num_waiting() == 0


def test_a_full_waiting_queue_refuses_then_accepts_again(artifact):
    engine = Engine(artifact, EngineConfig(max_num_seqs=1))
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    with EngineLoop(engine, max_waiting=2) as loop:
        first: queue.Queue = queue.Queue()
        loop.submit(prompts(1)[0], long, first.put)
        first.get(timeout=30)                               # running: it holds the one seat
        waiting = [queue.Queue() for _ in range(2)]
        for q, p in zip(waiting, prompts(2, seed=1)):
            loop.submit(p, GREEDY, q.put)
        with pytest.raises(QueueFull, match="limit 2"):
            loop.submit(prompts(1, seed=2)[0], GREEDY, lambda out: None)
        with pytest.raises(RequestError, match="at most 2 may wait"):
            loop.submit_many([(p, GREEDY) for p in prompts(3)], [lambda out: None] * 3)
        for q in waiting:                                   # accepted requests still finish
            while not (out := q.get(timeout=60)).finished:
                pass
            assert out.finish_reason == "length"


def test_shutdown_without_grace_aborts_what_runs_and_refuses_new_requests(artifact):
    engine = Engine(artifact, EngineConfig(max_num_seqs=1))
    loop = EngineLoop(engine).start()
    short, endless = queue.Queue(), queue.Queue()
    loop.submit(prompts(1)[0], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), short.put)
    loop.submit(prompts(1, seed=1)[0], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True), endless.put)
    loop.shutdown(grace=0.0)
    reasons = []
    for q in (short, endless):
        while not (out := q.get(timeout=5)).finished:
            pass
        reasons.append(out.finish_reason)
    assert reasons[1] == "abort" and reasons[0] in ("length", "abort")
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    with pytest.raises(LoopStopped):
        loop.submit(prompts(1)[0], GREEDY, lambda out: None)


STEP_DELAY = 0.02        # seconds added to every step below: a request of n tokens runs >= n x this


def slow_steps(engine: Engine) -> None:
    """Each model run STEP_DELAY longer, so a request is certainly still running a few steps in."""
    real_run = engine.runner.run_step
    engine.runner.run_step = lambda entry, step: (time.sleep(STEP_DELAY), real_run(entry, step))[1]


def shut_down_after_the_first_token(engine: Engine, prompt: list[int], params: SamplingParams,
                                    grace: float) -> tuple[list[tuple[float, RequestOutput]], float, float]:
    """Start a loop, submit one request, and shut down (with `grace`) once its first token is out.
    Returns every output with the time it was delivered, when shutdown began and when it returned."""
    loop, outputs, first = EngineLoop(engine).start(), [], threading.Event()

    def sink(out: RequestOutput) -> None:
        outputs.append((time.monotonic(), out))
        first.set()

    loop.submit(prompt, params, sink)
    assert first.wait(30), "no first token in 30 s"
    began = time.monotonic()
    loop.shutdown(grace=grace)
    return outputs, began, time.monotonic()


def test_shutdown_lets_a_running_request_finish_all_its_tokens_within_the_grace(artifact, alone):
    engine = Engine(artifact)
    slow_steps(engine)
    p = prompts(12)[0]
    outputs, began, _ = shut_down_after_the_first_token(engine, p, GREEDY, grace=60.0)
    after = [out for t, out in outputs if t > began]
    assert after and not any(out.finished for t, out in outputs if t <= began)     # running when shutdown began
    assert after[-1].finish_reason == "length"
    assert [t for _, out in outputs for t in out.new_token_ids] == alone[tuple(p)]  # every token, the same ones
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks and not engine.requests


def test_past_the_grace_a_running_request_is_aborted(artifact):
    engine = Engine(artifact)
    slow_steps(engine)
    grace, params = 0.5, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)    # 200 steps: >= 4 s
    outputs, began, returned = shut_down_after_the_first_token(engine, prompts(1)[0], params, grace)
    tokens_in_grace = sum(len(out.new_token_ids) for t, out in outputs if t > began)
    assert outputs[-1][1].finish_reason == "abort"
    assert 3 <= tokens_in_grace < 200 and returned - began < grace + 2.0     # it ran on in the grace, then stopped
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks and not engine.requests


def test_closing_a_stream_early_aborts_its_request(artifact):
    engine = Engine(artifact)
    with EngineLoop(engine) as loop:
        stream = loop.stream(prompts(1)[0], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        next(stream)
        stream.close()
        loop.generate(prompts(1, seed=3), GREEDY)          # a later step has applied the abort
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks and not engine.requests


def test_a_second_owner_is_refused(artifact):
    engine = Engine(artifact)
    engine.add_request(prompts(1)[0], GREEDY)
    with pytest.raises(RuntimeError, match="added directly"):
        EngineLoop(engine).start()
