"""CUDA graphs for decode and verify steps: captured once per (padded batch size, verify width), replayed per step.

A decode step of S sequences launches the same few hundred kernels whatever the tokens are; on a
GPU, launching them one by one from Python costs more than running them at small S. So, as
nano-vllm and vLLM do, the executor captures the step once per shape and replays the captured
shape that fits. A shape is a key (B, w): B padded sequences of w tokens each, all w of them
logit rows (T = R = B * w tokens, S = B sequences):

  decode    w = 1: the decode entry graph (one logit row a sequence, no gather), for every batch
            size in `decode_batch_sizes`.
  verify    w = 1 + K drafts, 2 <= w <= the engine's most drafts per step + 1 (adaptive K varies
            w between steps) and w <= block_size: the prefill entry graph, gathering every token's
            logits, for the shorter list `verify_batch_sizes`: only steps of at most
            VERIFY_MAX_TOKENS tokens. Each (B, w) is a graph and its pool memory grows with B * w;
            launch overhead only dominates small steps (a step of hundreds of tokens spends its
            time in the GEMMs, as vLLM's capture-size cap of 512 tokens assumes), and adaptive K
            drafts fewer tokens as the batch grows, so wide verify steps of large batches are rare
            and run eagerly at little cost.

A step replays the smallest captured batch size >= S of its own width:

  buffers   the graphs read their metadata from their own `StepBuffers`, sized at capture for
            the largest (B * w, block table) of every key, so it never grows and every view a
            replay loads sits at the address the capture recorded (checked at each replay: the
            capture contract).
  padding   a step of S sequences is padded to the batch size B with B - S rows that compute w
            tokens (token 0) at positions 0..w-1 into the executor's scratch block (a KV block
            the block manager never hands out): slots = the scratch block's first w slots (hence
            w <= block_size), seq_len w, every block-table entry the scratch block. Padding rows
            compute garbage on the scratch block only and never touch a live sequence's cache.
            Live rows' block tables are widened to the captured width with block 0, as
            `build_step_inputs` pads them (the Triton kernels never read entries past a
            sequence's length; the torch reference gathers them and weighs them by 0, so they
            must never point at the scratch block's garbage). `pad_decode_step` refuses a step
            that is not S rows of exactly w tokens and w logit rows each, in order.
  capture   every key runs eagerly first (Triton compiles on first call, which must not happen
            while capturing), then keys are captured largest B * w first into one shared pool.
  replay    the step's padded metadata is copied into the buffers (one host-to-device copy),
            the graph replays, and the live rows' S * w logits are copied out of the pool before
            the next replay can overwrite them.

A step the graphs cannot take runs eagerly, uncaptured: more sequences than the largest size of
its width, a wider block table, a width not captured (wider than the engine drafts or than a
block), a verify step whose sequences verify different numbers of drafts or that mixes verifying
and plain decodes, a prefill, or any other entry (the self-speculative `draft` graph).
`DecodeGraphs(..., cuda=False)` replays by running the step again on the same buffers: the
stand-in that lets CPU tests check the padding and buffer logic.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .step_inputs import StepBuffers, StepInputs

DecodeRun = Callable[[StepInputs, int], torch.Tensor]     # (padded step, verify width w) -> its logits
DECODE_ENTRY, VERIFY_ENTRY = "decode", "prefill"           # the entry graph a key of width 1 / w > 1 runs
VERIFY_MAX_TOKENS = 256                                    # verify graphs: B * w at most this (see docstring)
Key = tuple[int, int]                                      # (padded batch size B, verify width w)


def graph_entry(tokens: int) -> str:
    """The entry graph a key of verify width `tokens` captures."""
    return DECODE_ENTRY if tokens == 1 else VERIFY_ENTRY


def decode_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 32, every 16 up to 256, every 32 beyond, ending at max_num_seqs."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive; got {max_num_seqs}")
    sizes = [1, 2, 4, 8, *range(16, 33, 8), *range(48, 257, 16), *range(288, max_num_seqs + 1, 32)]
    sizes = [s for s in sizes if s < max_num_seqs]
    return sizes + [max_num_seqs]


def verify_batch_sizes(max_num_seqs: int, tokens: int) -> list[int]:
    """The decode batch sizes whose verify steps of width `tokens` compute at most VERIFY_MAX_TOKENS tokens."""
    return [b for b in decode_batch_sizes(max_num_seqs) if b * tokens <= VERIFY_MAX_TOKENS]


def verify_graph_sizes(max_num_seqs: int, max_verify_width: int, block_size: int) -> dict[int, list[int]]:
    """Verify width w -> its batch sizes, for w in 2..max_verify_width that fit a block (padding rows
    write w slots of the scratch block) and have a size at all."""
    widths = range(2, min(max_verify_width, block_size) + 1)
    return {w: sizes for w in widths if (sizes := verify_batch_sizes(max_num_seqs, w))}


def uniform(step: StepInputs, tokens: int) -> bool:
    """Whether `step` is S rows of exactly `tokens` tokens, every token a logit row, in order."""
    live = step.seq_lens.numel()
    rows = torch.arange(live * tokens, dtype=step.logits_indices.dtype)
    starts = torch.arange(live + 1, dtype=step.query_start_loc.dtype) * tokens
    return step.input_ids.numel() == live * tokens and torch.equal(step.logits_indices, rows) \
        and torch.equal(step.query_start_loc, starts)


def pad_decode_step(step: StepInputs, batch: int, width: int, scratch_block: int, block_size: int,
                    tokens: int = 1) -> StepInputs:
    """A decode (tokens = 1) or verify (tokens = w) step of S <= batch sequences padded to `batch`
    rows and `width` table columns (see module docstring): live rows unchanged, padding rows on
    the scratch block only."""
    live, pad = step.seq_lens.numel(), batch - step.seq_lens.numel()
    if pad < 0 or step.block_tables.shape[1] > width or not 1 <= tokens <= block_size \
            or not uniform(step, tokens):
        raise ValueError(f"cannot pad a step of {live} sequences, {step.input_ids.numel()} tokens, "
                         f"{step.logits_indices.numel()} logit rows and block table width "
                         f"{step.block_tables.shape[1]} to {batch} rows of {tokens} tokens (block size "
                         f"{block_size}) and table width {width}")
    tables = torch.zeros((batch, width), dtype=step.block_tables.dtype)       # live rows: padded with 0, as
    tables[:live, :step.block_tables.shape[1]] = step.block_tables            # build_step_inputs pads them
    tables[live:] = scratch_block
    offsets = torch.arange(tokens).repeat(pad)                                # positions 0..w-1 a padding row
    return StepInputs(
        input_ids=_extend(step.input_ids, torch.zeros_like(offsets)),
        positions=_extend(step.positions, offsets),
        query_start_loc=torch.arange(batch + 1, dtype=step.query_start_loc.dtype) * tokens,
        seq_lens=_extend(step.seq_lens, torch.full((pad,), tokens)),
        slot_mapping=_extend(step.slot_mapping, scratch_block * block_size + offsets),
        block_tables=tables,
        logits_indices=torch.arange(batch * tokens, dtype=step.logits_indices.dtype),
    )


def _extend(values: torch.Tensor, more: torch.Tensor) -> torch.Tensor:
    return torch.cat([values, more.to(values.dtype)])


def padding_step(batch: int, width: int, scratch_block: int, block_size: int, tokens: int = 1) -> StepInputs:
    """A step of `batch` padding rows of `tokens` tokens only (what warm-up and capture run)."""
    empty = StepInputs(*(torch.zeros(0, dtype=torch.int64),) * 2, torch.zeros(1, dtype=torch.int32),
                       torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int64),
                       torch.zeros((0, 0), dtype=torch.int32), torch.zeros(0, dtype=torch.int64))
    return pad_decode_step(empty, batch, width, scratch_block, block_size, tokens)


def addresses(step: StepInputs) -> tuple[int, ...]:
    return tuple(getattr(step, name).data_ptr() for name in StepInputs.__dataclass_fields__)


@dataclass(frozen=True)
class CaptureReport:
    batch_sizes: tuple[int, ...]                        # the decode step's (verify width 1)
    seconds: float               # warm-up and capture, all keys
    bytes: int                   # device memory the graphs and their pool took
    verify: tuple[tuple[int, tuple[int, ...]], ...] = ()   # (verify width w, its batch sizes), w = 2, 3, ...

    def describe(self) -> str:
        sizes = self.batch_sizes
        listed = ", ".join(map(str, sizes)) if len(sizes) <= 12 else \
            f"{', '.join(map(str, sizes[:6]))}, ..., {sizes[-1]}"
        verify = "" if not self.verify else \
            (f" and of the verify step for widths {self.verify[0][0]}..{self.verify[-1][0]} "
             f"({sum(len(s) for _, s in self.verify)} graphs, batch sizes up to {self.verify[0][1][-1]})")
        return (f"captured CUDA graphs of the decode step for {len(sizes)} batch sizes ({listed}){verify} in "
                f"{self.seconds:.1f} s, using {self.bytes / 2**30:.2f} GiB of GPU memory")


class _Captured:
    """One key's graph: its output tensor (in the pool) and the input addresses it read."""

    def __init__(self, replay: Callable[[], torch.Tensor], inputs: tuple[int, ...]):
        self.replay, self.inputs = replay, inputs


