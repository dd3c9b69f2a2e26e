"""SamplingParams and RequestError: what a request asks for, validated; no torch here, so the
scheduler and sequence bookkeeping stay pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:        # a type only: grammar.py imports llguidance and torch
    from .grammar import GrammarSpec


class RequestError(ValueError):
    """A request with invalid parameters; the message names the parameter and its valid range,
    `param` (when known) is the parameter's name, as an API error reports it."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# Bounds on a request's lists (README "Serving"): each is checked against every generated token or
# row, so an unbounded one lets one request slow every step. OpenAI allows 4 stop strings.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_CACHE_SALT_CHARS = 1024


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop (defaults as in vLLM / the OpenAI API)."""

    max_tokens: int = 16
    temperature: float = 1.0          # 0 = greedy
    top_k: int = 0                    # 0 = all tokens
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0   # > 1 discourages tokens already in prompt or output
    frequency_penalty: float = 0.0    # subtracted once per earlier occurrence in the output
    presence_penalty: float = 0.0     # subtracted once if the token occurred in the output
    seed: int | None = None
    stop: tuple[str, ...] = ()        # stop strings; not included in the output text
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None       # report the chosen token's logprob and the top-n
    prompt_logprobs: int | None = None  # report each prompt token's logprob (after the first) and the top-n
    grammar: GrammarSpec | None = None  # constrain the output (structured output: runtime/grammar.py)
    cache_salt: str | None = None     # prefix-cache isolation: cached KV is shared only with the same salt

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens >= 1, "max_tokens", f"max_tokens={self.max_tokens} must be at least 1"),
            (0.0 <= self.temperature <= 100.0, "temperature", f"temperature={self.temperature} must be in [0, 100]"),
            (self.top_k >= 0, "top_k", f"top_k={self.top_k} must be 0 (off) or positive"),
            (0.0 < self.top_p <= 1.0, "top_p", f"top_p={self.top_p} must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p", f"min_p={self.min_p} must be in [0, 1]"),
            (self.repetition_penalty > 0.0, "repetition_penalty",
             f"repetition_penalty={self.repetition_penalty} must be positive"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             f"frequency_penalty={self.frequency_penalty} must be in [-2, 2]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
             f"presence_penalty={self.presence_penalty} must be in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs",
             f"logprobs={self.logprobs} must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
             f"prompt_logprobs={self.prompt_logprobs} must be in [0, 20]"),
            (all(s for s in self.stop), "stop", "stop strings must not be empty"),
            (len(self.stop) <= MAX_STOP_STRINGS, "stop",
             f"{len(self.stop)} stop strings are more than the {MAX_STOP_STRINGS} allowed; send fewer"),
            (all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop), "stop",
             f"a stop string is longer than {MAX_STOP_STRING_CHARS} characters; shorten it"),
            (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
             f"{len(self.stop_token_ids)} stop_token_ids are more than the {MAX_STOP_TOKEN_IDS} allowed; send fewer"),
            (self.cache_salt is None or 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS, "cache_salt",
             f"cache_salt must be 1 to {MAX_CACHE_SALT_CHARS} characters; send a shorter one or none"),
            (self.seed is None or -2**63 <= self.seed < 2**63, "seed", f"seed={self.seed} must fit in 64 bits"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise RequestError(message, param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
