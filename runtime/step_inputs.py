"""One step's attention metadata: built on the host from the scheduled chunks, then copied into
persistent buffers on the executor's device.

The metadata is an explicit frozen value (`StepInputs`) handed to the executor, never a global:
  input_ids, positions        [T]     the tokens computed in this step, flattened
  query_start_loc             [S+1]   where each sequence's tokens start in that list
  seq_lens                    [S]     each sequence's cached length after this step
  slot_mapping                [T]     where each token's K/V go in the paged cache
  block_tables                [S, MB] each sequence's blocks, padded with 0
  logits_indices              [R]     the token rows whose logits the step returns: each chunk's
                                      last `num_logits` tokens, in chunk order (R logit rows; one
                                      per chunk by default, so R = S; `logit_row_offsets` finds a
                                      chunk's rows)

`StepBuffers` holds one flat int64 device buffer that every step fills in place with one copy:
the int64 fields first, then the int32 fields packed two to an element (viewed as int32). It
hands out contiguous views of that buffer, so for steps of the same shape the addresses never
change (what a captured CUDA graph needs), and nothing is allocated per step on the device.
On a GPU the step is packed into a pinned host buffer of the same layout and copied with one
asynchronous host-to-device copy; the next step waits for that copy (an event) before it
overwrites the pinned buffer. On the CPU the step is packed straight into the buffer (the
executors skip it there and read the host's tensors: nothing is captured on a CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .block_manager import BlockManager
from .scheduler import Chunk

I64_FIELDS = ("input_ids", "positions", "slot_mapping", "logits_indices")
I32_FIELDS = ("query_start_loc", "seq_lens", "block_tables")


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor

    def feeds(self, kv_cache: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "positions": self.positions, "query_start_loc": self.query_start_loc,
                "seq_lens": self.seq_lens, "slot_mapping": self.slot_mapping, "block_tables": self.block_tables,
                "logits_indices": self.logits_indices, "kv_cache": kv_cache}


def build_step_inputs(chunks: list[Chunk], blocks: BlockManager) -> StepInputs:
    """Host-side metadata for computing tokens [start, end) of each chunk's sequence in one step."""
    ids, positions, slots, starts, lens, rows = [], [], [], [0], [], []
    for c in chunks:
        ids += c.seq.step_ids(c.start, c.end)
        positions += range(c.start, c.end)
        slots += [blocks.slot(c.seq.seq_id, p) for p in range(c.start, c.end)]
        rows += [starts[-1] + p - c.start for p in c.logit_positions]     # its tokens' rows in the step
        starts.append(starts[-1] + c.end - c.start)
        lens.append(c.end)
    tables = [blocks.block_table(c.seq.seq_id) for c in chunks]
    width = max(len(t) for t in tables)
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        logits_indices=torch.tensor(rows, dtype=torch.int64),
    )


class FromScratchInputs:
    """`build_step_inputs` behind an input batch's interface: each step's inputs built from nothing
    (the reference the persistent input batch is checked against)."""

    def __init__(self, blocks: BlockManager):
        self.blocks = blocks

    def build(self, chunks: list[Chunk]) -> StepInputs:
        return build_step_inputs(chunks, self.blocks)


def logit_row_offsets(chunks: list[Chunk]) -> list[int]:
    """Where each chunk's logit rows start in the step's logits, and where the last ends: chunk i's
    rows are logits[offsets[i]:offsets[i + 1]], one per position of `chunks[i].logit_positions`."""
    offsets = [0]
    for c in chunks:
        offsets.append(offsets[-1] + c.num_logits)
    return offsets


class StepBuffers:
    """Persistent metadata buffers on `device` (see module docstring); they grow, never shrink."""

    def __init__(self, device: torch.device, capacity: int = 1 << 14):
        self.device = device
        self._device_buffer = torch.zeros(0, dtype=torch.int64, device=device)
        self._host_buffer = self._device_buffer
        self._copied = None                          # event of the last host-to-device copy (GPU)
        self._ensure(capacity)

    @property
    def capacity(self) -> int:
        """int64 elements the buffer holds now."""
        return self._device_buffer.numel()

    def _ensure(self, size: int) -> None:
        if self.capacity >= size:
            return
        size = max(size, 2 * self.capacity)
        self._device_buffer = torch.zeros(size, dtype=torch.int64, device=self.device)
        if self.device.type == "cuda":
            self._host_buffer = torch.zeros(size, dtype=torch.int64, pin_memory=True)
        else:
            self._host_buffer = self._device_buffer

    @staticmethod
    def elements(host: StepInputs) -> int:
        """int64 elements `host`'s metadata takes in the buffer."""
        wide = sum(getattr(host, n).numel() for n in I64_FIELDS)
        narrow = sum(getattr(host, n).numel() for n in I32_FIELDS)
        return wide + (narrow + 1) // 2

    def load(self, host: StepInputs) -> StepInputs:
        """`host`'s metadata copied into the buffer (one copy); views of it."""
        self._ensure(self.elements(host))
        if self._copied is not None:
            self._copied.synchronize()               # the pinned buffer is free again
        wide = torch.cat([getattr(host, n).reshape(-1).to(torch.int64) for n in I64_FIELDS])
        narrow = torch.cat([getattr(host, n).reshape(-1).to(torch.int32) for n in I32_FIELDS])
        total = wide.numel() + (narrow.numel() + 1) // 2
        self._host_buffer[:wide.numel()].copy_(wide)
        self._host_buffer[wide.numel():total].view(torch.int32)[:narrow.numel()].copy_(narrow)
        if self._host_buffer is not self._device_buffer:
            self._device_buffer[:total].copy_(self._host_buffer[:total], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        return StepInputs(**self._views(host, wide.numel()))

    def _views(self, host: StepInputs, wide: int) -> dict[str, torch.Tensor]:
        views: dict[str, torch.Tensor] = {}
        offset = 0
        for name in I64_FIELDS:
            shape = getattr(host, name).shape
            views[name] = self._device_buffer[offset:offset + shape.numel()].view(shape)
            offset += shape.numel()
        narrow, offset = self._device_buffer[wide:].view(torch.int32), 0
        for name in I32_FIELDS:
            shape = getattr(host, name).shape
            views[name] = narrow[offset:offset + shape.numel()].view(shape)
            offset += shape.numel()
        return views
