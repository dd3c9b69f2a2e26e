"""The engine's batched StepSampler against a per-row host reference, through whole engine runs.

The reference (`HostStepSampler`) is how the engine sampled before sampling moved to the logits'
device: each row copied to the host, its grammar mask applied, then `sampler.sample_row` per
sampled row, `speculator.verify_rows` per verifying sequence and `sampler.token_logprobs` per
prompt position. Seeded requests of every sampling mode (penalties, logprobs, prompt logprobs,
grammars), with and without speculation, must give the same tokens and the same logprobs
(the CPU's per-row and batched kernels agree bit for bit, so equality is the claim).
"""

from __future__ import annotations

import pytest
import torch

from llmc.kernels.token_bitmask import apply_token_bitmask
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.grammar import GrammarSpec, bitmask_words
from llmc.runtime.sampler import SampleResult, sample_row, token_logprobs
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.speculative.speculator import SpeculativeConfig, verify_rows
from llmc.runtime.step_sampling import StepSampler

from test_engine_runtime import prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MIXES = [dict(temperature=0.8), dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, top_k=20, min_p=0.05),
         dict(temperature=1.2, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4, logprobs=3),
         dict(temperature=0.0, logprobs=5, prompt_logprobs=2), dict(temperature=0.9, top_p=0.8, top_k=40, logprobs=0),
         dict(temperature=1.0, grammar=GrammarSpec("regex", "[a-f0-9 ]{4,30}")), dict(temperature=0.0,
                                                                                    repetition_penalty=1.5)]


class HostStepSampler(StepSampler):
    """The per-row reference: host logits, one row at a time."""

    def score_prompts(self, chunks, logits):
        for row, c, req in chunks:
            seq = c.seq
            if not seq.wants_prompt_logprobs or c.num_drafts:
                continue
            first, last = c.end - c.num_logits, min(c.end, len(seq.prompt_ids) - 1)
            rows = torch.log_softmax(logits[row:row + last - first].cpu(), dim=-1)
            for p in range(max(first, seq.prompt_scored), last):
                token = seq.prompt_ids[p + 1]
                req.prompt_logprobs.append(SampleResult(token, *token_logprobs(rows[p - first], token,
                                                                                 seq.params.prompt_logprobs)))
            seq.prompt_scored = max(seq.prompt_scored, last)

    def sample(self, chunks, logits, generators, greedy=None):    # greedy: the step's picks, never read here
        results, words = {}, bitmask_words(self.vocab_size)
        for row, c, req in chunks:
            seq, gen = c.seq, generators[c.seq.seq_id]
            if c.num_drafts:
                rows = logits[row:row + c.num_logits].cpu().clone()
                if req.grammar is not None:
                    apply_token_bitmask(rows, req.grammar.bitmasks_along(seq.draft_ids, words),
                                        torch.arange(rows.shape[0]))
                results[seq.seq_id] = verify_rows(rows, seq, gen)[::-1]
            elif c.samples:
                rows = logits[row + c.num_logits - 1:row + c.num_logits].cpu().clone()
                if req.grammar is not None:
                    apply_token_bitmask(rows, self.grammars.next_token_bitmasks([req.grammar]), torch.tensor([0]))
                results[seq.seq_id] = ([sample_row(rows[0], seq.params, gen, seq.prompt_ids, seq.output_ids)], None)
        return results


GREEDY = [dict(temperature=0.0), dict(temperature=0.0, prompt_logprobs=2)]   # a step of argmaxes only


def run(artifact, speculative: bool, reference: bool, mixes: list[dict] = MIXES) -> list[tuple[list[int], list, list]]:
    """Each request's tokens, logprobs and prompt logprobs from an engine stepped to the end."""
    # the target as its own draft model: its greedy drafts are often the rows' samples, so drafts are kept
    spec = SpeculativeConfig(f"draft:{artifact}", 3, adaptive=False) if speculative else None
    engine = Engine(artifact, EngineConfig(speculative=spec))
    if reference:
        engine.sampler = HostStepSampler(engine.grammars, engine.artifact.config.vocab_size)
    ps = prompts(16, seed=3)
    ids = [engine.add_request(p, SamplingParams(max_tokens=24, seed=100 + i, **mixes[i % len(mixes)]))
           for i, p in enumerate(ps)]
    got = {i: ([], [], []) for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(out.logprobs)
            got[out.request_id][2].extend(out.prompt_logprobs or [])
    assert not speculative or engine.speculator.stats.accepted > 10, "too few drafts were accepted to test with"
    return [got[i] for i in ids]


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_the_engine_samples_as_the_per_row_host_reference(tiny_family, speculative):
    artifact = tiny_family("llama_gqa")[2]
    batched, host = run(artifact, speculative, False), run(artifact, speculative, True)
    assert [b[0] for b in batched] == [h[0] for h in host]
    assert [b[1:] for b in batched] == [h[1:] for h in host]
    assert sum(len(b[1]) for b in batched) > 20 and sum(len(b[2]) for b in batched) > 10     # logprobs were asked


def test_a_step_of_plain_greedy_rows_takes_each_chunks_last_row(tiny_family):
    """Plain greedy rows skip the sampling passes (one argmax over the rows): a chunk scoring its
    prompt has a logit row per prompt position, and its token is still its last row's argmax."""
    artifact = tiny_family("llama_gqa")[2]
    batched, host = run(artifact, False, False, GREEDY), run(artifact, False, True, GREEDY)
    assert batched == host and sum(len(b[2]) for b in batched) > 10
