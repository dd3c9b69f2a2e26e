"""StepSampler: a computed step's logit rows turned into tokens where the logits are (DESIGN 14).

Per step, in order: prompt logprobs are scored in one pass over the rows of chunks that asked for
them; then every row that picks a token is gathered into one [N, vocab] batch on the logits' device
(each sampling chunk's last row; each of a verifying chunk's K+1 rows), grammar masks are applied
to the batch in one call (a sampled row by its grammar's state; verify row i by the state after the
drafts before it), and `batch_sampler.sample_rows` picks every token in one pass. Only token ids and
the logprobs asked for come back to the host. Chunk i's logit rows are logits[offsets[i]:offsets[i +
1]] (step_inputs.logit_row_offsets). Grammar masks are counted and timed (rows masked, seconds
filling and applying them).

Verification (speculative/verify.py's one-hot rejection sampling): row i of a verifying chunk is
sampled as the sampler samples it with the drafts before it as output, and drafts are kept while
they equal the samples; the first sample that differs (or the bonus from row K) ends the verdict.
Its uniforms are peeked (K+1 from a copy of the request's generator state) and the generator then
advances by exactly the tokens kept, so the stream is spent as without speculation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from llmc.kernels.argmax import argmax_rows
from llmc.kernels.token_bitmask import apply_token_bitmask

from .batch_sampler import SamplingRow, logprobs_of, sample_rows, top_pairs, uniforms
from .grammar import GrammarCompiler, bitmask_words
from .request import Request
from .sampler import SampleResult, needs_row_sampling
from .scheduler import Chunk
from .speculative.verify import Verdict, accepted_prefix

StepResult = tuple[list[SampleResult], Verdict | None]     # a sequence's tokens from a step, its verdict
RowsOf = list[tuple[int, Chunk, Request]]                   # (first logit row, chunk, its request)


@dataclass
class _Picks:
    """The rows a step samples: logit row indices, one SamplingRow each, and per chunk its first
    batch row; grammar bitmasks with the batch rows they mask."""

    index: list[int]
    rows: list[SamplingRow]
    firsts: list[tuple[int, Chunk, Request]]
    masks: list[torch.Tensor]
    masked_rows: list[int]


class StepSampler:
    def __init__(self, grammars: GrammarCompiler, vocab_size: int):
        self.grammars = grammars
        self.vocab_size = vocab_size
        self.grammar_rows = 0               # logit rows a grammar masked, since the start
        self.grammar_mask_seconds = 0.0     # ... and the time their masks took (filled and applied)

    @staticmethod
    def reads_logits(chunks: RowsOf, greedy: torch.Tensor | None) -> bool:
        """Whether `score_prompts` or `sample` will read the step's logits: not where every sampling chunk
        is plain greedy, the step made its picks (`greedy`) and no chunk wants prompt logprobs."""
        sampling = [(c, req) for _, c, req in chunks if c.samples]
        return (any(c.seq.wants_prompt_logprobs and not c.num_drafts for _, c, _ in chunks)
                or (greedy is None and bool(sampling)) or not all(_plain_greedy(c, req) for c, req in sampling))

    def score_prompts(self, chunks: RowsOf, logits: torch.Tensor | None) -> None:
        """Prompt logprobs: row p of a chunk scores prompt token p + 1 (raw logprobs, as vLLM's), all
        chunks' rows in one log-softmax on the logits' device."""
        wanted = []                                          # (logit row, prompt position, request)
        for row, c, req in chunks:
            seq = c.seq
            if not seq.wants_prompt_logprobs or c.num_drafts:
                continue
            first = c.end - c.num_logits
            last = min(c.end, len(seq.prompt_ids) - 1)
            wanted += [(row + p - first, p, req) for p in range(max(first, seq.prompt_scored), last)]
            seq.prompt_scored = max(seq.prompt_scored, last)
        if not wanted:
            return
        index = torch.tensor([w[0] for w in wanted]).to(logits.device, non_blocking=True)
        tokens = torch.tensor([req.seq.prompt_ids[p + 1] for _, p, req in wanted]).to(logits.device)
        most = max(req.seq.params.prompt_logprobs for _, _, req in wanted)
        chosen, ids, values = logprobs_of(torch.log_softmax(logits[index].float(), dim=-1), tokens, most)
        for j, (_, p, req) in enumerate(wanted):
            pairs = top_pairs(ids[j], values[j], req.seq.params.prompt_logprobs)
            req.prompt_logprobs.append(SampleResult(req.seq.prompt_ids[p + 1], chosen[j], pairs))

    def sample(self, chunks: RowsOf, logits: torch.Tensor | None, generators: dict[int, object],
               greedy: torch.Tensor | None = None) -> dict[int, StepResult]:
        """Per sampling chunk's sequence id: the tokens it gains, and the verdict when it verified drafts.
        `greedy`: each logit row's argmax where the step made them beside the logits (StepOutput.greedy),
        the tokens of a step of plain greedy rows. `logits` may be None where `reads_logits` says no."""
        if all(_plain_greedy(c, req) for _, c, req in chunks if c.samples):
            return _argmax_results([(row + c.num_logits - 1, c) for row, c, _ in chunks if c.samples], logits, greedy)
        picks = _Picks([], [], [], [], [])
        states = {}                                          # verifying sequence id -> its generator's state
        self._pick_single_rows([(row, c, req) for row, c, req in chunks if c.samples and not c.num_drafts],
                               generators, picks)
        for row, c, req in chunks:
            if c.num_drafts:
                states[c.seq.seq_id] = self._pick_verify_rows(row, c, req, generators[c.seq.seq_id], picks)
        if not picks.rows:
            return {}
        batch = _rows(logits, picks.index)
        if picks.masks:
            self._apply_masks(batch, picks.masks, picks.masked_rows)
        results = sample_rows(batch, picks.rows)
        out = {}
        for first, c, _ in picks.firsts:
            if not c.num_drafts:
                out[c.seq.seq_id] = ([results[first]], None)
                continue
            sampled = [r.token_id for r in results[first:first + len(c.seq.draft_ids) + 1]]
            verdict = Verdict(accepted_prefix(c.seq.draft_ids, sampled))
            _spend(generators[c.seq.seq_id], states[c.seq.seq_id], len(verdict.tokens))
            out[c.seq.seq_id] = (results[first:first + len(verdict.tokens)], verdict)
        return out

    def _pick_single_rows(self, single: RowsOf, generators: dict[int, object], picks: _Picks) -> None:
        """Each sampling chunk's last row, one uniform from its request's stream; one bitmask fill for
        the constrained ones."""
        constrained = []
        for row, c, req in single:
            seq = c.seq
            picks.firsts.append((len(picks.rows), c, req))
            if req.grammar is not None:
                constrained.append((len(picks.rows), req.grammar))
            picks.index.append(row + c.num_logits - 1)
            picks.rows.append(SamplingRow(seq.params, seq.prompt_ids, seq.output_ids,
                                          uniforms(generators[seq.seq_id], 1)[0]))
        if constrained:
            start = time.perf_counter()
            at, matchers = zip(*constrained)
            picks.masks.append(self.grammars.next_token_bitmasks(list(matchers)))
            picks.masked_rows += at
            self.grammar_mask_seconds += time.perf_counter() - start

    def _pick_verify_rows(self, row: int, c: Chunk, req: Request, generator, picks: _Picks):
        """A verifying chunk's K+1 rows, row i with the drafts before it as output and the i-th of K+1
        uniforms peeked from its stream (whose state is returned); its grammar's masks along the drafts."""
        seq, drafts = c.seq, c.seq.draft_ids
        state = generator.get_state() if generator is not None else None
        peeked = uniforms(generator, len(drafts) + 1)
        first = len(picks.rows)
        picks.firsts.append((first, c, req))
        picks.index += range(row, row + len(drafts) + 1)
        picks.rows += [SamplingRow(seq.params, seq.prompt_ids, seq.output_ids + drafts[:i], peeked[i])
                       for i in range(len(drafts) + 1)]
        if req.grammar is not None:
            start = time.perf_counter()
            picks.masks.append(req.grammar.bitmasks_along(drafts, bitmask_words(self.vocab_size)))
            picks.masked_rows += range(first, first + len(drafts) + 1)
            self.grammar_mask_seconds += time.perf_counter() - start
        return state

    def _apply_masks(self, batch: torch.Tensor, masks: list[torch.Tensor], rows: list[int]) -> None:
        """Apply the bitmasks (row i masks batch row rows[i]) in one call; count the rows and the time."""
        start = time.perf_counter()
        bitmask = masks[0] if len(masks) == 1 else torch.cat(masks)
        apply_token_bitmask(batch, bitmask, torch.tensor(rows, dtype=torch.int64))
        self.grammar_rows += len(rows)
        self.grammar_mask_seconds += time.perf_counter() - start


def _plain_greedy(c: Chunk, req: Request) -> bool:
    """A chunk whose one token is its row's argmax and nothing else: no drafts, grammar, logprobs or
    penalties (`sample`'s passes would come to the same argmax)."""
    return not c.num_drafts and req.grammar is None and not needs_row_sampling(c.seq.params)


def _argmax_results(picks: list[tuple[int, Chunk]], logits: torch.Tensor | None,
                    greedy: torch.Tensor | None) -> dict[int, StepResult]:
    """Each (logit row, chunk)'s token: the row's argmax, read from the step's `greedy` picks where it
    made them (`logits` then unread, and None where StepSampler.reads_logits said so), else in one
    call over the rows."""
    if not picks:
        return {}
    rows = [row for row, _ in picks]
    if greedy is None:
        tokens = argmax_rows(_rows(logits, rows)).tolist()
    else:
        every = greedy.tolist()
        tokens = [every[row] for row in rows]
    return {c.seq.seq_id: ([SampleResult(token)], None) for (_, c), token in zip(picks, tokens)}


def _spend(generator: torch.Generator | None, state: torch.Tensor | None, kept: int) -> None:
    """Leave a request's stream as if exactly `kept` uniforms had been drawn since `state`."""
    if generator is not None:
        generator.set_state(state)
        uniforms(generator, kept)


def _rows(logits: torch.Tensor, index: list[int]) -> torch.Tensor:
    """logits[index] as fp32: a view when the rows are consecutive (a decode step: one row per sequence,
    in order), so [batch, vocab] logits are not copied; a gathered copy otherwise."""
    if index == list(range(index[0], index[0] + len(index))):
        rows = logits[index[0]:index[0] + len(index)]
    else:
        rows = logits[torch.tensor(index).to(logits.device, non_blocking=True)]
    return rows.float()
