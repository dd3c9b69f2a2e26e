"""A request's state as the scheduler sees it: token ids and counters, no tensors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .sampler import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0            # tokens whose K/V are in the cache
    finish_reason: str | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens

    def append(self, token_id: int, eos_ids: tuple[int, ...]) -> None:
        """Record a sampled token and finish the sequence if it stops here."""
        self.output_ids.append(token_id)
        stops = self.params.stop_token_ids + (() if self.params.ignore_eos else eos_ids)
        if token_id in stops:
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.params.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason:
            self.status = SequenceStatus.FINISHED
