"""Speculative decoding in the engine's step: propose, schedule, verify, keep what was accepted.

One step of an engine that speculates (`Engine.step` calls these in order):
  plan(running)     K for this step from the adaptive policy (batch size, measured acceptance and
                    step cost; 0 when speculating would cost more than it gives), then per decoding
                    sequence up to K drafts (n-gram: proposed now; a model drafter: room for K, the
                    tokens come after scheduling) in `Sequence.draft_ids`
  (schedule)        the scheduler verifies a sequence's drafts in its decode chunk, K+1 logit rows
  draft(chunks)     a model drafter fills the drafts (its KV writes are overwritten by the verify pass)
  (forward)         the target scores every chunk; a verify chunk gives K+1 rows
  verify(rows, ...) the tokens the sequence keeps: accepted drafts + the target's own next token
  commit(...)       the sequence's length moves back past what was rejected (blocks trimmed), its
                    full blocks are registered only with accepted tokens, and the policy learns
Who speculates: every decoding sequence. A grammar-constrained one has each verify row masked by
its grammar's state after the drafts before the row (a draft the grammar refuses is rejected
there), and its grammar advances through the kept tokens only: nothing to roll back.

Drafts are greedy (n-gram lookup, and the draft model's argmax), so q is one-hot and verification is
`verify_sampled(..., draft_logits=None)`: each row is sampled with the request's own generator exactly
as the sampler samples, and drafts are kept while they equal the samples. The output is then the
target's distribution, and a seeded request gives token for token what it gives without speculation,
whatever K the policy picks under whatever load (a draft's q would spend the stream differently).
Penalties, top-k / top-p / min-p, logprobs and stop strings apply per row as without speculation:
row i is processed with the drafts before it as the output so far. The engine samples all verify
rows of a step with its other rows in one batched pass where the logits are (step_sampling.py);
`verify_rows` here is the per-sequence reference it is tested against.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from ..sampler import SampleResult, apply_penalties, filter_logits, needs_row_sampling, token_logprobs
from ..sampling_params import RequestError, SamplingParams
from ..scheduler import Chunk
from ..sequence import Sequence
from .adaptive import AdaptiveK, StepCostModel
from .verify import Verdict, verify_greedy, verify_sampled

SOURCES = ("ngram", "self", "draft:ARTIFACT")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`source`: "ngram" (prompt lookup), "self" (the artifact's own draft graph, `llmc compile
    --draft-skip N`) or "draft:PATH" (another artifact with the same vocabulary); K: the most
    tokens drafted per sequence and step (adaptive K chooses 0..K; with adaptive off, always K)."""

    source: str
    num_draft_tokens: int = 4
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.source not in ("ngram", "self") and not (self.source.startswith("draft:") and self.source[6:]):
            raise RequestError(f"speculative source {self.source!r} is unknown; use ngram, self or draft:ARTIFACT")
        if not 1 <= self.num_draft_tokens <= 16:
            raise RequestError(f"num_draft_tokens={self.num_draft_tokens} must be in 1..16 (the most tokens "
                               "drafted per step)")


