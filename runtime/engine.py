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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping

import torch

from llmc.compiler.dtypes import dtype_info

from .artifact import Artifact, load_artifact
from .backends import check_backend_name, check_backend_options, choose_backend
from .block_manager import BlockManager, cache_salt
from .engine_loop import EngineLoop
from .executor import DEVICES, StepOutput
from .grammar import GrammarCompiler, GrammarMatcher
from .host_times import HostTimes
from .model_runner import ModelRunner
from .request import Completion, GrammarViolation, PreparedRequest, Request, RequestOutput
from .sampler import make_generator
from .sampling_params import MAX_CACHE_SALT_CHARS, RequestError, SamplingParams
from .scheduler import Chunk, Scheduler, SchedulerConfig
from .sequence import Sequence
from .speculative.drafters import build_drafter
from .speculative.speculator import SpeculationStats, SpeculativeConfig, Speculator, speculates
from .input_batch import InputBatch
from .step_inputs import StepInputs, logit_row_offsets
from .step_pipeline import LaunchedStep, PlannedStep, advance, choose_async_scheduling, reads_pending, run_on
from .step_sampling import RowsOf, StepResult, StepSampler
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
    async_scheduling: bool | None = None  # an EngineLoop plans step N+1 while N computes; None: where it pays
    ranks: object = None            # tensor-parallel ranks this engine is rank 0 of (runtime/tensor_parallel)

    def __post_init__(self) -> None:
        for name in ("kv_cache_bytes", "block_size", "max_num_seqs", "max_batched_tokens"):
            if getattr(self, name) <= 0:
                raise RequestError(f"engine option {name}={getattr(self, name)} must be positive")
        check_backend_name(self.backend)
        if self.device not in DEVICES:
            raise RequestError(f"device {self.device!r} is unknown; choose one of {', '.join(DEVICES)}")
        object.__setattr__(self, "backend_options", dict(self.backend_options))     # the config's own copy
        check_backend_options(self.backend_options)
        if self.prefix_cache_salt is not None and not 0 < len(self.prefix_cache_salt) <= MAX_CACHE_SALT_CHARS:
            raise RequestError(f"prefix_cache_salt (--prefix-cache-salt) must be 1 to {MAX_CACHE_SALT_CHARS} "
                               "characters; give another or none")


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
    host_times: HostTimes | None = None             # where the steps' time went, phase by phase


def kv_cache_dtype(artifact: Artifact) -> str:
    """The KV cache element type of the compiled graphs, as a user dtype name."""
    ir_dtype = artifact.graphs["prefill"].node_map()["kv_cache"].type.dtype
    return dtype_info(ir_dtype).user_name or ir_dtype


