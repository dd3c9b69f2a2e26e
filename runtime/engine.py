"""Engine: requests in, tokens and text out, one scheduled step at a time.

`add_request` validates and queues; `step` runs one scheduled prefill or decode step, samples,
and returns what each touched request gained; `generate` runs a batch to completion; `stream`
yields one request's text as it is produced.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .artifact import Artifact, load_artifact
from .block_manager import BlockManager
from .model_runner import ModelRunner, build_step_inputs
from .sampler import RequestError, SamplingParams, make_generator, sample
from .scheduler import Scheduler
from .sequence import Sequence, SequenceStatus
from .tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class EngineConfig:
    """Cache and batching limits; validated on construction."""

    kv_cache_bytes: int = 256 * 2**20
    block_size: int = 16
    max_num_seqs: int = 64
    max_batched_tokens: int = 4096

    def __post_init__(self) -> None:
        for name in ("kv_cache_bytes", "block_size", "max_num_seqs", "max_batched_tokens"):
            if getattr(self, name) <= 0:
                raise RequestError(f"engine option {name}={getattr(self, name)} must be positive")


@dataclass
class RequestOutput:
    """What one request gained in a step (delta) and its state after it."""

    request_id: int
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None


@dataclass
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer
    generator: object


def kv_bytes_per_token(artifact: Artifact) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
    cache = artifact.graphs["prefill"].node_map()["kv_cache"].type
    layers, _, _, _, kv_heads, head_dim = cache.shape
    element = {"f32": 4, "f16": 2, "bf16": 2}[cache.dtype]
    return 2 * layers * kv_heads * head_dim * element


class Engine:
    def __init__(self, artifact: Artifact | str | Path, config: EngineConfig = EngineConfig()):
        self.artifact = artifact if isinstance(artifact, Artifact) else load_artifact(artifact)
        self.config = config
        self.tokenizer = Tokenizer(self.artifact.tokenizer)
        per_block = kv_bytes_per_token(self.artifact) * config.block_size
        num_blocks = config.kv_cache_bytes // per_block
        if num_blocks < 1:
            raise RequestError(f"a KV cache of {config.kv_cache_bytes} bytes holds no block of "
                               f"{per_block} bytes; give more KV cache memory")
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_batched_tokens)
        self.runner = ModelRunner(self.artifact, num_blocks, config.block_size)
        self.eos_ids = self.artifact.config.eos_token_ids
        self._requests: dict[int, _Request] = {}
        self._ids = itertools.count()

    def _check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        cfg = self.artifact.config
        if not prompt_ids:
            raise RequestError("the prompt is empty; send at least one token")
        if bad := [t for t in prompt_ids if not 0 <= t < cfg.vocab_size]:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{cfg.vocab_size - 1})")
        total = len(prompt_ids) + params.max_tokens
        if total > cfg.max_position_embeddings:
            raise RequestError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                               f"exceeds the model's context of {cfg.max_position_embeddings}; shorten one")
        if self.blocks.blocks_needed(total) > self.blocks.num_blocks:
            raise RequestError(f"{total} tokens need more KV cache than the engine has "
                               f"({self.blocks.num_blocks * self.blocks.block_size} tokens); lower max_tokens")

    def add_request(self, prompt_ids: list[int], params: SamplingParams = SamplingParams()) -> int:
        """Queue a request; returns its id. Raises RequestError for an invalid one."""
        self._check_request(prompt_ids, params)
        seq = Sequence(next(self._ids), list(prompt_ids), params)
        self._requests[seq.seq_id] = _Request(seq, IncrementalDetokenizer(self.tokenizer, prompt_ids),
                                              make_generator(params))
        self.scheduler.add(seq)
        return seq.seq_id

    def abort(self, request_id: int) -> None:
        """Stop a request and free its KV blocks."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req.seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return the outputs of every request it advanced."""
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return []
        seqs = scheduled.seqs
        chunks = [(s, s.num_computed, s.num_tokens) for s in seqs]
        logits = self.runner.run(scheduled.kind, build_step_inputs(chunks, self.blocks))
        reqs = [self._requests[s.seq_id] for s in seqs]
        tokens = sample(logits, [s.params for s in seqs], [r.generator for r in reqs])
        return [self._advance(req, token) for req, token in zip(reqs, tokens)]

    def _advance(self, req: _Request, token: int) -> RequestOutput:
        seq = req.seq
        seq.num_computed = seq.num_tokens
        seq.append(token, self.eos_ids)
        hidden = seq.finish_reason == "stop"  # a stop token is not part of the text
        text = "" if hidden else req.detok.push(token)
        if seq.status is SequenceStatus.FINISHED:
            self.scheduler.finish(seq)
            del self._requests[seq.seq_id]
        return RequestOutput(seq.seq_id, [token], text, seq.status is SequenceStatus.FINISHED, seq.finish_reason)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run a batch of prompts to completion; return each one's output token ids."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        outputs: dict[int, list[int]] = {i: [] for i in ids}
        while self.has_unfinished():
            for out in self.step():
                outputs[out.request_id] += out.new_token_ids
        return [outputs[i] for i in ids]

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[RequestOutput]:
        """Run one request alone, yielding its output as each token arrives."""
        rid = self.add_request(prompt_ids, params)
        while self.has_unfinished():
            for out in self.step():
                if out.request_id == rid:
                    yield out
