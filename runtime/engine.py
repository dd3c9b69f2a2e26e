"""Engine: requests in, tokens and text out, one scheduled step at a time.

The engine is single-threaded: `add_request` validates and queues; `step` runs one scheduled
step (any mix of prompt chunks and decode tokens), samples, and returns what each advanced
request gained; `abort` ends a request and frees its blocks. A step whose computation raises
fails the requests computed in it (finish_reason "error", with the reason) and leaves the
scheduler and block manager consistent, so the engine goes on serving the others.
Concurrent callers go through an `EngineLoop` (engine_loop.py), the engine's one owner;
`generate` and `stream` here are conveniences that run such a loop for the call.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch

from llmc.compiler.dtypes import dtype_info
from llmc.kernels.token_bitmask import apply_token_bitmask

from .artifact import Artifact, load_artifact
from .backends import check_backend_name, check_backend_options, choose_backend
from .block_manager import BlockManager
from .engine_loop import EngineLoop
from .executor import DEVICES
from .grammar import GrammarCompiler, GrammarMatcher, bitmask_words
from .model_runner import ModelRunner
from .request import Completion, GrammarViolation, PreparedRequest, Request, RequestOutput
from .sampler import SampleResult, make_generator, sample, token_logprobs
from .sampling_params import RequestError, SamplingParams
from .scheduler import Chunk, ScheduledStep, Scheduler, SchedulerConfig
from .sequence import Sequence
from .speculative.drafters import build_drafter
from .speculative.speculator import SpeculationStats, SpeculativeConfig, Speculator, speculates, verify_rows
from .speculative.verify import Verdict
from .step_inputs import build_step_inputs, logit_row_offsets
from .tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("llmc")


@dataclass(frozen=True)
class EngineConfig:
    """KV cache budget, batching limits and the backend; validated on construction.

    backend_options: the backend's own options by name, opaque here (the torch backend's kernels
    and step_plans, every backend's cuda_graphs: backends.py); each must be an option of some
    backend with a value valid there, and the chosen backend ignores, with one INFO line, those
    that are another's."""

    kv_cache_bytes: int = 256 * 2**20
    block_size: int = 16
    max_num_seqs: int = 64
    max_batched_tokens: int = 2048  # vLLM's online default; on a CPU, 512 cost ~10% throughput
    enable_prefix_caching: bool = True
    chunked_prefill: bool = True
    backend: str = "auto"           # a registered backend (torch, triton) or "auto": triton on a GPU if it has kernels
    device: str = "auto"            # "cpu", "cuda", or "auto" (the backend's: torch runs on the CPU unless told)
    backend_options: Mapping[str, object] = field(default_factory=dict)
    speculative: SpeculativeConfig | None = None   # draft and verify several tokens a step (speculative/)
    prefix_cache_salt: str | None = None   # every request's prefix-cache keys start from it (with its own cache_salt)
    async_scheduling: bool = True  # an EngineLoop schedules step N+1 while step N computes (not when speculating)

    def __post_init__(self) -> None:
        for name in ("kv_cache_bytes", "block_size", "max_num_seqs", "max_batched_tokens"):
            if getattr(self, name) <= 0:
                raise RequestError(f"engine option {name}={getattr(self, name)} must be positive")
        check_backend_name(self.backend)
        if self.device not in DEVICES:
            raise RequestError(f"device {self.device!r} is unknown; choose one of {', '.join(DEVICES)}")
        object.__setattr__(self, "backend_options", dict(self.backend_options))     # the config's own copy
        check_backend_options(self.backend_options)


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    prefix_cache_hit_rate: float
    preemptions: int
    steps: int
    grammar_rows: int = 0               # logits rows a grammar masked, since the start
    grammar_mask_seconds: float = 0.0   # ... and the time their masks took (filled and applied)
    speculation: SpeculationStats | None = None     # drafted / accepted counters when speculating


def kv_cache_dtype(artifact: Artifact) -> str:
    """The KV cache element type of the compiled graphs, as a user dtype name."""
    ir_dtype = artifact.graphs["prefill"].node_map()["kv_cache"].type.dtype
    return dtype_info(ir_dtype).user_name or ir_dtype


def cache_salt(server: str | None, request: str | None) -> str | None:
    """A sequence's prefix-cache salt: the server's and the request's, where given (None: neither)."""
    if server is None and request is None:
        return None
    return f"{server or ''}\0{request or ''}"


StepResult = tuple[list[SampleResult], Verdict | None]     # a sequence's tokens from a step, its verdict


