"""Verification: which of K drafted tokens a sequence keeps, and the target's own next token.

A verify step scores a sequence's newest token (sampled last step) and its K drafts in one pass of
the target and returns K+1 logit rows for it: row i is the target's distribution for the token that
follows draft i-1 (row 0: the token after the sequence's last token). The caller processes each
row exactly as the sampler would for that position *assuming the drafts before it were accepted*
(penalties over prompt + output + `draft_ids[:i]`, then temperature / top-k / top-p / min-p via
`sampler.filter_logits`); a row is only used when those drafts were accepted, so that assumption
is exact. Logprobs of the emitted tokens come from the same rows, as in `sampler.sample_row`.

The result is a `Verdict`: the accepted drafts, then one token from the target (the correction at
the first rejected draft, or the bonus token from row K when every draft is accepted), so a step
always emits between 1 and K+1 tokens.

Every draw comes from the request's own `torch.Generator`, one float64 uniform per draw, as in
`sampler.draw_token`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..sampler import draw_token


@dataclass(frozen=True)
class Verdict:
    """What one sequence keeps from a verify step: accepted drafts, then the target's token."""

    tokens: tuple[int, ...]

    @property
    def num_accepted(self) -> int:
        """How many drafts were accepted (0..K); `tokens` has one more."""
        return len(self.tokens) - 1


def _check_rows(target_logits: torch.Tensor, draft_ids: Sequence[int],
                draft_logits: torch.Tensor | None = None) -> None:
    """ValueError naming the bad shape or id unless rows are [K+1, V] (and drafts' [K, V])."""
    k = len(draft_ids)
    if target_logits.dim() != 2 or target_logits.shape[0] != k + 1:
        raise ValueError(f"target logits of shape {tuple(target_logits.shape)} do not give K+1 = {k + 1} "
                         "rows for K drafted tokens")
    vocab = target_logits.shape[1]
    if any(not 0 <= t < vocab for t in draft_ids):
        raise ValueError(f"drafted tokens {list(draft_ids)} are not all in the vocabulary of {vocab}")
    if draft_logits is not None and tuple(draft_logits.shape) != (k, vocab):
        raise ValueError(f"draft logits of shape {tuple(draft_logits.shape)} are not [K, V] = [{k}, {vocab}]")


def verify_greedy(target_logits: torch.Tensor, draft_ids: Sequence[int]) -> Verdict:
    """Greedy verification (temperature 0).

    Takes: `target_logits` [K+1, V], each row after penalties (what `sample_row` takes the argmax
    of), and the K drafted ids. Gives: the longest prefix of drafts equal to the rows' argmax, then
    the argmax of the next row (the correction, or the bonus from row K). The tokens are exactly
    those greedy decoding without speculation gives, provided the rows equal its logits.
    """
    _check_rows(target_logits, draft_ids)
    return Verdict(accepted_prefix(draft_ids, target_logits.argmax(dim=-1).tolist()))


def accepted_prefix(draft_ids: Sequence[int], picked: Sequence[int]) -> tuple[int, ...]:
    """The tokens kept when row i's own pick is `picked[i]` (K+1 picks for K drafts): the drafts while
    they equal the picks, then the pick at the first that differs (or the bonus pick of row K). This
    is one-hot verification when the picks are the rows' samples (or argmaxes)."""
    if len(picked) != len(draft_ids) + 1:
        raise ValueError(f"{len(picked)} picked tokens do not give K+1 = {len(draft_ids) + 1} for K drafts")
    tokens = []
    for draft, target in zip(draft_ids, picked):
        if draft != target:
            break
        tokens.append(draft)
    tokens.append(picked[len(tokens)])
    return tuple(tokens)


def verify_sampled(target_logits: torch.Tensor, draft_ids: Sequence[int], generator: torch.Generator,
                   draft_logits: torch.Tensor | None = None) -> Verdict:
    """Sampled verification (temperature > 0): emitted tokens follow the target's distribution.

    Takes: `target_logits` [K+1, V], each row after penalties and `sampler.filter_logits`
    (temperature, top-k, top-p, min-p; masked tokens are -inf), so p_i = softmax(row i); the K
    drafted ids; the request's generator; and `draft_logits` [K, V], the draft's own processed
    logits that the drafts were sampled from (q_i = softmax), or None for deterministic drafts
    (n-gram lookup, greedy draft models: q is one-hot on the draft). Requires: each draft x_i was
    drawn from q_i (so q_i(x_i) > 0); otherwise the output is not distributed as the target.

    With q (rejection sampling, Leviathan et al. 2023 / Chen et al. 2023): draft x_i is accepted
    when u < p_i(x_i) / q_i(x_i) (one uniform u); at the first rejection the token is drawn from
    normalised max(0, p_i - q_i) (one more uniform); when all K are accepted a bonus token is drawn
    from p_K. Every emitted token is distributed as the target alone would give it.

    With q = None: row i is sampled exactly as `sampler.sample_row` samples (the same inverse-CDF
    draw, one uniform per row) and drafts are accepted while the sample equals them; the sample at
    the first mismatch is the correction. This is rejection sampling with one-hot q (accept with
    probability p(x); on rejection sample p with x removed) and, in addition, a seeded request emits
    exactly the tokens, and leaves its generator in exactly the state, that non-speculative decoding
    gives (when the rows equal its logits). With q given the uniforms are spent differently, so a
    seeded request is reproducible but its tokens differ from non-speculative decoding's.
    """
    _check_rows(target_logits, draft_ids, draft_logits)
    if draft_logits is None:
        return _verify_one_hot(target_logits, draft_ids, generator)
    tokens = []
    for i, draft in enumerate(draft_ids):
        p = torch.softmax(target_logits[i].double(), dim=-1)          # [V]
        q = torch.softmax(draft_logits[i].double(), dim=-1)           # [V]
        u = torch.rand((), generator=generator, dtype=torch.float64).item()
        if u * q[draft].item() < p[draft].item():
            tokens.append(draft)
            continue
        tokens.append(_draw_residual(p, q, generator))
        return Verdict(tuple(tokens))
    tokens.append(draw_token(target_logits[len(draft_ids)], generator))
    return Verdict(tuple(tokens))


def _verify_one_hot(target_logits: torch.Tensor, draft_ids: Sequence[int],
                    generator: torch.Generator) -> Verdict:
    """Deterministic drafts: sample each row as the sampler does; accept while it equals the draft."""
    tokens = []
    for i in range(len(draft_ids) + 1):
        token = draw_token(target_logits[i], generator)
        tokens.append(token)
        if i == len(draft_ids) or token != draft_ids[i]:
            break
    return Verdict(tuple(tokens))


def _draw_residual(p: torch.Tensor, q: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from normalised max(0, p - q) [V] (float64), p itself when rounding left no mass.

    A rejection implies p(x) < q(x) for the draft x, so with exact arithmetic the residual has mass;
    only rounding of p and q (both summing to 1 within float64 error) can empty it.
    """
    residual = (p - q).clamp_min(0.0)
    if not residual.sum().item() > 0.0:
        residual = p
    return draw_token(residual.log(), generator)
