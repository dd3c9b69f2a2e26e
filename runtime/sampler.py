"""Sampling parameters and the sampler: greedy or temperature, reproducible per request.

Each request that samples owns a `torch.Generator` seeded from its seed, so what it draws does
not depend on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class RequestError(ValueError):
    """A request with invalid parameters; the message names the parameter and its valid range."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 means greedy."""

    max_tokens: int = 128
    temperature: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens={self.max_tokens} must be at least 1")
        if not 0.0 <= self.temperature <= 100.0:
            raise RequestError(f"temperature={self.temperature} must be between 0 and 100")


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A private random stream for a sampling request (None for greedy)."""
    if params.temperature == 0.0:
        return None
    gen = torch.Generator()
    gen.manual_seed(params.seed if params.seed is not None else int(torch.seed()) % (2**63))
    return gen


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of `logits` [S, vocab], by each row's own parameters."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, (p, gen) in enumerate(zip(params, generators)):
        if p.temperature > 0.0:
            probs = torch.softmax(logits[i].float() / p.temperature, dim=-1)
            tokens[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    return tokens
