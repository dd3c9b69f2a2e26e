"""CUDA graphs for pure-decode steps: captured once per padded batch size, replayed per step.

A decode step of S sequences launches the same few hundred kernels whatever the tokens are; on a
GPU, launching them one by one from Python costs more than running them at small S. So, as
nano-vllm and vLLM do, the executor captures the decode graph once per batch size in
`decode_batch_sizes` and replays the smallest captured size >= S:

  buffers   the graphs read their metadata from their own `StepBuffers`, sized at capture for
            the largest batch and the widest block table, so it never grows and every view a
            replay loads sits at the address the capture recorded (checked at each replay).
  padding   a step of S sequences is padded to the batch size B with B - S rows that decode
            token 0 at position 0 into the executor's scratch block (a KV block the block
            manager never hands out): slot = first slot of the scratch block, seq_len 1, every
            block-table entry the scratch block. Padding rows compute garbage on the scratch
            block only and never touch a live sequence's cache. Live rows' block tables are
            widened to the captured width with block 0, as `build_step_inputs` pads them (the
            Triton kernels never read entries past a sequence's length; the torch reference
            gathers them and weighs them by 0, so they must never point at the scratch block's
            garbage).
  capture   every size runs eagerly first (Triton compiles on first call, which must not happen
            while capturing), then sizes are captured largest first into one shared memory pool.
  replay    the step's padded metadata is copied into the buffers (one host-to-device copy),
            the graph replays, and the live rows' logits are copied out of the pool before the
            next replay can overwrite them.

A step the graphs cannot take (more sequences than the largest size, a wider block table, a
prefill) runs eagerly. The graphs are keyed by batch size alone: their verify width is 1, one
logit row per sequence (the decode graph has no gather), so a step that asks for logits at
several positions of a sequence (a speculative verify step, prompt logprobs) is a prefill step
and runs the prefill graph eagerly, uncaptured; padding refuses a step whose logit rows are not
its sequences. `DecodeGraphs(..., cuda=False)` replays by running the step again on the
same buffers: the stand-in that lets CPU tests check the padding and buffer logic.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .step_inputs import StepBuffers, StepInputs

DecodeRun = Callable[[StepInputs], torch.Tensor]


def decode_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 32, every 16 up to 256, every 32 beyond, ending at max_num_seqs."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive; got {max_num_seqs}")
    sizes = [1, 2, 4, 8, *range(16, 33, 8), *range(48, 257, 16), *range(288, max_num_seqs + 1, 32)]
    sizes = [s for s in sizes if s < max_num_seqs]
    return sizes + [max_num_seqs]


def pad_decode_step(step: StepInputs, batch: int, width: int, scratch_block: int, block_size: int) -> StepInputs:
    """A pure-decode step of S <= batch sequences padded to `batch` rows and `width` table columns
    (see module docstring): live rows unchanged, padding rows on the scratch block only."""
    live, pad = step.seq_lens.numel(), batch - step.seq_lens.numel()
    if pad < 0 or step.block_tables.shape[1] > width or step.input_ids.numel() != live \
            or step.logits_indices.numel() != live:
        raise ValueError(f"cannot pad a step of {live} sequences, {step.input_ids.numel()} tokens, "
                         f"{step.logits_indices.numel()} logit rows and block table width "
                         f"{step.block_tables.shape[1]} to {batch} decode rows of width {width}")
    tables = torch.zeros((batch, width), dtype=step.block_tables.dtype)       # live rows: padded with 0, as
    tables[:live, :step.block_tables.shape[1]] = step.block_tables            # build_step_inputs pads them
    tables[live:] = scratch_block
    return StepInputs(
        input_ids=_extend(step.input_ids, pad, 0),
        positions=_extend(step.positions, pad, 0),
        query_start_loc=torch.arange(batch + 1, dtype=step.query_start_loc.dtype),
        seq_lens=_extend(step.seq_lens, pad, 1),
        slot_mapping=_extend(step.slot_mapping, pad, scratch_block * block_size),
        block_tables=tables,
        logits_indices=torch.arange(batch, dtype=step.logits_indices.dtype),
    )


def _extend(values: torch.Tensor, count: int, fill: int) -> torch.Tensor:
    return torch.cat([values, torch.full((count,), fill, dtype=values.dtype)])


def padding_step(batch: int, width: int, scratch_block: int, block_size: int) -> StepInputs:
    """A step of `batch` padding rows only (what warm-up and capture run)."""
    empty = StepInputs(*(torch.zeros(0, dtype=torch.int64),) * 2, torch.zeros(1, dtype=torch.int32),
                       torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int64),
                       torch.zeros((0, 0), dtype=torch.int32), torch.zeros(0, dtype=torch.int64))
    return pad_decode_step(empty, batch, width, scratch_block, block_size)


def addresses(step: StepInputs) -> tuple[int, ...]:
    return tuple(getattr(step, name).data_ptr() for name in StepInputs.__dataclass_fields__)


@dataclass(frozen=True)
class CaptureReport:
    batch_sizes: tuple[int, ...]
    seconds: float               # warm-up and capture, all sizes
    bytes: int                   # device memory the graphs and their pool took

    def describe(self) -> str:
        sizes = self.batch_sizes
        listed = ", ".join(map(str, sizes)) if len(sizes) <= 12 else \
            f"{', '.join(map(str, sizes[:6]))}, ..., {sizes[-1]}"
        return (f"captured CUDA graphs of the decode step for {len(sizes)} batch sizes ({listed}) in "
                f"{self.seconds:.1f} s, using {self.bytes / 2**30:.2f} GiB of GPU memory")


class _Captured:
    """One batch size's graph: its output tensor (in the pool) and the input addresses it read."""

    def __init__(self, replay: Callable[[], torch.Tensor], inputs: tuple[int, ...]):
        self.replay, self.inputs = replay, inputs


