"""A request's state as the scheduler sees it: token ids, counters and timestamps; no tensors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0                # lower runs first; FCFS within a priority
    arrival_time: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0            # leading tokens whose K/V are in the cache
    num_cached_prompt: int = 0       # prompt tokens served by the prefix cache at admission
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    finish_reason: str | None = None
    draft_ids: list[int] = field(default_factory=list)   # tokens proposed for this step's verification
    num_drafted: int = 0             # speculative tokens proposed for it, since it started
    num_accepted: int = 0            # ... and accepted

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def step_ids(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output + the drafts being verified this step."""
        ids = self.all_ids + self.draft_ids
        return ids[start:end]

    @property
    def is_decoding(self) -> bool:
        """Every token but the newest is in the cache: the next step computes one token (plus drafts)."""
        return self.num_computed == self.num_tokens - 1

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self) -> tuple[int, float, int]:
        return (self.priority, self.arrival_time, self.seq_id)

    def finish(self, reason: str, now: float) -> None:
        self.status, self.finish_reason, self.finished_time = SequenceStatus.FINISHED, reason, now
