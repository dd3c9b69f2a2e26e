"""A request's state as the scheduler sees it: token ids, counters and timestamps; no tensors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .sampling_params import SamplingParams


PENDING_TOKEN = 0        # input id of a token a step in flight has not sampled yet (patched before launch)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)       # a sequence is itself: compared by identity (the scheduler's lists)
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
    num_pending: int = 0             # tokens scheduled steps will sample but have not yet (async scheduling)

    @property
    def all_ids(self) -> list[int]:
        """The known tokens, prompt + output, as a new list (O(context): `tokens` reads without copying)."""
        return self.prompt_ids + self.output_ids

    @property
    def tokens(self) -> "TokenView":
        """The known tokens as a view with len() and slices, each slice copying only what it reads."""
        return TokenView(self)

    def step_ids(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output + pending + the drafts being verified this step,
        sliced from each part (a step reads only its own tokens: no copy of the whole context). A
        token still pending (sampled by a step in flight) reads as PENDING_TOKEN until it is known."""
        ids: list[int] = []
        for part in (self.prompt_ids, self.output_ids, [PENDING_TOKEN] * self.num_pending, self.draft_ids):
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
        """Tokens it holds: prompt, output and those pending (sampled by a step in flight)."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def awaits_last_token(self) -> bool:
        """A step in flight samples its last token (max_tokens): nothing more to schedule for it."""
        return self.num_pending > 0 and len(self.output_ids) + self.num_pending >= self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self) -> tuple[int, float, int]:
        return (self.priority, self.arrival_time, self.seq_id)

    def finish(self, reason: str, now: float) -> None:
        self.status, self.finish_reason, self.finished_time = SequenceStatus.FINISHED, reason, now


class TokenView:
    """A sequence's known tokens (prompt + output) without concatenating them: len() and slices."""

    def __init__(self, seq: Sequence):
        self._seq = seq

    def __len__(self) -> int:
        return len(self._seq.prompt_ids) + len(self._seq.output_ids)

    def __getitem__(self, index: slice) -> list[int]:
        start, stop, step = index.indices(len(self))
        assert step == 1, "a token view slices contiguously"
        return self._seq.step_ids(start, stop)
