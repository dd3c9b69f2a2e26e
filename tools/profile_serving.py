"""`llmc profile --serving`: where an engine step's host time goes, phase by phase, at several batch
sizes and context lengths, before and after the host-side work of issue #24, in the same run.

The model: tools/serving_model.py's tiny Llama with SmolLM2-135M's vocabulary and tokenizer (host work
depends on batch, context and vocabulary, not on width). The sides, each its own engine on the
same artifact, serving the same requests:
  before   the step inputs rebuilt from scratch every step (step_inputs.FromScratchInputs in place of
           the engine's input batch) and synchronous steps (async_scheduling=False)
  sync     the persistent input batch with synchronous steps: after's inputs without its overlap, so
           the table shows what each of the two changes does
  after    the engine's defaults: the persistent input batch, and an EngineLoop that schedules and
           builds step N+1, and processes step N's output, while step N computes
Each point (batch, context) is served the way the server serves: one EngineLoop, greedy, ignore_eos,
every request the same max_tokens. Every prompt is one shared prefix plus UNIQUE_TOKENS of its own,
so the prefix is prefilled once (by a request served just before) and every other request hits the
prefix cache, while every block table still holds context / block_size entries; each sequence ends
holding `context` tokens. Only decode steps are measured: the engine's host_times and the wall clock
are read when every request has 1 + WARMUP_TOKENS output tokens and again `steps` tokens later (both
reads in the same place of a step: the sink of its last request's output), so the window holds
`steps` whole decode steps of the full batch and no prefill.

Printed per step: each host phase (schedule, build, sample, commit, output), their sum (host), the
forward pass (compute), the part of it the loop spent blocked (wait), and the step's wall time; host
as a share of that step, and each side's host time over before's. The tiny model's compute is far
cheaper than SmolLM2's, so each point also shows SmolLM2-135M's decode-step memory floor at that
batch and context (tools/serving_model.py: the bytes it must read over the read bandwidth measured in
this run) and the host time as a share of it: a step is at least that long, so that share is an
upper bound.
"""

from __future__ import annotations

import json
import math
import tempfile
import threading
import time
from pathlib import Path

import torch
import typer

from llmc.runtime.engine import Engine, EngineConfig, kv_cache_dtype
from llmc.runtime.engine_loop import EngineLoop
from llmc.runtime.host_times import HOST_PHASES, HostTimes
from llmc.runtime.memory_plan import kv_bytes_per_token
from llmc.runtime.request import RequestOutput
from llmc.runtime.sampling_params import RequestError, SamplingParams
from llmc.runtime.step_inputs import FromScratchInputs

from .bench import parse_sizes
from .profile_steps import cpu_name
from .read_floor import ReadBandwidth
from .serving_model import (FLOOR_DTYPE, decode_floor_bytes, describe_shapes, smollm2_135m, tiny_serving_model,
                            weight_bytes_read)

UNIQUE_TOKENS = 4     # prompt tokens of each request after the shared prefix
WARMUP_TOKENS = 2     # decode tokens of every request before the window opens
TAIL_TOKENS = 1       # decode tokens after it closes (the window never holds a request's last step)
BLOCK_SIZE = 16
SIDES = ("before", "sync", "after")


def max_tokens(steps: int) -> int:
    """Each request's output tokens: the first (from its prefill), the warm-up, the window, the tail."""
    return 1 + WARMUP_TOKENS + steps + TAIL_TOKENS


def check_grid(contexts: list[int], steps: int, model_context: int) -> None:
    """Every context leaves room for a prefix, the unique tokens and every output token, within the model's."""
    if steps < 1:
        raise RequestError(f"--steps {steps} must be at least 1")
    least = max_tokens(steps) + UNIQUE_TOKENS + 1
    if bad := [c for c in contexts if c > model_context]:
        raise RequestError(f"context {bad[0]} is beyond the model's {model_context} tokens; give --contexts up to "
                           f"{model_context}")
    if bad := [c for c in contexts if c < least]:
        raise RequestError(f"context {bad[0]} is too short for {steps} measured steps: it must be at least {least} "
                           f"(prompt and every output token); lengthen it or lower --steps")


