"""The per-row sampler: the reference that the engine's batched sampler (batch_sampler.py) matches.

Per row of logits, in this order (vLLM's): repetition / frequency / presence penalties ->
log-probabilities for reporting -> greedy argmax (temperature 0) or temperature -> top-k ->
top-p -> min-p -> one draw. Each sampling request owns a `torch.Generator` seeded from its
seed and draws one uniform number per token from it, so its output does not depend on what
else is in the batch. A row a grammar constrains arrives with its banned tokens already at -inf
(the engine applies the mask first: structured output), so every step below keeps within it.
The engine samples with batch_sampler.py (one pass over all rows, where the logits are); tests hold
it to these functions' tokens and logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.kernels.argmax import argmax_rows

from .sampling_params import SamplingParams


@dataclass(frozen=True)
class SampleResult:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A private random stream for a sampling request (None for greedy)."""
    if params.greedy:
        return None
    gen = torch.Generator()
    gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return gen


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> torch.Tensor:
    """Repetition (prompt + output), frequency and presence (output) penalties on one row."""
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / params.repetition_penalty,
                                   picked * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids), minlength=logits.numel()).float()
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return logits


def top_p_drop(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p's mask over one row's probabilities: the cut is the first token, in descending order of
    probability, at which the running mass reaches p, and every token less likely than it is
    dropped. Tied tokens share a fate (all kept where the cut's probability is theirs), so the
    set does not depend on the order a sort gives ties, and the prefix sums are those of the
    values alone: a partial sort of the most likely tokens gives the same cut (batch_sampler)."""
    ordered = torch.sort(probs, descending=True).values
    mass = ordered.cumsum(dim=-1)
    cut = min(int(torch.searchsorted(mass, torch.tensor([top_p], dtype=probs.dtype))), probs.numel() - 1)
    return probs < ordered[cut]


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masking (-inf) on one row."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = logits.masked_fill(top_p_drop(torch.softmax(logits, dim=-1), params.top_p), float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def draw_token(logits: torch.Tensor, generator: torch.Generator) -> int:
    """Inverse-CDF draw with one uniform number from the request's own generator."""
    probs = torch.softmax(logits, dim=-1)
    u = torch.rand((), generator=generator, dtype=torch.float64).item()
    index = int(torch.searchsorted(probs.double().cumsum(dim=-1), torch.tensor([u], dtype=torch.float64)))
    index = min(index, probs.numel() - 1)
    while probs[index] == 0:          # u landed past the last kept token by rounding
        index -= 1
    return index


def token_logprobs(logprobs: torch.Tensor, token: int, n: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The chosen token's logprob and the top n; tokens a grammar banned (-inf) are never listed."""
    top = torch.topk(logprobs, n) if n else None
    pairs = tuple((t, v) for t, v in zip(top.indices.tolist(), top.values.tolist()) if v != float("-inf")) \
        if top is not None else ()
    return float(logprobs[token]), pairs


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
               prompt_ids: list[int], output_ids: list[int]) -> SampleResult:
    """Pick one token from one row of fp32 logits [vocab]."""
    logits = apply_penalties(logits.clone(), params, prompt_ids, output_ids)
    if params.greedy:
        token = int(argmax_rows(logits[None])[0])
    else:
        token = draw_token(filter_logits(logits, params), generator)
    if params.logprobs is None:
        return SampleResult(token)
    chosen, top = token_logprobs(torch.log_softmax(logits, dim=-1), token, params.logprobs)
    return SampleResult(token, chosen, top)


def needs_row_sampling(params: SamplingParams) -> bool:
    """False for plain greedy rows, which the batch fast path handles with one argmax."""
    return not params.greedy or params.logprobs is not None or params.repetition_penalty != 1.0 \
        or bool(params.frequency_penalty) or bool(params.presence_penalty)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           histories: list[tuple[list[int], list[int]]]) -> list[SampleResult]:
    """One token per row of fp32 `logits` [S, vocab]; `histories` gives (prompt, output) ids."""
    greedy = argmax_rows(logits).tolist()
    return [sample_row(logits[i], p, g, *h) if needs_row_sampling(p) else SampleResult(greedy[i])
            for i, (p, g, h) in enumerate(zip(params, generators, histories))]