class Engine:
    def __init__(self, artifact: Artifact | str | Path, config: EngineConfig = EngineConfig()):
        self.artifact = artifact if isinstance(artifact, Artifact) else load_artifact(artifact)
        self.config = config
        self.tokenizer = Tokenizer(self.artifact.tokenizer)
        backend = choose_backend(config.backend, self.artifact, config.device, config.backend_options)
        cache_type = self.artifact.graphs["prefill"].node_map()["kv_cache"].type
        per_block = backend.kv_bytes_per_block(cache_type, config.block_size)    # the backend's layout
        num_blocks = config.kv_cache_bytes // per_block
        if num_blocks < 1:
            raise RequestError(f"a KV cache of {config.kv_cache_bytes} bytes holds no block of "
                               f"{per_block} bytes; give more KV cache memory")
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, SchedulerConfig(
            config.max_num_seqs, config.max_batched_tokens, config.chunked_prefill))
        self.runner = ModelRunner(self.artifact, num_blocks, config.block_size, backend, config.max_num_seqs,
                                  1 + config.speculative.num_draft_tokens if config.speculative else 1)
        if not isinstance(artifact, Artifact):
            # loaded here, so nobody else reads its weights: the executor holds them now (in the layouts it
            # chose) and the artifact keeps their shapes and dtypes, so no second copy stays resident
            self.artifact.weights = {name: w.to("meta") for name, w in self.artifact.weights.items()}
        self.kernels = self.runner.capabilities.kernels     # what computes the ops, for reports
        self.eos_ids = self.artifact.config.eos_token_ids
        self.grammars = GrammarCompiler(self.artifact.tokenizer.tokenizer_json, self.artifact.config.vocab_size,
                                        self.eos_ids)
        self.grammar_rows, self.grammar_mask_seconds = 0, 0.0
        self.speculator = self._speculator(config, backend) if config.speculative else None
        self.requests: dict[int, Request] = {}
        self.generators: dict[int, object] = {}     # request id -> its sampling stream (a torch.Generator; None: greedy)
        self.num_steps = 0
        self._ids = itertools.count()

    def _speculator(self, config: EngineConfig, backend) -> Speculator:
        drafter = build_drafter(config.speculative.source, self.artifact, self.runner, self.blocks, backend.name,
                                config.device, config.backend_options, config.max_num_seqs)
        return Speculator(config.speculative, drafter, self.max_sequence_tokens)

    # ------------------------------------------------------------------ requests

    def _check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        cfg = self.artifact.config
        if not prompt_ids:
            raise RequestError("the prompt is empty; send at least one token", "prompt")
        if bad := [t for t in prompt_ids if not 0 <= t < cfg.vocab_size]:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{cfg.vocab_size - 1})", "prompt")
        total = len(prompt_ids) + params.max_tokens
        if total > cfg.max_position_embeddings:
            raise RequestError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                               f"exceeds the model's context of {cfg.max_position_embeddings}; shorten one",
                               "max_tokens")
        if self.blocks.blocks_needed(total) > self.blocks.num_blocks:
            raise RequestError(f"{total} tokens need more KV cache than the engine has "
                               f"({self.max_sequence_tokens} tokens); lower max_tokens", "max_tokens")

    @property
    def max_sequence_tokens(self) -> int:
        """The most tokens (prompt + output) one sequence may hold: context and KV cache permitting."""
        return min(self.artifact.config.max_position_embeddings, self.blocks.num_blocks * self.blocks.block_size)

    def prepare_prompt(self, prompt: list[int] | str, params: SamplingParams) -> list[int]:
        """Token ids of a valid request (text is tokenized); RequestError otherwise. Reads only what
        never changes after construction, so any thread may call it."""
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_request(prompt_ids, params)
        return prompt_ids

    def prepare_grammar(self, params: SamplingParams) -> GrammarMatcher | None:
        """The request's grammar matcher, built (or taken from the cache) in the caller's thread;
        RequestError naming the field when the grammar cannot be enforced. Any thread may call it."""
        return self.grammars.matcher(params.grammar) if params.grammar is not None else None

    def prepare(self, prompt: list[int] | str, params: SamplingParams) -> PreparedRequest:
        """A valid request made ready to add (tokenized, its grammar built); RequestError otherwise.
        Any thread may call it: it reads only what never changes after construction."""
        return PreparedRequest(self.prepare_prompt(prompt, params), params, self.prepare_grammar(params))

    def next_request_id(self) -> int:
        return next(self._ids)

    def add_request(self, prompt: list[int] | str, params: SamplingParams = SamplingParams(),
                    priority: int = 0, request_id: int | None = None, grammar: GrammarMatcher | None = None) -> int:
        """Queue a request (token ids, or text to tokenize); return its id. Invalid: RequestError.
        `grammar`: its matcher when the caller prepared it (prepare_grammar), else built here."""
        prompt_ids = self.prepare_prompt(prompt, params)
        grammar = grammar or self.prepare_grammar(params)
        rid = self.next_request_id() if request_id is None else request_id
        assert rid not in self.requests, f"request id {rid} is already in use"
        seq = Sequence(rid, prompt_ids, params, priority, arrival_time=time.perf_counter(),
                       cache_salt=cache_salt(self.config.prefix_cache_salt, params.cache_salt))
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        self.requests[seq.seq_id] = Request(seq, detok, grammar)
        self.generators[seq.seq_id] = make_generator(params)
        self.scheduler.add(seq)
        return seq.seq_id

    def abort(self, request_id: int) -> RequestOutput | None:
        """End a request now and free its KV blocks; None if it already ended."""
        req = self._remove(request_id)
        if req is None:
            return None
        self.scheduler.finish(req.seq)
        return req.abort(time.perf_counter())

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every request in flight with an error (after a failure the engine cannot place)."""
        return [self._fail(rid, error) for rid in list(self.requests)]

    def _fail(self, request_id: int, error: str) -> RequestOutput:
        req = self._remove(request_id)
        self.scheduler.finish(req.seq)
        return req.fail(time.perf_counter(), error)

    def _remove(self, request_id: int) -> Request | None:
        """Forget a request that ended (and its sampling stream, and its draft state); None if it already had."""
        self.generators.pop(request_id, None)
        if self.speculator is not None:
            self.speculator.drafter.forget(request_id)
        return self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return the outputs of the requests that gained tokens or failed."""
        if self.speculator is not None:
            self.speculator.plan([s for s in self.scheduler.running if speculates(s)])
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return []
        self.num_steps += 1
        now = time.perf_counter()
        for c in scheduled.chunks:
            c.seq.first_scheduled_time = c.seq.first_scheduled_time or now
        try:
            logits, offsets = self._forward(scheduled), logit_row_offsets(scheduled.chunks)
            self._score_prompts(scheduled.chunks, logits, offsets)
            results = self._sample(scheduled.chunks, logits, offsets)
        except Exception as exc:   # the step's requests fail; nothing was recorded for them yet
            log.exception("a model step failed; failing the %d requests in it", len(scheduled.chunks))
            reason = f"the model step computing this request failed: {type(exc).__name__}: {exc}"
            return [self._fail(c.seq.seq_id, reason) for c in scheduled.chunks]
        now = time.perf_counter()
        outputs = [self._commit(c, results.get(c.seq.seq_id), now) for c in scheduled.chunks]
        return [out for out in outputs if out is not None]

    def _sample(self, chunks: list[Chunk], logits: torch.Tensor, offsets: list[int]) -> dict[int, StepResult]:
        """Per sampling chunk's sequence id: the tokens it gains, and the verdict when it verified drafts
        (chunk i's logit rows are logits[offsets[i]:offsets[i + 1]])."""
        single = [(offsets[i], c) for i, c in enumerate(chunks) if c.samples and not c.num_drafts]
        results = {}
        if single:
            reqs = [self.requests[c.seq.seq_id] for _, c in single]
            rows = logits[[row + c.num_logits - 1 for row, c in single]]
            self._apply_grammars(rows, reqs)
            sampled = sample(rows, [r.seq.params for r in reqs], [self.generators[r.seq.seq_id] for r in reqs],
                             [(r.seq.prompt_ids, r.seq.output_ids) for r in reqs])
            results = {c.seq.seq_id: ([r], None) for (_, c), r in zip(single, sampled)}
        for i, c in enumerate(chunks):
            if c.num_drafts:
                rows = logits[offsets[i]:offsets[i + 1]]
                self._apply_grammar_along_drafts(rows, c.seq)
                verdict, kept = verify_rows(rows, c.seq, self.generators[c.seq.seq_id])
                results[c.seq.seq_id] = (kept, verdict)
        return results

    def _apply_grammar_along_drafts(self, rows: torch.Tensor, seq: Sequence) -> None:
        """A constrained sequence's verify rows masked, row i by its grammar after the drafts before it."""
        grammar = self.requests[seq.seq_id].grammar
        if grammar is not None:
            words = bitmask_words(self.artifact.config.vocab_size)
            self._apply_masks(rows, lambda: grammar.bitmasks_along(seq.draft_ids, words), list(range(rows.shape[0])))

    def _score_prompts(self, chunks: list[Chunk], logits: torch.Tensor, offsets: list[int]) -> None:
        """Prompt logprobs: row p of a chunk scores prompt token p + 1 (raw logprobs, as vLLM's)."""
        for i, c in enumerate(chunks):
            seq = c.seq
            if not seq.wants_prompt_logprobs or c.num_drafts:
                continue
            first = c.end - c.num_logits
            last = min(c.end, len(seq.prompt_ids) - 1)
            rows = torch.log_softmax(logits[offsets[i]:offsets[i] + last - first], dim=-1)
            scored = self.requests[seq.seq_id].prompt_logprobs
            for p in range(max(first, seq.prompt_scored), last):
                token = seq.prompt_ids[p + 1]
                scored.append(SampleResult(token, *token_logprobs(rows[p - first], token, seq.params.prompt_logprobs)))
            seq.prompt_scored = max(seq.prompt_scored, last)

    def _commit(self, chunk: Chunk, result, now: float) -> RequestOutput | None:
        """Record a computed chunk: its tokens' K/V, and what its request gained (None: nothing yet).
        A verified chunk keeps the K/V of its accepted drafts only: the sequence's length moves back
        past the rejected ones (their blocks trimmed) and only accepted tokens are hashed."""
        seq, num_drafts = chunk.seq, chunk.num_drafts
        seq.draft_ids = []
        if not num_drafts:
            seq.num_computed = chunk.end
            self.blocks.register_full_blocks(seq.seq_id, seq.all_ids, chunk.end)
        if result is None:                        # a prompt chunk short of the prompt's end
            return None
        (kept, verdict), req = result, self.requests[seq.seq_id]
        try:
            out = req.add_tokens(kept, self.eos_ids, now)
        except GrammarViolation as exc:
            return self._fail(seq.seq_id, str(exc))
        if num_drafts:
            if not out.finished:
                seq.num_computed = seq.num_tokens - 1
                self.blocks.trim(seq.seq_id, seq.num_computed)
                self.blocks.register_full_blocks(seq.seq_id, seq.all_ids, seq.num_computed)
            self.speculator.commit(seq, verdict, num_drafts, out.finished)
        if out.finished:
            self.scheduler.finish(seq)
            self._remove(seq.seq_id)
        return out

    def _apply_grammars(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        """Set every token a constrained row's grammar does not allow next to -inf, before sampling."""
        constrained = [(row, r.grammar) for row, r in enumerate(reqs) if r.grammar is not None]
        if constrained:
            rows, matchers = zip(*constrained)
            self._apply_masks(logits, lambda: self.grammars.next_token_bitmasks(list(matchers)), list(rows))

    def _apply_masks(self, logits: torch.Tensor, fill: Callable[[], torch.Tensor], rows: list[int]) -> None:
        """Apply the bitmasks `fill` makes (row i masks logits row rows[i]); count the rows and the
        time, filling included (EngineStats.grammar_rows / grammar_mask_seconds)."""
        start = time.perf_counter()
        apply_token_bitmask(logits, fill(), torch.tensor(rows, dtype=torch.int64))
        self.grammar_rows += len(rows)
        self.grammar_mask_seconds += time.perf_counter() - start

    def _forward(self, scheduled: ScheduledStep) -> torch.Tensor:
        """The step's logit rows (drafts made first, and the step timed, where the engine speculates)."""
        self.runner.copy_blocks(scheduled.copies)
        if self.speculator is not None:
            self.speculator.draft(scheduled.chunks)
        start = time.perf_counter()
        logits = self.runner.run("decode" if scheduled.is_pure_decode else "prefill",
                                 build_step_inputs(scheduled.chunks, self.blocks))
        if self.speculator is not None:
            self.speculator.record_step(scheduled.chunks, time.perf_counter() - start)
        return logits

    # ---------------------------------------------------------------- front ends

    def generate(self, prompts: list[list[int]] | list[str],
                 params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Run an offline batch to completion through an EngineLoop; completions in prompt order."""
        with EngineLoop(self) as loop:
            return loop.generate(prompts, params)

    def stream(self, prompt: list[int] | str, params: SamplingParams) -> Iterator[RequestOutput]:
        """Yield one request's outputs as they come, through an EngineLoop; closing it aborts."""
        with EngineLoop(self) as loop:
            yield from loop.stream(prompt, params)

    def stats(self) -> EngineStats:
        free = self.blocks.num_free_blocks
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting),
                           self.blocks.num_blocks - free, free, self.blocks.hit_rate(),
                           self.scheduler.num_preemptions, self.num_steps, self.grammar_rows,
                           self.grammar_mask_seconds, self.speculator.stats.snapshot() if self.speculator else None)
