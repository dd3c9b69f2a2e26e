"""Iteration-level (continuous) batching with chunked prefill and preemption. Pure Python.

Every step gets a token budget (`max_batched_tokens`) and a seat limit (`max_num_seqs`):
  1. Running sequences first, in priority order: each gets its next token (a decode, with the
     tokens drafted for it when it speculates: `Sequence.draft_ids`, cut to fit the budget, with
     logits at each of them) or the next chunk of an unfinished prompt. So decodes keep flowing
     while a long prompt is fed in chunks (Sarathi-style), and the step mixes prompt chunks with
     decode tokens.
  2. Waiting sequences fill what budget and seats are left, in (priority, arrival) order; a
     prompt larger than the budget is admitted with its first chunk (with `chunked_prefill` off,
     it waits for a step where nothing else runs and is computed whole). Admission allocates blocks
     for all known tokens, reusing prefix-cached blocks (those tokens are not recomputed).
When a running sequence needs a block and none is free, the lowest-priority running sequence
is preempted by recompute: its blocks are freed and it goes back to the waiting queue with all
its tokens (prompt + generated so far) to be prefilled again. No request is lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_batched_tokens: int = 2048
    chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_batched_tokens < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} and max_batched_tokens="
                             f"{self.max_batched_tokens} must be at least 1")


@dataclass(frozen=True)
class Chunk:
    """Compute tokens [start, end) of `seq` in this step, with logits at its last `num_logits`
    positions (1, the default: its last token; K+1 to verify K drafted tokens; 0: none).

    `samples` (the chunk reaches the sequence's last token, so a new token is sampled) and
    `num_drafts` (drafted tokens it verifies: its positions past the last token) are read from the
    sequence when the chunk is made: the sequence moves on (tokens appended, more scheduled) while
    the step computes."""

    seq: Sequence
    start: int
    end: int
    num_logits: int = 1
    samples: bool = field(init=False)
    num_drafts: int = field(init=False)

    def __post_init__(self) -> None:
        if not 0 <= self.num_logits <= self.end - self.start:
            raise ValueError(f"a chunk of {self.end - self.start} tokens cannot ask for logits at "
                             f"{self.num_logits} positions")
        object.__setattr__(self, "samples", self.end >= self.seq.num_tokens)
        object.__setattr__(self, "num_drafts", max(0, self.end - self.seq.num_tokens))

    @property
    def logit_positions(self) -> range:
        """The positions whose logits the step returns for this chunk, in order."""
        return range(self.end - self.num_logits, self.end)


@dataclass(frozen=True)
class ScheduledStep:
    chunks: list[Chunk]
    copies: list[tuple[int, int]]        # KV block copies to apply first (copy-on-write)
    preempted: list[Sequence]

    @property
    def is_pure_decode(self) -> bool:
        """One token and one logit row per sequence: what the decode graph (and its CUDA graphs) take."""
        return all(c.end - c.start == 1 and c.num_logits == 1 and c.samples for c in self.chunks)


class Scheduler:
    def __init__(self, blocks: BlockManager, config: SchedulerConfig):
        self.blocks = blocks
        self.config = config
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._watermark = max(1, blocks.num_blocks // 100)   # blocks kept for running decodes

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.waiting.sort(key=Sequence.sort_key)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.draft_ids.clear()
        self.blocks.free(seq.seq_id)
        seq.status, seq.num_computed = SequenceStatus.WAITING, 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def _grow(self, seq: Sequence, end: int, preempted: list[Sequence]) -> bool:
        """Find blocks for `seq` up to `end` tokens, preempting from the back; False if `seq` went."""
        while not self.blocks.can_append(seq.seq_id, end):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        self.blocks.append(seq.seq_id, end)
        return True

    def _schedule_running(self, budget: int, preempted: list[Sequence]) -> list[Chunk]:
        chunks = []
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or budget == 0 or seq.awaits_last_token:   # preempted above
                continue
            end = min(seq.num_tokens, seq.num_computed + budget)
            if seq.draft_ids and end == seq.num_tokens:     # drafts to verify: as many as budget allows
                del seq.draft_ids[seq.num_computed + budget - end:]
                end += len(seq.draft_ids)
            else:
                seq.draft_ids.clear()
            if end == seq.num_computed or not self._grow(seq, end, preempted):
                continue
            self.blocks.prepare_write(seq.seq_id, seq.num_computed, end)
            rows = 1 + len(seq.draft_ids) if seq.draft_ids else seq.logit_rows(seq.num_computed, end)
            chunks.append(Chunk(seq, seq.num_computed, end, num_logits=rows))
            budget -= end - seq.num_computed
        return chunks

    def _admit(self, budget: int, seats: int) -> list[Chunk]:
        chunks = []
        while self.waiting and budget > 0 and seats > 0:
            seq = self.waiting[0]
            ids = seq.tokens                                  # prompt + output, sliced as read
            reuse = not seq.wants_prompt_logprobs     # cached tokens have no logits: compute them all (as vLLM)
            if not self.blocks.can_allocate(ids, self._watermark if self.running else 0, seq.cache_salt, reuse):
                break
            whole = not self.config.chunked_prefill
            if whole and len(ids) > budget and (chunks or self.running):
                break      # without chunking, an oversized prompt waits for a step of its own
            self.waiting.pop(0)
            cached = self.blocks.allocate(seq.seq_id, ids, seq.cache_salt, reuse)
            seq.num_computed = min(cached, len(ids) - 1)    # always compute the last token
            if seq.num_preemptions == 0:
                seq.num_cached_prompt = seq.num_computed
            end = len(ids) if whole else min(len(ids), seq.num_computed + budget)
            self.blocks.prepare_write(seq.seq_id, seq.num_computed, end)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(Chunk(seq, seq.num_computed, end, num_logits=seq.logit_rows(seq.num_computed, end)))
            budget, seats = budget - (end - seq.num_computed), seats - 1
        return chunks

    def schedule(self) -> ScheduledStep | None:
        """Choose this step's chunks; None when there is nothing to run."""
        preempted: list[Sequence] = []
        self.running.sort(key=Sequence.sort_key)
        chunks = self._schedule_running(self.config.max_batched_tokens, preempted)
        used = sum(c.end - c.start for c in chunks)
        if not preempted:
            seats = self.config.max_num_seqs - len(self.running)
            chunks += self._admit(self.config.max_batched_tokens - used, seats)
        if not chunks:
            return None
        return ScheduledStep(chunks, self.blocks.take_copies(), preempted)