def serving_engines(artifact, batches: list[int], contexts: list[int], steps: int) -> dict[str, Engine]:
    """Each side's engine (module docstring), with KV blocks for the largest point twice over: the
    shared prefix once, and each request's own blocks."""
    own = math.ceil((BLOCK_SIZE + UNIQUE_TOKENS + max_tokens(steps)) / BLOCK_SIZE) + 1
    blocks = max(b * own for b in batches) + 2 * math.ceil(max(contexts) / BLOCK_SIZE)
    per_token = kv_bytes_per_token(artifact.config, kv_cache_dtype(artifact))
    config = dict(kv_cache_bytes=max(2 * blocks * BLOCK_SIZE * per_token, 16 * 2**20),
                  block_size=BLOCK_SIZE, max_num_seqs=max(batches),
                  max_batched_tokens=max(2048, max(batches) * (BLOCK_SIZE + UNIQUE_TOKENS)))
    before = Engine(artifact, EngineConfig(**config, async_scheduling=False))
    before.input_batch = FromScratchInputs(before.blocks)
    return {"before": before, "sync": Engine(artifact, EngineConfig(**config, async_scheduling=False)),
            "after": Engine(artifact, EngineConfig(**config, async_scheduling=True))}


class DecodeWindow:
    """Every request's sink: counts output tokens and reads the engine's host times and the clock when
    every request holds `first` tokens and again when every one holds `first + steps` (called in the
    loop thread, after a step, so both reads fall at the same place in their steps)."""

    def __init__(self, engine: Engine, batch: int, first: int, steps: int):
        self.engine, self.batch, self.steps = engine, batch, steps
        self.marks = (first, first + steps)
        self.reached = [0, 0]
        self.reads: list[tuple[HostTimes, float] | None] = [None, None]
        self.counts: dict[int, int] = {}
        self.errors: list[str] = []
        self.apart = 0       # requests that did not hold exactly `mark` tokens when the last one reached it
        self.finished = 0
        self.done = threading.Event()

    def sink(self, out: RequestOutput) -> None:
        before = self.counts.get(out.request_id, 0)
        self.counts[out.request_id] = now = before + len(out.new_token_ids)
        for i, mark in enumerate(self.marks):
            if before < mark <= now:
                self.reached[i] += 1
                if self.reached[i] == self.batch:
                    self.reads[i] = (self.engine.host_times.snapshot(), time.perf_counter())
                    self.apart += sum(n != mark for n in self.counts.values())
        if out.finished:
            self.errors += [out.error] if out.error else []
            self.finished += 1
            if self.finished == self.batch:
                self.done.set()

    def per_step(self) -> dict[str, float]:
        """Seconds per decode step in the window: each host phase, host, compute, wait, and the wall time."""
        if self.errors or None in self.reads:
            raise RuntimeError(f"the profile's requests did not all decode through the window: {self.errors[:1]}")
        if self.apart:
            raise RuntimeError(f"the batch of {self.batch} did not decode in step: {self.apart} times a request was "
                               "ahead of or behind the others at a mark, so the window would not be whole decode steps")
        (start, t0), (end, t1) = self.reads
        spent = end.since(start)
        mean = spent.per_step()
        return {**{p: mean[p] for p in (*HOST_PHASES, "host", "compute", "wait")},
                "step": (t1 - t0) / self.steps, "engine_steps": spent.steps}


