"""A first scheduler: prefill waiting prompts when their blocks fit, else decode everyone.

Pure Python. A request is admitted only when the free blocks cover its prompt plus its
max_tokens, so a running sequence never runs out of cache (no preemption needed). A step is
either a prefill of newly admitted prompts (up to `max_batched_tokens`) or one decode token
for every running sequence.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledStep:
    kind: str                        # "prefill" or "decode"
    seqs: list[Sequence]


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> list[Sequence]:
        admitted, tokens = [], 0
        while self.waiting and len(self.running) + len(admitted) < self.max_num_seqs:
            seq = self.waiting[0]
            fits_budget = not admitted or tokens + len(seq.prompt_ids) <= self.max_batched_tokens
            if not fits_budget or not self.blocks.can_allocate(seq.seq_id, seq.max_total_tokens):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq.seq_id, seq.max_total_tokens)
            seq.status = SequenceStatus.RUNNING
            admitted.append(seq)
            tokens += len(seq.prompt_ids)
        return admitted

    def schedule(self) -> ScheduledStep | None:
        admitted = self._admit()
        if admitted:
            self.running.extend(admitted)
            return ScheduledStep("prefill", admitted)
        if self.running:
            return ScheduledStep("decode", list(self.running))
        return None

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.seq_id)
