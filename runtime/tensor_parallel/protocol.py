"""What rank 0 tells the other ranks, through torch.distributed broadcasts on the step channel
(world.py: a gloo group of its own, so a worker may wait for the next step as long as the server idles).

Messages, each a fixed header of int64 (its kind and sizes) broadcast from rank 0, then its payload:
  startup  once, before the first step: a JSON object (the artifact's content hash, the backend,
           its device and options, the KV cache's blocks); every rank then answers with a status
           (`gather_status`: 0 ready, else why not) so rank 0 knows all are ready or which is not
  step     an entry graph's name (its index in the artifact's entries) and the StepInputs tensors
           in one int64 payload: input_ids, positions, slot_mapping, logits_indices, then
           query_start_loc, seq_lens, block_tables (the int32 fields widened)
  copy     copy-on-write block copies (src, dst) the step after it reads
  stop     the run ends: a worker leaves its loop and exits 0
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from ..step_inputs import StepInputs

STARTUP, STEP, COPY, STOP = 1, 2, 3, 4
HEADER = 8                       # int64: kind, entry, T, S, MB, R, payload elements, unused
WIDE = ("input_ids", "positions", "slot_mapping", "logits_indices")
NARROW = ("query_start_loc", "seq_lens", "block_tables")
READY, MISMATCH, FAILED = 0, 1, 2      # a rank's startup status


@dataclass(frozen=True)
class Message:
    kind: int
    entry: str = ""
    step: StepInputs | None = None
    copies: tuple[torch.Tensor, torch.Tensor] | None = None
    startup: dict | None = None


class StepChannel:
    """Rank 0's side sends, the others' receive; `entries` are the artifact's entry graphs, in one order."""

    def __init__(self, group: object, entries: list[str]):
        self.group = group
        self.entries = sorted(entries)

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.broadcast(t, src=0, group=self.group)
        return t

    def _header(self, *values: int) -> torch.Tensor:
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[:len(values)] = torch.tensor(values, dtype=torch.int64)
        return self._broadcast(header)

    # -- rank 0 ------------------------------------------------------------------------------

    def send_startup(self, facts: dict) -> None:
        data = torch.frombuffer(bytearray(json.dumps(facts).encode()), dtype=torch.uint8)
        self._header(STARTUP, 0, 0, 0, 0, 0, data.numel())
        self._broadcast(data)

    def send_step(self, entry: str, step: StepInputs) -> None:
        seqs, width = step.block_tables.shape
        payload = torch.cat([getattr(step, name).reshape(-1).to(torch.int64) for name in (*WIDE, *NARROW)])
        self._header(STEP, self.entries.index(entry), step.input_ids.numel(), seqs, width,
                     step.logits_indices.numel(), payload.numel())
        self._broadcast(payload)

    def send_copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        payload = torch.cat([src.reshape(-1), dst.reshape(-1)]).to(torch.int64).cpu()
        self._header(COPY, 0, 0, 0, 0, 0, payload.numel())
        self._broadcast(payload)

    def send_stop(self) -> None:
        self._header(STOP)

    # -- the other ranks ---------------------------------------------------------------------

    def receive(self) -> Message:
        kind, entry, tokens, seqs, width, rows, elements, _ = self._header().tolist()
        if kind == STOP:
            return Message(STOP)
        payload = self._broadcast(torch.empty(elements, dtype=torch.uint8 if kind == STARTUP else torch.int64))
        if kind == STARTUP:
            return Message(STARTUP, startup=json.loads(payload.numpy().tobytes().decode()))
        if kind == COPY:
            src, dst = payload.view(2, -1)
            return Message(COPY, copies=(src, dst))
        sizes = [tokens, tokens, tokens, rows, seqs + 1, seqs, seqs * width]
        parts = dict(zip((*WIDE, *NARROW), payload.split(sizes)))
        fields = {name: parts[name].clone() for name in WIDE}
        fields |= {name: parts[name].to(torch.int32) for name in NARROW}
        fields["block_tables"] = fields["block_tables"].view(seqs, width)
        return Message(STEP, self.entries[entry], step=StepInputs(**fields))

    # -- every rank --------------------------------------------------------------------------

    def gather_status(self, status: int) -> list[int]:
        """Every rank's startup status, in rank order."""
        import torch.distributed as dist

        mine = torch.tensor([status], dtype=torch.int64)
        every = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine, group=self.group)
        return [int(t) for t in every]