def point_prompts(vocab: int, batch: int, context: int, steps: int, seed: int) -> list[list[int]]:
    """One warm-up prompt then `batch` prompts: a shared prefix, each with UNIQUE_TOKENS of its own."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab, (context - max_tokens(steps) - UNIQUE_TOKENS,), generator=g).tolist()
    return [prefix + torch.randint(3, vocab, (UNIQUE_TOKENS,), generator=g).tolist() for _ in range(batch + 1)]


def measure_point(engine: Engine, batch: int, context: int, steps: int, seed: int = 0) -> dict[str, float]:
    """Serve one point (module docstring) through an EngineLoop; seconds per decode step by phase."""
    warm, *prompts = point_prompts(engine.artifact.config.vocab_size, batch, context, steps, seed)
    greedy = dict(temperature=0.0, ignore_eos=True)
    window = DecodeWindow(engine, batch, 1 + WARMUP_TOKENS, steps)
    with EngineLoop(engine) as loop:
        loop.generate([warm], SamplingParams(max_tokens=1, **greedy))       # prefills the shared prefix
        loop.submit_many([(p, SamplingParams(max_tokens=max_tokens(steps), **greedy)) for p in prompts],
                         [window.sink] * batch)
        window.done.wait()
    return window.per_step()


def profile_serving(batches: list[int], contexts: list[int], steps: int, floor: ReadBandwidth | None = None) -> dict:
    """Build the tiny model, serve every (batch, context) on every side, and the SmolLM2 floors over the
    read bandwidth (`floor`, sampled before and after the grid); the result as JSON-ready data
    (format_serving prints it)."""
    reference = smollm2_135m()
    check_grid(contexts, steps, reference.max_position_embeddings)
    floor = floor or ReadBandwidth()
    samples = [floor.sample()]
    with tempfile.TemporaryDirectory(prefix="llmc-profile-serving-") as folder:
        artifact, tokenizer = tiny_serving_model(Path(folder))
        engines = serving_engines(artifact, batches, contexts, steps)
        points = []
        for batch in batches:
            for context in contexts:
                sides = {side: measure_point(engines[side], batch, context, steps, seed=context) for side in SIDES}
                points.append({"batch": batch, "context": context, **sides,
                               "floor_bytes": decode_floor_bytes(reference, batch, context)})
    samples.append(floor.sample())
    return {"cpu": cpu_name(), "threads": torch.get_num_threads(), "steps": steps, "tokenizer": tokenizer,
            "model": describe_shapes(artifact.config), "reference": describe_shapes(reference),
            "reference_weight_bytes": weight_bytes_read(reference, 1),
            "reference_kv_bytes_per_token": kv_bytes_per_token(reference, FLOOR_DTYPE),
            "floor_kernel": floor.describe(), "bandwidth_samples": samples, "bandwidth": max(samples),
            "points": points}


COLUMNS = (*HOST_PHASES, "host", "compute", "wait", "step")


def _row(point: dict, side: str, bandwidth: float) -> str:
    t, before = point[side], point["before"]
    floor = point["floor_bytes"] / bandwidth
    versus = f"{t['host'] / before['host']:.2f}" if side != "before" and before["host"] > 0 else ""
    return (f"{point['batch']:>6} {point['context']:>7} {side:<6} "
            + " ".join(f"{1000 * t[c]:>8.3f}" for c in COLUMNS)
            + f" {100 * t['host'] / t['step']:>8.0f}% {1000 * floor:>10.2f} {100 * t['host'] / floor:>9.1f}%"
            + f" {versus:>11}")


def format_serving(r: dict) -> str:
    """The result of profile_serving as a table, one row per point and side."""
    header = (f"{'batch':>6} {'context':>7} {'side':<6} " + " ".join(f"{c:>8}" for c in COLUMNS)
              + f" {'host/step':>9} {'floor ms':>10} {'host/floor':>10} {'host/before':>11}")
    lines = [
        f"{r['cpu']} | torch threads {r['threads']} | tiny Llama: {r['model']} | {r['tokenizer']}",
        f"ms per decode step, {r['steps']} steps per point; before: step inputs from scratch, synchronous steps; "
        f"sync: persistent input batch, synchronous steps; after: persistent input batch, async scheduling",
        "host = schedule + build + sample + commit + output; wait: the part of compute the loop was blocked on; "
        "step: wall time per step; host/before: the row's host time over the before row's",
        f"floor: SmolLM2-135M's decode step ({r['reference']}) reads {FLOOR_DTYPE} weights "
        f"{r['reference_weight_bytes'] / 1e6:.0f} MB + K/V {r['reference_kv_bytes_per_token'] / 1e3:.1f} kB per "
        f"token held, over the read bandwidth {r['bandwidth'] / 1e9:.1f} GB/s ({r['floor_kernel']}, best of "
        f"{len(r['bandwidth_samples'])} samples beside the grid): a step is at least that long, so host/floor is an "
        f"upper bound",
        header,
        *(_row(point, side, r["bandwidth"]) for point in r["points"] for side in SIDES),
    ]
    return "\n".join(lines)


def profile_serving_cmd(batches: str, contexts: str, steps: int, json_file: Path | None) -> None:
    """`llmc profile --serving`: parse the options, run the profile, print the table (and write JSON)."""
    grid = (parse_sizes(batches, "--batches", "1,64,256"), parse_sizes(contexts, "--contexts", "128,2048,8192"))
    check_grid(grid[1], steps, smollm2_135m().max_position_embeddings)     # before minutes of work
    result = profile_serving(*grid, steps)
    typer.echo(format_serving(result))
    if json_file:
        json_file.write_text(json.dumps(result, indent=2))
