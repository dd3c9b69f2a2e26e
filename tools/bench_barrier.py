"""The step plans' barrier wait policy against the others, in one run: `python -m
llmc.tools.bench_barrier [--rounds 273] [--mib 100] [--steps 64] [--busy 0]`.

A step is what a batch-1 decode step plan does (SmolLM2-135M int4: 273 kernels, ~100 MB of
weights): `rounds` rounds in which every thread streams its share of a slice of the weights, then
meets the others at the team barrier (kernels/barrier_rounds.py). Each policy runs `steps` steps,
taking turns step by step, so a shared machine's moments fall on all of them alike; the table gives
each policy's median, mean and 90th-percentile step and its sleeps a step (waits that ended in the
kernel). The policies: the step plans' own (spin, then yield the core, then sleep;
kernels/cpu/team_barrier.h), spin then sleep (the plans' policy before the yield phase), and spin
alone for the whole of both. `--busy N` starts N processes that keep a core busy for the run (a
loaded machine: there a waiter that keeps its core takes it from them, and from a teammate sharing
it). On a virtual machine whose host is busy, compare runs: the policies differ most there.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from contextlib import contextmanager
from typing import Iterator

import torch

from llmc.kernels.barrier_rounds import barrier_rounds_cpu, step_plan_wait_policy
from llmc.kernels.native import load_native_kernels
from llmc.tools.profile_steps import cpu_name

BUSY_LOOP = "while True: pass"


def policies() -> dict[str, tuple[int, int]]:
    """name -> (spin us, yield us): the step plans' policy first."""
    spin, yielded = step_plan_wait_policy()
    return {f"step plans' (spin {spin} us, yield {yielded} us, sleep)": (spin, yielded),
            f"spin {spin} us, sleep": (spin, 0),
            f"spin {spin + yielded} us, sleep": (spin + yielded, 0)}


@contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """`count` processes that each keep a core busy until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(count)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def run_policies(x: torch.Tensor, rounds: int, steps: int) -> dict[str, list[tuple[float, int]]]:
    """Each policy's (seconds, sleeps) per step, the policies taking turns (in a rotating order)."""
    chosen = policies()
    results: dict[str, list[tuple[float, int]]] = {name: [] for name in chosen}
    names = list(chosen)
    for name in names:                                                  # one untimed step each
        barrier_rounds_cpu(x, rounds, *chosen[name])
    for step in range(steps):
        for name in names[step % len(names):] + names[:step % len(names)]:
            r = barrier_rounds_cpu(x, rounds, *chosen[name])
            if r.behind:
                raise RuntimeError(f"the barrier let a thread past a round its teammate had not finished ({name})")
            results[name].append((r.seconds, r.sleeps))
    return results


def format_table(results: dict[str, list[tuple[float, int]]]) -> str:
    rows, first = [], None
    for name, samples in results.items():
        ms = sorted(1e3 * s for s, _ in samples)
        mean = statistics.mean(ms)
        first = first or mean
        rows.append(f"{name:44s} {statistics.median(ms):8.2f} {mean:8.2f} {ms[int(0.9 * (len(ms) - 1))]:8.2f} "
                    f"{statistics.mean(n for _, n in samples):8.1f} {mean / first:8.2f}x")
    head = f"{'policy':44s} {'median':>8s} {'mean':>8s} {'p90':>8s} {'sleeps':>8s} {'mean/own':>9s}"
    return "\n".join([head, *rows])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=273, help="barriers a step (SmolLM2 int4 decode: 273)")
    parser.add_argument("--mib", type=int, default=100, help="MiB a step reads (SmolLM2 int4 decode: ~100)")
    parser.add_argument("--steps", type=int, default=64, help="steps of each policy")
    parser.add_argument("--busy", type=int, default=0, help="processes keeping a core busy during the run")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.mib < 1 or args.steps < 1 or args.busy < 0:
        parser.error("--rounds, --mib and --steps must be at least 1 and --busy at least 0")
    load_native_kernels()
    x = torch.ones(args.mib * 2**20 // 4)
    with busy_processes(args.busy):
        results = run_policies(x, args.rounds, args.steps)
    print(f"{cpu_name()} | torch threads {torch.get_num_threads()} | {args.busy} busy processes | a step: "
          f"{args.rounds} rounds over {args.mib} MiB, ms")
    print(format_table(results))


if __name__ == "__main__":
    main()
