"""Where drafted tokens come from: n-gram lookup, the artifact's own draft graph, or a draft model.

A drafter has two calls (runtime/speculative/speculator.py drives them):
  propose(seq, k) -> list   before scheduling: the drafts (n-gram), or k placeholders that reserve
                            the drafts' places in the verify chunk (model drafters)
  fill(chunks)              after scheduling (blocks for every drafted position exist): a model
                            drafter runs its graph k times over the batch and writes its argmax
                            into each chunk's `seq.draft_ids`
and `forget(seq_id)` when a sequence ends. `costs_a_step` says whether drafting takes model time
(the adaptive policy then weighs it).

SelfDrafter runs the target artifact's `draft` entry (its layers minus the skipped ones, sharing
weights and the paged KV cache): positions before the newest token already hold the target's K/V;
the draft writes its kept layers' K/V at the drafted positions, which the verify pass overwrites.
DraftModelDrafter runs another artifact on its own paged cache: per sequence it catches up on the
tokens it has not seen (the prompt, at first; then what was accepted) and keeps only K/V whose
input tokens were accepted (`after_verify` trims the rest).
"""

from __future__ import annotations

from typing import Mapping

from tokenizers import Tokenizer as HFTokenizer

from ..artifact import Artifact, load_artifact
from ..block_manager import BlockManager
from ..executor import StepOutput
from ..model_runner import ModelRunner
from ..sampling_params import RequestError
from ..scheduler import Chunk
from ..sequence import Sequence
from ..step_inputs import build_step_inputs
from .ngram import NgramProposer


class NgramDrafter:
    """Prompt lookup over the prompt and the output so far (free: no model runs)."""

    costs_a_step = False

    def __init__(self, proposer: NgramProposer = NgramProposer(max_n=4, min_n=2)):
        self.proposer = proposer

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return self.proposer.propose(seq.all_ids, k) if k else []

    def fill(self, chunks: list[Chunk]) -> None:
        pass

    def after_verify(self, seq: Sequence, num_accepted: int, num_drafted: int) -> None:
        pass

    def forget(self, seq_id: int) -> None:
        pass


def _argmax_into(out: StepOutput, seqs: list[Sequence], index: int) -> None:
    """Draft `index` of each sequence: its logit row's greedy pick (the step's own where it made them)."""
    for row, seq in zip(out.greedy_tokens().tolist(), seqs):
        seq.draft_ids[index] = row


def _draft_token_by_token(runner: ModelRunner, entry: str, blocks: BlockManager, chunks: list[Chunk],
                          first: int) -> None:
    """Drafts first.. of each chunk, one step each: draft j from one token at position newest + j
    (the newest when j is 0, else draft j - 1), run through `entry` on `blocks`' slots."""
    for j in range(first, max(c.num_drafts for c in chunks)):
        seqs = [c.seq for c in chunks if c.num_drafts > j]
        at = [Chunk(s, s.num_tokens - 1 + j, s.num_tokens + j) for s in seqs]
        _argmax_into(runner.run_step(entry, build_step_inputs(at, blocks)), seqs, j)


class SelfDrafter:
    """The target's own `draft` entry graph on the target's cache and blocks."""

    costs_a_step = True

    def __init__(self, runner: ModelRunner, blocks: BlockManager):
        self.runner, self.blocks = runner, blocks

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return [0] * k

    def fill(self, chunks: list[Chunk]) -> None:
        """Draft j of each chunk from one token at position newest + j (the newest, then draft j-1)."""
        _draft_token_by_token(self.runner, "draft", self.blocks, chunks, first=0)

    def after_verify(self, seq: Sequence, num_accepted: int, num_drafted: int) -> None:
        pass

    def forget(self, seq_id: int) -> None:
        pass


