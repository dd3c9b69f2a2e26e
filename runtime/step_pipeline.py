"""The stages of an engine step, as async scheduling runs them (vLLM V1's design, our own code).

  plan     schedule the step and build its inputs on the host (Engine.plan_step)
  launch   fill in the tokens that were pending, apply block copies, start the forward pass in a
           worker thread or here (Engine.launch)
  finish   wait for its logits, sample, record the tokens: the token stage (Engine.finish_step)
  emit     detokenise, find stop strings, hand outputs over: the output stage (Engine.emit)
With overlap the engine loop runs plan(N+1) while N computes, then finish(N), launch(N+1), emit(N)
while N+1 computes. The scheduler must see step N as done when it plans N+1: each chunk's tokens
count as computed when it is scheduled, and each token it will sample as *pending*
(Sequence.num_pending), so N+1 may compute that token; its input id is a placeholder until
launch(N+1), which comes after finish(N) has recorded it. What N+1 computes for a request that N
(or N's stop strings) ended is dropped. Pure bookkeeping here; the engine owns the rest.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from llmc.kernels.native import native_kernels_loaded

from .scheduler import Chunk, ScheduledStep
from .step_inputs import StepInputs

log = logging.getLogger("llmc")


@dataclass
class PlannedStep:
    """A scheduled step with its inputs built on the host. The input ids of tokens that the step
    before it was still sampling (`pending`: chunk index, first input row) are filled in at launch."""

    scheduled: ScheduledStep
    inputs: StepInputs
    pending: list[tuple[int, int]]
    preemptions: dict[int, int]      # each chunk's sequence (id): its preemption count when scheduled
    copies: list[tuple[int, int]]    # copy-on-write block copies still to apply before it computes


@dataclass
class LaunchedStep:
    planned: PlannedStep
    result: Future                   # (logit rows [R, vocab] fp32 on the runner's device, seconds the forward took)


def run_on(worker: ThreadPoolExecutor | None, fn, *args) -> Future:
    """fn(*args) submitted to `worker`, or run here and now (None) with its result or error in a Future."""
    if worker is not None:
        return worker.submit(fn, *args)
    done: Future = Future()
    try:
        done.set_result(fn(*args))
    except Exception as exc:
        done.set_exception(exc)
    return done


def reads_pending(chunks: list[Chunk]) -> list[tuple[int, int]]:
    """(chunk index, its first input row) of the chunks that compute a token still pending."""
    found, row = [], 0
    for i, c in enumerate(chunks):
        if c.seq.num_pending and c.end > len(c.seq.prompt_ids) + len(c.seq.output_ids):
            found.append((i, row))
        row += c.end - c.start
    return found


def advance(chunks: list[Chunk], now: float) -> None:
    """Scheduled is as good as computed for the scheduler (the step after may be planned before
    this one ends): each chunk's tokens count as computed, and its sampled token as pending. A
    chunk verifying drafts is settled when it ends (how many drafts it keeps is not known)."""
    for c in chunks:
        c.seq.first_scheduled_time = c.seq.first_scheduled_time or now
        if not c.num_drafts:
            c.seq.num_computed = c.end
            c.seq.num_pending += c.samples


def release_idle_threads(device: torch.device) -> None:
    """End the calling thread's idle OpenMP workers before another thread (an engine loop's)
    computes the steps on the CPU: OpenMP keeps a pool of workers per thread that opened a parallel
    region, and libgomp, counting every pool's workers against the cores, shortens its barrier spin
    from ~300000 to ~100 turns once they outnumber the cores. A step plan meets a barrier after each
    of its few hundred kernels, so the team then sleeps and wakes in the kernel at most of them:
    batch-1 decode streamed from the loop thread took ~2.5x the step that `llmc profile` timed in
    the thread that built the engine (SmolLM2 int4, 2-core Xeon). With the release both spin alike,
    also where other processes load the cores (a preempted teammate then keeps the others spinning:
    the barrier's cost, the same for the profiled step). The runtime starts new workers if the
    caller computes again. Where the native kernels are not loaded the workers stay, said at INFO."""
    if device.type != "cpu":
        return
    if not native_kernels_loaded():
        log.info("the calling thread's idle OpenMP threads stay (the native kernels are not loaded): the "
                 "loop thread's team may sleep at its barriers")
    elif torch.ops.llmc.release_idle_threads() != 0:
        log.info("the OpenMP runtime kept the calling thread's idle threads (called inside a parallel region): "
                 "the loop thread's team may sleep at its barriers")


def leaves_a_core(cores: int, threads: int, local_ranks: int = 1) -> bool:
    """Whether `local_ranks` ranks of `threads` intra-op threads each leave one of `cores` cores free."""
    return cores > threads * local_ranks


def overlap_pays(device: torch.device, local_ranks: int = 1) -> bool:
    """Async scheduling's default: on when the forward pass leaves the host's cores free, on a GPU or
    on a CPU with more cores than the forward's OpenMP teams take (torch's threads in each of the
    `local_ranks` tensor-parallel ranks on this machine); off where the teams take every core, since host
    work beside them stalls the teams' barriers (on a 2-core CPU the server's throughput fell to 0.81x
    with it on: README, "Benchmarks")."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return device.type == "cuda" or leaves_a_core(cores, torch.get_num_threads(), local_ranks)


def choose_async_scheduling(configured: bool | None, device: torch.device, speculating: bool,
                            local_ranks: int = 1) -> bool:
    """Whether an EngineLoop overlaps the host with the forward pass: never when speculating (drafts
    need the newest token), else as configured, else where it pays (`local_ranks`: the tensor-parallel
    ranks sharing this machine's cores, this one included); said once at INFO."""
    if speculating:
        chosen, why = False, "speculating: drafts need the newest token"
    elif configured is not None:
        chosen, why = configured, "as configured"
    else:
        chosen = overlap_pays(device, local_ranks)
        ranks = f" of {local_ranks} local ranks" if local_ranks > 1 else ""
        why = "the forward leaves the host a core" if chosen else f"the forward's threads{ranks} take every core"
    log.info("async scheduling %s (%s)", "on" if chosen else "off", why)
    return chosen