@dataclass
class SpeculationStats:
    """Counters since the engine started (per request: Sequence.num_drafted / num_accepted)."""

    max_k: int
    drafted: int = 0
    accepted: int = 0
    verified_seqs: int = 0            # sequence-steps that verified at least one draft
    emitted: int = 0                  # tokens those steps gave (accepted + one each)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0       # target steps that verified drafts
    accepted_at: list[int] = field(default_factory=list)     # [i]: draft i accepted (i from 0)
    drafted_at: list[int] = field(default_factory=list)      # [i]: draft i proposed

    def __post_init__(self) -> None:
        self.accepted_at = self.accepted_at or [0] * self.max_k
        self.drafted_at = self.drafted_at or [0] * self.max_k

    def snapshot(self) -> "SpeculationStats":
        """A copy another thread may read while the engine goes on counting."""
        return replace(self, accepted_at=list(self.accepted_at), drafted_at=list(self.drafted_at))

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying sequence gained per step (accepted drafts + the target's own)."""
        return self.emitted / self.verified_seqs if self.verified_seqs else 0.0

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.verified_seqs += 1
        self.emitted += num_accepted + 1
        for i in range(num_drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < num_accepted


def speculates(seq: Sequence) -> bool:
    """Whether a running sequence drafts this step: it is decoding (one new token plus drafts)."""
    return seq.is_decoding


def room_for_drafts(seq: Sequence, k: int, max_len: int) -> int:
    """At most k drafts, leaving the step's tokens within max_tokens and the context."""
    left = seq.params.max_tokens - len(seq.output_ids) - 1
    return max(0, min(k, left, max_len - seq.num_tokens - 1))


class Speculator:
    """One engine's speculation: a drafter, the adaptive-K policy and the counters."""

    def __init__(self, config: SpeculativeConfig, drafter, max_len: int):
        self.config = config
        self.drafter = drafter
        self.max_len = max_len
        # a model drafter's cost is unknown until measured: nearly free at first, so the first steps
        # draft and measure it (then the policy weighs what it measured)
        cost = StepCostModel(fixed_s=1e-6, per_token_s=0.0) if drafter.costs_a_step else None
        self.policy = AdaptiveK(config.num_draft_tokens, draft_cost=cost)
        self.stats = SpeculationStats(config.num_draft_tokens)

    def plan(self, candidates: list[Sequence]) -> None:
        """Drafts (or room for them) in each candidate's `draft_ids`, K chosen for this batch."""
        if not candidates:
            return
        k = self.policy.choose(len(candidates)) if self.config.adaptive else self.config.num_draft_tokens
        for seq in candidates:
            seq.draft_ids = self.drafter.propose(seq, room_for_drafts(seq, k, self.max_len))

    def draft(self, chunks: list[Chunk]) -> None:
        """Let a model drafter fill the scheduled drafts; its time counts as draft time."""
        verifying = [c for c in chunks if c.num_drafts]
        if not verifying:
            return
        start = time.perf_counter()
        self.drafter.fill(verifying)
        seconds = time.perf_counter() - start
        self.stats.draft_seconds += seconds
        if self.policy.draft_cost is not None:
            self.policy.draft_cost.record(len(verifying), seconds / max(c.num_drafts for c in verifying))

    def record_step(self, chunks: list[Chunk], seconds: float) -> None:
        """A target step's time, for the cost model (and the verify time when it verified drafts)."""
        self.policy.record_step(sum(c.end - c.start for c in chunks), seconds)
        if any(c.num_drafts for c in chunks):
            self.stats.verify_seconds += seconds

    def commit(self, seq: Sequence, verdict: Verdict, num_drafted: int, finished: bool) -> None:
        """Count a verified sequence (after its kept tokens joined it) and let the drafter trim."""
        if not finished:
            self.drafter.after_verify(seq, verdict.num_accepted, num_drafted)
        seq.num_drafted += num_drafted
        seq.num_accepted += verdict.num_accepted
        self.policy.observe(num_drafted, verdict.num_accepted)
        self.stats.observe(num_drafted, verdict.num_accepted)


def verify_rows(rows: torch.Tensor, seq: Sequence,
                generator: torch.Generator | None) -> tuple[Verdict, list[SampleResult]]:
    """What a sequence keeps from its verify rows [K+1, vocab] (fp32) and drafts: the verdict and
    its tokens as the sampler reports them (with logprobs where asked). The per-sequence reference:
    the engine verifies every sequence's rows in the step's one batched pass (StepSampler.sample),
    and tests hold that to this."""
    params, drafts = seq.params, seq.draft_ids
    plain = not needs_row_sampling(params)
    processed = rows if plain else torch.stack([
        apply_penalties(rows[i].clone(), params, seq.prompt_ids, seq.output_ids + drafts[:i])
        for i in range(len(drafts) + 1)])
    if params.greedy:
        verdict = verify_greedy(processed, drafts)
    else:
        verdict = verify_sampled(torch.stack([filter_logits(r, params) for r in processed]), drafts, generator)
    return verdict, [_result(processed[i], token, params) for i, token in enumerate(verdict.tokens)]


def _result(row: torch.Tensor, token: int, params: SamplingParams) -> SampleResult:
    if params.logprobs is None:
        return SampleResult(token)
    chosen, top = token_logprobs(torch.log_softmax(row, dim=-1), token, params.logprobs)
    return SampleResult(token, chosen, top)