class DraftModelDrafter:
    """Another artifact (same vocabulary) on its own runner, paged cache and block manager."""

    costs_a_step = True

    def __init__(self, runner: ModelRunner, blocks: BlockManager):
        self.runner, self.blocks = runner, blocks
        self.computed: dict[int, int] = {}       # seq id -> tokens whose K/V the draft cache holds

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Room for k drafts if the draft cache can hold the sequence's tokens and them, else none."""
        if k == 0 or not self._reserve(seq, seq.num_tokens + k - 1):
            return []
        return [0] * k

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        if seq.seq_id not in self.computed:
            if not self.blocks.can_allocate(seq.all_ids, salt=seq.cache_salt):
                return False
            cached = self.blocks.allocate(seq.seq_id, seq.all_ids, seq.cache_salt)
            self.computed[seq.seq_id] = min(cached, seq.num_tokens - 1)
        if not self.blocks.can_append(seq.seq_id, num_tokens):
            return False
        self.blocks.append(seq.seq_id, num_tokens)
        return True

    def fill(self, chunks: list[Chunk]) -> None:
        """One catch-up chunk per sequence ending at its newest token (draft 0), then one token a step."""
        seqs = [c.seq for c in chunks]
        catch_up = [Chunk(s, self.computed[s.seq_id], s.num_tokens) for s in seqs]
        for c, up in zip(chunks, catch_up):       # the draft writes [caught up, newest + K - 1)
            self.blocks.prepare_write(c.seq.seq_id, up.start, c.seq.num_tokens + c.num_drafts - 1)
        self.runner.copy_blocks(self.blocks.take_copies())
        _argmax_into(self.runner.run_step("prefill", build_step_inputs(catch_up, self.blocks)), seqs, 0)
        _draft_token_by_token(self.runner, "decode", self.blocks, chunks, first=1)

    def after_verify(self, seq: Sequence, num_accepted: int, num_drafted: int) -> None:
        """Keep the K/V of positions whose input tokens were accepted; register their full blocks.
        Called after the accepted tokens joined the sequence (num_tokens grew by num_accepted + 1)."""
        if seq.seq_id not in self.computed:
            return
        newest_before = seq.num_tokens - num_accepted - 2          # position of the token drafting began at
        kept = newest_before + 1 + min(num_accepted, max(num_drafted - 1, 0))
        self.computed[seq.seq_id] = kept
        self.blocks.trim(seq.seq_id, kept)
        self.blocks.register_full_blocks(seq.seq_id, seq.all_ids, kept)

    def forget(self, seq_id: int) -> None:
        self.computed.pop(seq_id, None)
        self.blocks.free(seq_id)


def same_vocabulary(target: Artifact, draft: Artifact) -> str | None:
    """Why a draft artifact cannot draft for the target (another vocabulary), or None."""
    if draft.config.vocab_size != target.config.vocab_size:
        return f"its vocabulary has {draft.config.vocab_size} tokens, the target's {target.config.vocab_size}"
    ours, theirs = (HFTokenizer.from_str(a.tokenizer.tokenizer_json).get_vocab(with_added_tokens=True)
                    for a in (target, draft))
    return None if ours == theirs else "its tokenizer maps tokens to other ids than the target's"


def build_drafter(source: str, target: Artifact, runner: ModelRunner, blocks: BlockManager, backend: str,
                  device: str, options: Mapping[str, object], max_num_seqs: int):
    """The drafter `source` names ("ngram", "self", "draft:PATH"); RequestError in one sentence when
    the target has no draft graph or the draft artifact cannot draft for it."""
    if source == "ngram":
        return NgramDrafter()
    if source == "self":
        if "draft" not in target.graphs:
            raise RequestError(f"the artifact {target.path} has no draft graph; compile it with --draft-skip N "
                               "for self-speculative decoding")
        return SelfDrafter(runner, blocks)
    draft = load_artifact(source[len("draft:"):])
    if reason := same_vocabulary(target, draft):
        raise RequestError(f"the draft artifact {draft.path} cannot draft for {target.path}: {reason}; "
                           "use a draft model of the same tokenizer")
    draft_runner = ModelRunner.for_backend(draft, blocks.num_blocks, blocks.block_size, backend, options, device,
                                           max_num_seqs)
    return DraftModelDrafter(draft_runner, BlockManager(blocks.num_blocks, blocks.block_size))
