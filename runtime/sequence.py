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
    prompt_scored: int = 0           # prompt positions whose next token's logprob is computed (prompt_logprobs)
    cache_salt: str | None = None    # prefix-cache keys start from it: only the same salt shares cached blocks

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def step_ids(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output + the drafts being verified this step, sliced
        from each part (a step reads only its own tokens: no copy of the whole context)."""
        ids: list[int] = []
        for part in (self.prompt_ids, self.output_ids, self.draft_ids):
            ids += part[max(start, 0):max(end, 0)]
            start, end = start - len(part), end - len(part)
        return ids

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some prompt positions are not scored yet."""
        return self.params.prompt_logprobs is not None and self.prompt_scored < len(self.prompt_ids) - 1

    def logit_rows(self, start: int, end: int) -> int:
        """Logit rows a chunk [start, end) asks for: its last position (the one that samples, when it
        reaches the end), or, while prompt logprobs are wanted, every position from the first
        unscored one on (row p scores prompt token p + 1)."""
        if self.wants_prompt_logprobs:
            first = max(start, self.prompt_scored)
            if first < min(end, len(self.prompt_ids) - 1):
                return end - first
        return 1

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
