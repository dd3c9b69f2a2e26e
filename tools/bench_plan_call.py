"""A step plan's call from Python: `python -m llmc.tools.bench_plan_call ART [--steps 40]`.

One batch-1 decode step of ART (a 16-token prompt, then the same decode step again and again), its
step plan called both ways Python can call it, alternating, each call cold (after a read of
`--flush-mib` MiB that evicts the caches, as the weights' stream does between serving steps) and
then once more warm:
  pybind11     how runtime/step_plan.py calls it (kernels/cpu/plan_binding.cpp's run_plan on the
               plan's address)
  torchscript  the plan's TorchScript method (StepPlan.run: the JIT boxes the inputs and the list
               it returns)
Both run the same parallel region on the same inputs, so the difference is the call. Prints each
one's median milliseconds, the difference and its share of the step. A benchmark, not a test: the
numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import torch

from llmc.compiler.artifact_format import ArtifactError
from llmc.runtime.artifact import load_artifact
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.scheduler import Chunk
from llmc.runtime.sequence import Sequence
from llmc.runtime.step_plan import StepPlanProgram
from llmc.runtime.step_inputs import build_step_inputs

PROMPT = 16


def decode_calls(engine: Engine) -> dict[str, Callable[[], object]]:
    """The decode plan's two calls on one decode step's inputs (after a prefill of PROMPT tokens)."""
    program = engine.runner.executor.programs["decode"]
    if not isinstance(program, StepPlanProgram):
        raise SystemExit("this artifact's decode step does not run as a native step plan here "
                         "(a GPU, or --kernels reference); run it on a CPU with the native kernels")
    seq = Sequence(0, list(range(5, 5 + PROMPT)), SamplingParams(max_tokens=4))
    engine.blocks.allocate(seq.seq_id, seq.prompt_ids)
    engine.blocks.append(seq.seq_id, PROMPT + 1)
    engine.runner.run_step("prefill", build_step_inputs([Chunk(seq, 0, PROMPT)], engine.blocks))
    seq.num_computed = PROMPT
    seq.output_ids.append(7)
    step = build_step_inputs([Chunk(seq, PROMPT, PROMPT + 1)], engine.blocks)
    inputs = program._inputs(step.feeds(engine.runner.executor.kv_cache))
    plan = program._plan
    return {"pybind11": lambda: program._run(program._address, *inputs), "torchscript": lambda: plan.run(*inputs)}


def seconds(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--steps", type=int, default=40, help="calls of each kind, cold and warm")
    parser.add_argument("--flush-mib", type=int, default=600, help="MiB read before each cold call")
    args = parser.parse_args(argv)
    try:
        artifact = load_artifact(args.artifact)
    except ArtifactError as exc:
        raise SystemExit(f"bench_plan_call: {exc}") from None
    engine = Engine(artifact, EngineConfig())
    calls = decode_calls(engine)
    flush = torch.ones(args.flush_mib * 2**20 // 4)
    times = {(name, state): [] for name in calls for state in ("cold", "warm")}
    with torch.inference_mode():
        for call in calls.values():
            call()                                   # first-call costs are no step's
        for _ in range(args.steps):
            for name, call in calls.items():
                flush.sum()
                times[name, "cold"].append(seconds(call))
                times[name, "warm"].append(seconds(call))
    print(f"{args.artifact}: batch-1 decode step plan, median of {args.steps} calls each, alternating")
    for state in ("cold", "warm"):
        fast, slow = (statistics.median(times[name, state]) for name in ("pybind11", "torchscript"))
        print(f"  {state}: pybind11 {fast * 1e3:.3f} ms, torchscript {slow * 1e3:.3f} ms: the TorchScript call "
              f"costs {(slow - fast) * 1e6:.0f} us more ({(slow - fast) / fast:.1%} of the step)")


if __name__ == "__main__":
    main(sys.argv[1:])
