"""Engine-side state of one request: its sequence, text and metrics.

Two stages: `add_tokens` records a step's tokens (the token stage: stop tokens, max_tokens,
grammars), `emit` turns them into text (the output stage, which may run while the next step
computes). Text is detokenized incrementally. Stop strings are searched in the text generated so far;
the output ends just before the first match, which is never emitted. While a request runs,
its last `longest stop string - 1` characters are held back, since they might begin one.
Pure Python (DESIGN 6): the request's random stream for sampling, a torch.Generator, is the
engine's, beside the sampler that draws from it; sampled tokens arrive here as SampleResults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .sampling_params import SamplingParams
from .sequence import Sequence

if TYPE_CHECKING:        # types only: importing them would import torch (sampler) and the tokenizers
    from .grammar import GrammarMatcher
    from .sampler import SampleResult
    from .tokenizer import IncrementalDetokenizer


@dataclass(frozen=True)
class RequestMetrics:
    """Timings in seconds: queue = arrival -> first scheduled; ttft = arrival -> first token."""

    queue_time: float
    ttft: float
    tpot: float                  # mean time per output token after the first
    e2e: float
    prompt_tokens: int
    output_tokens: int
    cached_prompt_tokens: int
    preemptions: int
    drafted_tokens: int = 0      # speculative decoding: tokens drafted for this request
    accepted_tokens: int = 0     # ... and accepted by verification


@dataclass
class RequestOutput:
    """What one request gained in a step (a delta) and its state after it."""

    request_id: int
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None        # "stop" (EOS, stop token or string), "length", "abort", "error"
    stop_reason: str | int | None = None    # the stop string or token that ended it
    logprobs: list[SampleResult] = field(default_factory=list)
    metrics: RequestMetrics | None = None   # set when finished
    error: str | None = None                # why, when finish_reason is "error"
    prompt_logprobs: list[SampleResult] | None = None   # once, with the first token: per prompt token (the
                                                         # first's logprob None: nothing predicts it)

    @classmethod
    def failed(cls, request_id: int, error: str) -> "RequestOutput":
        """The end of a request that failed before the engine computed anything for it."""
        return cls(request_id, [], "", True, "error", error=error)


class GrammarViolation(RuntimeError):
    """A sampled token the request's grammar does not allow (a masking bug: the request fails)."""


@dataclass(frozen=True)
class PreparedRequest:
    """A request checked and made ready in the caller's thread: its prompt's token ids and, when it
    is constrained, its grammar matcher (built there, so nothing slow runs in the engine loop)."""

    prompt_ids: list[int]
    params: SamplingParams
    grammar: GrammarMatcher | None = None


@dataclass
class Completion:
    """A finished request, as `Engine.generate` returns it."""

    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: str | int | None
    metrics: RequestMetrics | None
    error: str | None = None


def _unscored(token_id: int) -> SampleResult:
    from .sampler import SampleResult      # here, not at the top: the sampler imports torch

    return SampleResult(token_id)


