"""The engine loop's thread computes the steps with the process's only OpenMP team.

OpenMP keeps a pool of worker threads for each thread that opened a parallel region, and libgomp
counts every pool's workers against the cores: once they outnumber the cores, a barrier wait spins
~100 turns instead of ~300000 and then sleeps in the kernel. The thread that built an engine has a
pool; while it stayed, a step plan run from the loop thread slept and woke at most of its few
hundred barriers (~390 sleeps a token on SmolLM2, against ~15 in the building thread) and batch-1
decode streamed at ~2.5x the step `llmc profile` timed. Starting a loop ends those idle workers
(runtime/step_pipeline.release_idle_threads).
"""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from llmc.runtime.engine import Engine
from llmc.runtime.engine_loop import EngineLoop
from llmc.runtime.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process's threads in /proc")


def live_threads() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


@pytest.mark.parametrize("threads", [2], indirect=True)
def test_starting_a_loop_ends_the_starting_threads_idle_openmp_workers(tiny_family, threads):
    engine = Engine(tiny_family("llama_hd32")[2])
    run, seen = engine.runner.run_step, {}

    def step(entry, inputs):            # the intra-op threads the loop thread's steps get
        seen.setdefault("step_threads", set()).add(torch.get_num_threads())
        return run(entry, inputs)

    engine.runner.run_step = step

    def caller():           # a fresh thread, so that the workers of its OpenMP pool are new threads
        before = live_threads()
        torch.ones(1 << 20).mul(2)                      # a parallel region here: this thread's pool
        seen["workers"] = live_threads() - before
        with EngineLoop(engine) as loop:
            seen["tokens"] = loop.generate([[5, 6, 7]], GREEDY)[0].token_ids
            seen["left"] = seen["workers"] & live_threads()

    thread = threading.Thread(target=caller)
    thread.start()
    thread.join()
    assert len(seen["workers"]) == threads - 1, "the caller's parallel region started no workers to end"
    assert len(seen["tokens"]) == GREEDY.max_tokens and seen["step_threads"] == {threads}
    assert seen["left"] == set(), "the caller's idle OpenMP workers outlived the loop's start"
