"""One step's attention metadata: built on the host from the scheduled chunks, then copied into
persistent buffers on the executor's device.

The metadata is an explicit frozen value (`StepInputs`) handed to the executor, never a global:
  input_ids, positions        [T]     the tokens computed in this step, flattened
  query_start_loc             [S+1]   where each sequence's tokens start in that list
  seq_lens                    [S]     each sequence's cached length after this step
  slot_mapping                [T]     where each token's K/V go in the paged cache
  block_tables                [S, MB] each sequence's blocks, padded with 0
  logits_indices              [S]     the last token of each sequence's chunk

`StepBuffers` holds two flat device buffers (int64 and int32) that every step fills in place
with one copy each, and hands out contiguous views of their prefixes: the addresses never
change, which is what a captured CUDA graph needs, and nothing is allocated per step.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

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
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"kv_cache": kv_cache}


def build_step_inputs(chunks: list[Chunk], blocks: BlockManager) -> StepInputs:
    """Host-side metadata for computing tokens [start, end) of each chunk's sequence in one step."""
    ids, positions, slots, starts, lens = [], [], [], [0], []
    for c in chunks:
        ids += c.seq.all_ids[c.start:c.end]
        positions += range(c.start, c.end)
        slots += [blocks.slot(c.seq.seq_id, p) for p in range(c.start, c.end)]
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
        logits_indices=torch.tensor(starts[1:], dtype=torch.int64) - 1,
    )


class StepBuffers:
    """Persistent metadata buffers on `device` (see module docstring); they grow, never shrink."""

    def __init__(self, device: torch.device, capacity: int = 1 << 14):
        self.device = device
        self._buffers = {dtype: torch.zeros(capacity, dtype=dtype, device=device)
                         for dtype in (torch.int64, torch.int32)}

    def _ensure(self, dtype: torch.dtype, size: int) -> torch.Tensor:
        if self._buffers[dtype].numel() < size:
            self._buffers[dtype] = torch.zeros(max(size, 2 * self._buffers[dtype].numel()), dtype=dtype,
                                               device=self.device)
        return self._buffers[dtype]

    def load(self, host: StepInputs) -> StepInputs:
        """`host`'s metadata copied into the buffers (one copy per dtype); views of them."""
        views: dict[str, torch.Tensor] = {}
        for dtype, names in ((torch.int64, I64_FIELDS), (torch.int32, I32_FIELDS)):
            parts = [getattr(host, n) for n in names]
            packed = torch.cat([p.reshape(-1).to(dtype) for p in parts])
            buffer = self._ensure(dtype, packed.numel())
            buffer[:packed.numel()].copy_(packed, non_blocking=True)
            offset = 0
            for name, part in zip(names, parts):
                views[name] = buffer[offset:offset + part.numel()].view(part.shape)
                offset += part.numel()
        return StepInputs(**views)