class Request:
    def __init__(self, seq: Sequence, detok: IncrementalDetokenizer, grammar: GrammarMatcher | None = None):
        self.seq = seq
        self.detok = detok
        self.grammar = grammar  # its structured-output constraint, advanced by the engine with each token
        self.text = ""          # output text so far (cut at a stop string)
        self.emitted = 0        # characters of `text` already returned
        self._hold = max((len(s) for s in seq.params.stop), default=1) - 1
        # prompt logprobs as the engine scores them (asked for: params.prompt_logprobs), sent once
        self.prompt_logprobs: list[SampleResult] | None = None
        if seq.params.prompt_logprobs is not None:      # the first token: nothing predicts it (logprob None)
            self.prompt_logprobs = [_unscored(seq.prompt_ids[0])]
        self._prompt_logprobs_sent = False
        self._new: list[SampleResult] = []      # tokens recorded (token stage) but not yet emitted
        self._stop: str | int | None = None     # the stop token or string that ended it

    def _stop_token(self, token: int, eos_ids: tuple[int, ...]) -> int | None:
        p = self.seq.params
        return token if token in p.stop_token_ids or (not p.ignore_eos and token in eos_ids) else None

    def _find_stop_string(self, before: int) -> str | None:
        """The first stop string that now occurs, searching only where it could be new."""
        start = max(0, before - self._hold)
        hits = [(self.text.find(s, start), s) for s in self.seq.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return None
        index, stop = min(hits)
        self.text = self.text[:index]
        return stop

    def add_tokens(self, results: list[SampleResult], eos_ids: tuple[int, ...], now: float) -> None:
        """The token stage: record the tokens a step gave (several after speculative verification),
        in order, up to the first that finishes the request: a stop token, a completed grammar (one
        that allows nothing more) or max_tokens; the rest are dropped. The grammar (if any) advances
        with each; GrammarViolation if it refuses one. Text and stop strings are `emit`'s."""
        seq = self.seq
        for result in results:
            if self.grammar is not None and not self.grammar.accept(result.token_id):
                raise GrammarViolation(f"token {result.token_id} broke the request's grammar: {self.grammar.error}")
            seq.output_ids.append(result.token_id)
            seq.first_token_time = seq.first_token_time or now
            self._new.append(result)
            self._stop = self._stop_token(result.token_id, eos_ids)
            if self._stop is not None or (self.grammar is not None and self.grammar.is_finished):
                seq.finish("stop", now)
            elif len(seq.output_ids) >= seq.params.max_tokens:
                seq.finish("length", now)
            if seq.is_finished:
                return

    def emit(self, now: float) -> RequestOutput:
        """The output stage: detokenise the tokens recorded since the last emit and look for stop
        strings; one output for them all. A stop string ends the request at the token that completes
        it (the tokens after it are dropped); the last token of a finished request flushes the text
        (an unfinished character is emitted as U+FFFD, not dropped); a stop token adds no text."""
        seq, new, self._new = self.seq, self._new, []
        for i, result in enumerate(new):
            if result.token_id == self._stop and i == len(new) - 1:
                break
            before = len(self.text)
            self.text += self.detok.push(result.token_id)
            if seq.is_finished and i == len(new) - 1:
                self.text += self.detok.flush()
            if (stop := self._find_stop_string(before)) is not None:
                del seq.output_ids[len(seq.output_ids) - (len(new) - i - 1):]
                new, self._stop = new[:i + 1], stop
                seq.finish("stop", now)
                break
        return self._output([r.token_id for r in new], [r for r in new if r.logprob is not None],
                            self._stop if seq.is_finished else None)

    def abort(self, now: float) -> RequestOutput:
        self.seq.finish("abort", now)
        return self._output([], [], None)

    def fail(self, now: float, error: str) -> RequestOutput:
        """End the request because the step computing it failed; the text so far is delivered."""
        self.seq.finish("error", now)
        out = self._output([], [], None)
        out.error = error
        return out

    def _output(self, tokens: list[int], logprobs: list[SampleResult], stop) -> RequestOutput:
        seq = self.seq
        upto = len(self.text) if seq.is_finished else max(self.emitted, len(self.text) - self._hold)
        delta, self.emitted = self.text[self.emitted:upto], upto
        out = RequestOutput(seq.seq_id, tokens, delta, seq.is_finished, seq.finish_reason, stop,
                            logprobs, self.metrics() if seq.is_finished else None)
        if self.prompt_logprobs is not None and not self._prompt_logprobs_sent and (tokens or seq.is_finished):
            out.prompt_logprobs, self._prompt_logprobs_sent = self.prompt_logprobs, True
        return out

    def metrics(self) -> RequestMetrics:
        seq = self.seq
        first = seq.first_token_time or seq.finished_time
        scheduled = seq.first_scheduled_time or seq.finished_time
        n = len(seq.output_ids)
        return RequestMetrics(
            queue_time=scheduled - seq.arrival_time, ttft=first - seq.arrival_time,
            tpot=(seq.finished_time - first) / (n - 1) if n > 1 else 0.0,
            e2e=seq.finished_time - seq.arrival_time, prompt_tokens=len(seq.prompt_ids),
            output_tokens=n, cached_prompt_tokens=seq.num_cached_prompt, preemptions=seq.num_preemptions,
            drafted_tokens=seq.num_drafted, accepted_tokens=seq.num_accepted)