class Engine:
    def __init__(self, artifact: Artifact | str | Path, config: EngineConfig = EngineConfig()):
        self.artifact = artifact if isinstance(artifact, Artifact) else load_artifact(artifact)
        self.config = config
        self.tokenizer = Tokenizer(self.artifact.tokenizer)
        backend = choose_backend(config.backend, self.artifact, config.device, config.backend_options, config.ranks)
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
        self.sampler = StepSampler(self.grammars, self.artifact.config.vocab_size)
        self.input_batch = InputBatch(self.blocks, config.max_num_seqs,
                                      self.blocks.blocks_needed(self.max_sequence_tokens))
        self.host_times = HostTimes()
        self.speculator = self._speculator(config, backend) if config.speculative else None
        local_ranks = config.ranks.local_ranks if config.ranks is not None else 1    # ranks sharing the cores
        self.async_scheduling = choose_async_scheduling(config.async_scheduling, self.runner.device,
                                                        self.speculator is not None, local_ranks)
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
        return req.abort(time.perf_counter()) if req is not None else None

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every request in flight with an error (after a failure the engine cannot place)."""
        return [self._fail(rid, error) for rid in list(self.requests)]

    def _fail(self, request_id: int, error: str) -> RequestOutput:
        return self._remove(request_id).fail(time.perf_counter(), error)

    def _remove(self, request_id: int) -> Request | None:
        """Forget a request that ended: its sequence leaves the scheduler (its KV blocks freed), its
        sampling stream and draft state go; None if it already had."""
        self.generators.pop(request_id, None)
        if self.speculator is not None:
            self.speculator.drafter.forget(request_id)
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req.seq)
        return req

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step to the end; return the outputs of the requests that gained tokens or failed."""
        planned = self.plan_step()
        launched = self.launch(planned) if planned is not None else None
        return self.emit(self.finish_step(launched)) if launched is not None else []

    def plan_step(self) -> PlannedStep | None:
        """Schedule the next step and build its inputs on the host (None: nothing to run). While a
        step computes, the tokens it will sample are pending: the next step may already compute
        them, and `launch` fills their input ids in once they are known."""
        with self.host_times.timed("schedule"):
            if self.speculator is not None:
                self.speculator.plan([s for s in self.scheduler.running if speculates(s)])
            scheduled = self.scheduler.schedule()
            if scheduled is None:
                return None
            pending = reads_pending(scheduled.chunks)
            advance(scheduled.chunks, time.perf_counter())
            copies = scheduled.copies
            if self.speculator is not None:     # drafts are inputs; speculating steps never overlap
                self.runner.copy_blocks(copies)
                self.speculator.draft(scheduled.chunks)
                copies = []
        with self.host_times.timed("build"):
            inputs = self.input_batch.build(scheduled.chunks)
        preemptions = {c.seq.seq_id: c.seq.num_preemptions for c in scheduled.chunks}
        return PlannedStep(scheduled, inputs, pending, preemptions, copies)

    def launch(self, planned: PlannedStep, worker: ThreadPoolExecutor | None = None) -> LaunchedStep | None:
        """Start computing a planned step (in `worker`, or here, now); None if every request in it ended
        meanwhile. The tokens it reads that were pending are known now (the step before has ended)."""
        chunks = planned.scheduled.chunks
        if not any(c.seq.seq_id in self.requests for c in chunks):
            return None
        for i, row in planned.pending:
            c = chunks[i]
            planned.inputs.input_ids[row:row + c.end - c.start] = torch.tensor(c.seq.step_ids(c.start, c.end))
        self.runner.copy_blocks(planned.copies)
        self.num_steps += 1
        self.host_times.steps += 1
        entry = "decode" if planned.scheduled.is_pure_decode else "prefill"
        return LaunchedStep(planned, run_on(worker, self._compute, entry, planned.inputs))

    def _compute(self, entry: str, inputs: StepInputs) -> tuple[StepOutput, float]:
        """The step's logit rows on the runner's device (sampled there; with greedy picks where the step
        made them), and the seconds the forward took."""
        start = time.perf_counter()
        out = self.runner.run_step(entry, inputs)
        return out, time.perf_counter() - start

    def finish_step(self, launched: LaunchedStep) -> list[Request | RequestOutput]:
        """Wait for a launched step; sample and record its tokens (the token stage: stop tokens,
        max_tokens, grammars, prefix-cache hashes). Returns the requests to `emit` and the outputs of
        those that failed. Chunks of requests that ended while it computed are dropped."""
        chunks = launched.planned.scheduled.chunks
        with self.host_times.timed("wait"):
            try:
                out, seconds = launched.result.result()
            except Exception as exc:   # the step's requests fail; nothing was recorded for them yet
                return self._fail_step(chunks, exc)
        self.host_times.compute += seconds
        if self.speculator is not None:
            self.speculator.record_step(chunks, seconds)
        live = self._live(chunks)
        with self.host_times.timed("sample"):
            try:
                logits = out.logits if self.sampler.reads_logits(live, out.greedy) else None   # not read
                self.sampler.score_prompts(live, logits)
                results = self.sampler.sample(live, logits, self.generators, out.greedy)
            except Exception as exc:
                return self._fail_step(chunks, exc)
        with self.host_times.timed("commit"):
            now, preemptions = time.perf_counter(), launched.planned.preemptions
            committed = [self._commit(c, req, results.get(c.seq.seq_id), preemptions[c.seq.seq_id], now)
                         for _, c, req in live]
        return [item for item in committed if item is not None]

    def _live(self, chunks: list[Chunk]) -> RowsOf:
        """(first logit row, chunk, request) of each chunk whose request has not ended."""
        offsets = logit_row_offsets(chunks)
        return [(offsets[i], c, self.requests[c.seq.seq_id]) for i, c in enumerate(chunks)
                if c.seq.seq_id in self.requests]

    def _fail_step(self, chunks: list[Chunk], exc: Exception) -> list[RequestOutput]:
        log.error("a model step failed; failing the requests in it", exc_info=exc)
        reason = f"the model step computing this request failed: {type(exc).__name__}: {exc}"
        return [self._fail(c.seq.seq_id, reason) for c in chunks if c.seq.seq_id in self.requests]

    def _commit(self, chunk: Chunk, req: Request, result: StepResult | None, preemptions: int,
                now: float) -> Request | RequestOutput | None:
        """Record a computed chunk: its full blocks' prefix-cache keys (unless the sequence was
        preempted since it was scheduled: its blocks are gone), and the tokens its request gained
        (None: nothing yet). A verified chunk keeps the K/V of its accepted drafts only: the
        sequence's length moves back past the rejected ones (their blocks trimmed) and only accepted
        tokens are hashed."""
        seq, num_drafts = chunk.seq, chunk.num_drafts
        seq.draft_ids = []
        if not num_drafts:
            seq.num_pending -= chunk.samples
            if seq.num_preemptions == preemptions:
                self.blocks.register_full_blocks(seq.seq_id, seq.tokens, chunk.end)
        if result is None:                        # a prompt chunk short of the prompt's end
            return None
        kept, verdict = result
        try:
            req.add_tokens(kept, self.eos_ids, now)
        except GrammarViolation as exc:
            return self._fail(seq.seq_id, str(exc))
        if num_drafts:
            if not seq.is_finished:
                seq.num_computed = seq.num_tokens - 1
                self.blocks.trim(seq.seq_id, seq.num_computed)
                self.blocks.register_full_blocks(seq.seq_id, seq.tokens, seq.num_computed)
            self.speculator.commit(seq, verdict, num_drafts, seq.is_finished)
        if seq.is_finished:
            self._remove(seq.seq_id)
        return req

    def emit(self, committed: list[Request | RequestOutput]) -> list[RequestOutput]:
        """The output stage: each committed request's new text (detokenised, cut at a stop string: a
        match ends the request there) as a RequestOutput. It may run while the next step computes;
        a request a stop string ends leaves the scheduler now and that step's token for it is dropped."""
        outputs = []
        with self.host_times.timed("output"):
            now = time.perf_counter()
            for item in committed:
                out = item if isinstance(item, RequestOutput) else item.emit(now)
                if out.finished and out.request_id in self.requests:      # a stop string ended it
                    self._remove(out.request_id)
                outputs.append(out)
        return outputs

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
                           self.scheduler.num_preemptions, self.num_steps, self.sampler.grammar_rows,
                           self.sampler.grammar_mask_seconds,
                           self.speculator.stats.snapshot() if self.speculator else None,
                           self.host_times.snapshot())