class DecodeGraphs:
    """The decode step captured per batch size, and the verify step per (batch size, width) (see
    module docstring)."""

    def __init__(self, run: DecodeRun, device: torch.device, batch_sizes: list[int], width: int,
                 scratch_block: int, block_size: int, cuda: bool = True,
                 verify: dict[int, list[int]] | None = None):
        self.run, self.device, self.cuda = run, device, cuda
        self.batch_sizes = sorted(batch_sizes)
        self.width, self.scratch_block, self.block_size = width, scratch_block, block_size
        self.sizes = {1: self.batch_sizes} | {w: sorted(s) for w, s in (verify or {}).items()}
        if any(not 2 <= w <= block_size or not s for w, s in self.sizes.items() if w != 1):
            raise ValueError(f"verify widths must be 2..{block_size} (a block), each with batch sizes; "
                             f"got {verify}")
        self.keys: list[Key] = [(b, w) for w, sizes in self.sizes.items() for b in sizes]
        capacity = max(StepBuffers.elements(self._padding(key)) for key in self.keys)
        self.buffers = StepBuffers(device, capacity=capacity)
        self._graphs: dict[Key, _Captured] = {}

    def _padding(self, key: Key) -> StepInputs:
        return padding_step(key[0], self.width, self.scratch_block, self.block_size, tokens=key[1])

    def _load(self, key: Key, step: StepInputs | None = None) -> StepInputs:
        padded = self._padding(key) if step is None else \
            pad_decode_step(step, key[0], self.width, self.scratch_block, self.block_size, tokens=key[1])
        return self.buffers.load(padded)

    def capture(self) -> CaptureReport:
        """Warm every key up, then capture them largest B * w first into one pool."""
        start = time.perf_counter()
        for key in self.keys:
            self.run(self._load(key), key[1])                 # compile every kernel for this shape
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()                          # so the warm-up's blocks are not counted
        free_before = torch.cuda.mem_get_info(self.device)[0] if self.cuda else 0
        pool = torch.cuda.graph_pool_handle() if self.cuda else None
        for key in sorted(self.keys, key=lambda k: (k[0] * k[1], k[0]), reverse=True):
            inputs = self._load(key)
            replay = self._capture_one(inputs, key[1], pool) if self.cuda else self._stand_in(inputs, key[1])
            self._graphs[key] = _Captured(replay, addresses(inputs))
        if self.cuda:
            torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0] if self.cuda else 0
        verify = tuple((w, tuple(s)) for w, s in self.sizes.items() if w != 1)
        return CaptureReport(tuple(self.batch_sizes), time.perf_counter() - start, max(used, 0), verify)

    def _capture_one(self, inputs: StepInputs, tokens: int, pool) -> Callable[[], torch.Tensor]:
        torch.cuda.synchronize(self.device)                   # the buffers' copy is done
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = self.run(inputs, tokens)

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay

    def _stand_in(self, inputs: StepInputs, tokens: int) -> Callable[[], torch.Tensor]:
        return lambda: self.run(inputs, tokens)

    def key_for(self, step: StepInputs, entry: str = DECODE_ENTRY) -> Key | None:
        """The captured (batch size, verify width) a step of `entry` replays with; None if it must
        run eagerly: a decode step has width 1, a prefill step replays only as a verify step, every
        sequence computing w captured tokens, all of them logit rows."""
        live = step.seq_lens.numel()
        if not self._graphs or live == 0 or step.block_tables.shape[1] > self.width:
            return None
        tokens = 1 if entry == DECODE_ENTRY else step.input_ids.numel() // live
        if graph_entry(tokens) != entry or tokens not in self.sizes or not uniform(step, tokens):
            return None
        sizes = self.sizes[tokens]
        return (sizes[bisect.bisect_left(sizes, live)], tokens) if live <= sizes[-1] else None

    def replay(self, step: StepInputs, key: Key) -> torch.Tensor:
        """Logits [S * w, vocab] of the step's live rows, copied out of the graph's pool."""
        inputs = self._load(key, step)
        captured = self._graphs[key]
        if addresses(inputs) != captured.inputs:
            raise RuntimeError(f"the {graph_entry(key[1])} graph of batch size {key[0]} and verify width {key[1]} "
                               "was captured on other buffer addresses")
        return captured.replay()[:step.seq_lens.numel() * key[1]].clone()

    def replay_seconds(self, batch: int, repeats: int, tokens: int = 1) -> float:
        """Mean time of one replay of the (batch, tokens) graph, back to back, of a step of padding
        rows only (what the device takes, without the host's per-step work; for profiles)."""
        replay = self._graphs[(batch, tokens)].replay
        self._load((batch, tokens))                           # padding rows: nothing live is touched
        replay()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        for _ in range(repeats):
            replay()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return (time.perf_counter() - start) / repeats
