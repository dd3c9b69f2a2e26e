"""StepSampler: a computed step's logit rows turned into tokens (DESIGN 14: constraints are masks).

Per step, in order: prompt logprobs are scored from the rows of chunks that asked for them; each
sampling chunk's last row has its grammar's mask applied (constrained requests only) and is
sampled with the request's own generator; a chunk that verifies drafts has each of its rows
masked by its grammar's state after the drafts before it, then the drafts are verified. Chunk i's
logit rows are logits[offsets[i]:offsets[i + 1]] (step_inputs.logit_row_offsets). Grammar masks
are counted and timed (rows masked, seconds filling and applying them).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from llmc.kernels.token_bitmask import apply_token_bitmask

from .grammar import GrammarCompiler, bitmask_words
from .request import Request
from .sampler import SampleResult, sample, token_logprobs
from .scheduler import Chunk
from .speculative.speculator import verify_rows
from .speculative.verify import Verdict

StepResult = tuple[list[SampleResult], Verdict | None]     # a sequence's tokens from a step, its verdict
RowsOf = list[tuple[int, Chunk, Request]]                   # (first logit row, chunk, its request)


class StepSampler:
    def __init__(self, grammars: GrammarCompiler, vocab_size: int):
        self.grammars = grammars
        self.vocab_size = vocab_size
        self.grammar_rows = 0               # logit rows a grammar masked, since the start
        self.grammar_mask_seconds = 0.0     # ... and the time their masks took (filled and applied)

    def score_prompts(self, chunks: RowsOf, logits: torch.Tensor) -> None:
        """Prompt logprobs: row p of a chunk scores prompt token p + 1 (raw logprobs, as vLLM's)."""
        for row, c, req in chunks:
            seq = c.seq
            if not seq.wants_prompt_logprobs or c.num_drafts:
                continue
            first = c.end - c.num_logits
            last = min(c.end, len(seq.prompt_ids) - 1)
            rows = torch.log_softmax(logits[row:row + last - first], dim=-1)
            for p in range(max(first, seq.prompt_scored), last):
                token = seq.prompt_ids[p + 1]
                logprob = token_logprobs(rows[p - first], token, seq.params.prompt_logprobs)
                req.prompt_logprobs.append(SampleResult(token, *logprob))
            seq.prompt_scored = max(seq.prompt_scored, last)

    def sample(self, chunks: RowsOf, logits: torch.Tensor, generators: dict[int, object]) -> dict[int, StepResult]:
        """Per sampling chunk's sequence id: the tokens it gains, and the verdict when it verified drafts."""
        single = [(row, c, req) for row, c, req in chunks if c.samples and not c.num_drafts]
        results = {}
        if single:
            reqs = [req for _, _, req in single]
            rows = _rows(logits, [row + c.num_logits - 1 for row, c, _ in single])
            self._apply_grammars(rows, reqs)
            sampled = sample(rows, [r.seq.params for r in reqs], [generators[r.seq.seq_id] for r in reqs],
                             [(r.seq.prompt_ids, r.seq.output_ids) for r in reqs])
            results = {c.seq.seq_id: ([r], None) for (_, c, _), r in zip(single, sampled)}
        for row, c, req in chunks:
            if c.num_drafts:
                rows = logits[row:row + c.num_logits]
                self._apply_grammar_along_drafts(rows, req)
                verdict, kept = verify_rows(rows, c.seq, generators[c.seq.seq_id])
                results[c.seq.seq_id] = (kept, verdict)
        return results

    def _apply_grammar_along_drafts(self, rows: torch.Tensor, req: Request) -> None:
        """A constrained sequence's verify rows masked, row i by its grammar after the drafts before it."""
        grammar, drafts = req.grammar, req.seq.draft_ids
        if grammar is not None:
            words = bitmask_words(self.vocab_size)
            self._apply_masks(rows, lambda: grammar.bitmasks_along(drafts, words), list(range(rows.shape[0])))

    def _apply_grammars(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        """Set every token a constrained row's grammar does not allow next to -inf, before sampling."""
        constrained = [(row, r.grammar) for row, r in enumerate(reqs) if r.grammar is not None]
        if constrained:
            rows, matchers = zip(*constrained)
            self._apply_masks(logits, lambda: self.grammars.next_token_bitmasks(list(matchers)), list(rows))

    def _apply_masks(self, logits: torch.Tensor, fill: Callable[[], torch.Tensor], rows: list[int]) -> None:
        """Apply the bitmasks `fill` makes (row i masks logits row rows[i]); count the rows and the
        time, filling included."""
        start = time.perf_counter()
        apply_token_bitmask(logits, fill(), torch.tensor(rows, dtype=torch.int64))
        self.grammar_rows += len(rows)
        self.grammar_mask_seconds += time.perf_counter() - start


def _rows(logits: torch.Tensor, index: list[int]) -> torch.Tensor:
    """logits[index]: a view when the rows are consecutive (a decode step: one row per sequence, in
    order), so [batch, vocab] logits are not copied; a gathered copy otherwise."""
    if index == list(range(index[0], index[0] + len(index))):
        return logits[index[0]:index[0] + len(index)]
    return logits[index]