class DecodeGraphs:
    """The decode step captured per batch size (see module docstring)."""

    def __init__(self, run: DecodeRun, device: torch.device, batch_sizes: list[int], width: int,
                 scratch_block: int, block_size: int, cuda: bool = True):
        self.run, self.device, self.cuda = run, device, cuda
        self.batch_sizes = sorted(batch_sizes)
        self.width, self.scratch_block, self.block_size = width, scratch_block, block_size
        largest = padding_step(self.batch_sizes[-1], width, scratch_block, block_size)
        self.buffers = StepBuffers(device, capacity=StepBuffers.elements(largest))
        self._graphs: dict[int, _Captured] = {}

    def _load(self, batch: int, step: StepInputs | None = None) -> StepInputs:
        padded = padding_step(batch, self.width, self.scratch_block, self.block_size) if step is None else \
            pad_decode_step(step, batch, self.width, self.scratch_block, self.block_size)
        return self.buffers.load(padded)

    def capture(self) -> CaptureReport:
        """Warm every size up, then capture them largest first into one pool."""
        start = time.perf_counter()
        for batch in self.batch_sizes:
            self.run(self._load(batch))                       # compile every kernel for this shape
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()                          # so the warm-up's blocks are not counted
        free_before = torch.cuda.mem_get_info(self.device)[0] if self.cuda else 0
        pool = torch.cuda.graph_pool_handle() if self.cuda else None
        for batch in reversed(self.batch_sizes):
            inputs = self._load(batch)
            replay = self._capture_one(inputs, pool) if self.cuda else self._stand_in(inputs)
            self._graphs[batch] = _Captured(replay, addresses(inputs))
        if self.cuda:
            torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0] if self.cuda else 0
        return CaptureReport(tuple(self.batch_sizes), time.perf_counter() - start, max(used, 0))

    def _capture_one(self, inputs: StepInputs, pool) -> Callable[[], torch.Tensor]:
        torch.cuda.synchronize(self.device)                   # the buffers' copy is done
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = self.run(inputs)

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay

    def _stand_in(self, inputs: StepInputs) -> Callable[[], torch.Tensor]:
        return lambda: self.run(inputs)

    def batch_size_for(self, step: StepInputs) -> int | None:
        """The captured batch size a pure-decode `step` replays with; None if it must run eagerly."""
        live = step.seq_lens.numel()
        if not self._graphs or live > self.batch_sizes[-1] or step.block_tables.shape[1] > self.width:
            return None
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, live)]

    def replay(self, step: StepInputs, batch: int) -> torch.Tensor:
        """Logits [S, vocab] of the step's live rows, copied out of the graph's pool."""
        inputs = self._load(batch, step)
        captured = self._graphs[batch]
        if addresses(inputs) != captured.inputs:
            raise RuntimeError(f"the decode graph of batch size {batch} was captured on other buffer addresses")
        return captured.replay()[:step.seq_lens.numel()].clone()

    def replay_seconds(self, batch: int, repeats: int) -> float:
        """Mean time of one replay of `batch`'s graph, back to back, of a step of padding rows only
        (what the device takes, without the host's per-step work; for profiles)."""
        replay = self._graphs[batch].replay
        self._load(batch)                                     # padding rows: nothing live is touched
        replay()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        for _ in range(repeats):
            replay()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return (time.perf_counter() - start) / repeats
