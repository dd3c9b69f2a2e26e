"""What the GPU check measures, each a function of runners it is given (tools/gpu_check.py wires them).

  greedy           a runner decodes the prompts greedily on its own (judged in gpu_check_correct)
  decode_seconds   one decode step of B sequences (metadata, copy, launches or graph replay,
                   logits to the host) after a prefill of `context` tokens each
  kernel_table     each kernel's time in an eagerly launched batch-1 decode step and the bytes it
                   moves: the tensors it takes and returns (a gather or KV write: twice what it
                   writes) plus the K/V an attention kernel reads or a RoPE + KV write kernel
                   writes. On a GPU the times are the device's, from CUDA events recorded between
                   the launches with no synchronisation among them, while a sleep kernel queued
                   first holds the device until the host has queued the whole step (so no launch
                   waits for the host, and an event pair brackets one kernel's device time). On a
                   CPU, each launch's wall time (the launches are the work).
  copy_bandwidth   bytes read + written per second by one large device-to-device copy: the roofline
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace

import torch

from llmc.runtime.block_manager import BlockManager
from llmc.runtime.engine import kv_cache_dtype
from llmc.runtime.memory_plan import BYTES_PER_ELEMENT
from llmc.runtime.model_runner import ModelRunner
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.scheduler import Chunk
from llmc.runtime.sequence import Sequence
from llmc.runtime.slot_program import LaunchTime
from llmc.runtime.step_inputs import StepInputs, build_step_inputs

BLOCK_SIZE = 16


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Batch:
    """Sequences that prefill and then decode together on one runner, with their own blocks."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]], max_new: int, num_blocks: int):
        self.runner = runner
        self.blocks = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=False)
        self.seqs = [Sequence(i, list(p), SamplingParams(max_tokens=max_new)) for i, p in enumerate(prompts)]
        for s in self.seqs:
            self.blocks.allocate(s.seq_id, s.prompt_ids)
            self.blocks.append(s.seq_id, s.num_tokens + max_new)

    def prefill(self, every_position: bool = False) -> torch.Tensor:
        """Logits at each prompt's last token, or at every position of every prompt, in order."""
        return self.runner.run("prefill", build_step_inputs(
            [Chunk(s, 0, s.num_tokens, s.num_tokens if every_position else 1) for s in self.seqs], self.blocks))

    def decode(self, tokens: list[int]) -> torch.Tensor:
        for s, t in zip(self.seqs, tokens):
            s.output_ids.append(t)
        chunks = [Chunk(s, s.num_tokens - 1, s.num_tokens) for s in self.seqs]
        return self.runner.run("decode", build_step_inputs(chunks, self.blocks))


def blocks_for(batch: int, tokens: int) -> int:
    return batch * -(-tokens // BLOCK_SIZE)


def greedy(runner: ModelRunner, prompts: list[list[int]], tokens: int, num_blocks: int
           ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Each prompt's `tokens` greedy tokens, decoded as one batch, and the logits of every step."""
    batch = Batch(runner, prompts, tokens + 1, num_blocks)
    logits, picked, steps = batch.prefill(), [], []
    for step in range(tokens):
        steps.append(logits)
        picked.append(logits.argmax(-1).tolist())
        if step + 1 < tokens:
            logits = batch.decode(picked[-1])
    return [list(col) for col in zip(*picked)], steps


def decode_seconds(runner: ModelRunner, batch: int, steps: int, context: int, vocab: int, seed: int = 0) -> float:
    """Mean wall time of one decode step of `batch` sequences holding `context` tokens each."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(context)] for _ in range(batch)]
    runs = Batch(runner, prompts, steps + 3, blocks_for(batch, context + steps + 3))
    runs.prefill()
    tokens = [5] * batch
    for _ in range(2):
        runs.decode(tokens)                    # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        runs.decode(tokens)
    return (time.perf_counter() - start) / steps


@dataclass(frozen=True)
class KernelRow:
    label: str
    kind: str
    launches: int          # per step
    seconds: float         # per step, all its launches
    bytes: int             # per step, all its launches


def kv_bytes_per_token_per_layer(runner: ModelRunner) -> int:
    cfg = runner.artifact.config
    return 2 * cfg.num_kv_heads * cfg.head_dim * BYTES_PER_ELEMENT[kv_cache_dtype(runner.artifact)]


def launch_bytes(launch, batch: int, context: int, kv_token_bytes: int) -> int:
    """Bytes one launch moves (module docstring): its tensors, plus the K/V it reads or writes."""
    moved = 2 * launch.written_bytes if launch.kind == "data_movement" else launch.read_bytes + launch.written_bytes
    if launch.kind == "attention":
        moved += batch * context * kv_token_bytes
    elif "rope_kv_write" in launch.label:
        moved += batch * kv_token_bytes
    return moved


def kernel_table(runner: ModelRunner, context: int, repeats: int, vocab: int) -> list[KernelRow]:
    """Per kernel, its time and bytes in one batch-1 decode step, launched eagerly (mean of `repeats`)."""
    rng = random.Random(1)
    runs = Batch(runner, [[rng.randrange(3, vocab) for _ in range(context)]], repeats + 2,
                 blocks_for(1, context + repeats + 2))
    runs.prefill()
    kv_token = kv_bytes_per_token_per_layer(runner)
    rows: dict[str, list] = {}
    for step in range(repeats + 1):
        seq = runs.seqs[0]
        seq.output_ids.append(5)
        host = build_step_inputs([Chunk(seq, seq.num_tokens - 1, seq.num_tokens)], runs.blocks)
        launches = device_launch_times(runner, host) if runner.device.type == "cuda" else \
            runner.run_timed("decode", host)[1]
        if step == 0:
            continue                           # warm-up
        for launch in launches:
            row = rows.setdefault(launch.label, [launch.kind, 0, 0.0, 0])
            row[1] += 1
            row[2] += launch.seconds
            row[3] += launch_bytes(launch, 1, seq.num_tokens, kv_token)
    return sorted((KernelRow(label, kind, n // repeats, t / repeats, b // repeats)
                   for label, (kind, n, t, b) in rows.items()), key=lambda r: -r.seconds)


HOLD_CYCLES = 200_000_000       # ~0.1 s of a ~2 GHz GPU: longer than the host takes to queue a decode step


def device_launch_times(runner: ModelRunner, host: StepInputs) -> list[LaunchTime]:
    """One eager decode step's launches, each with its device time from CUDA events (module docstring)."""
    executor = runner.executor
    events = [torch.cuda.Event(enable_timing=True)]

    def mark() -> None:                        # called after each launch instead of a synchronisation
        events.append(torch.cuda.Event(enable_timing=True))
        events[-1].record()

    with torch.inference_mode():
        feeds = executor.on_device(host, runner.buffers).feeds(executor.kv_cache)
        torch.cuda._sleep(HOLD_CYCLES)
        events[0].record()
        _, launches = executor.programs["decode"].timed(feeds, mark)
    torch.cuda.synchronize(runner.device)
    return [replace(launch, seconds=before.elapsed_time(after) / 1000)
            for launch, before, after in zip(launches, events, events[1:], strict=True)]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by the best of several copies of a large buffer."""
    size = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.ones(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size / best
