"""The batched sampler against the per-row reference (runtime/sampler.py), on the CPU.

Claim: for the same seeds, `batch_sampler.sample_rows` picks exactly the reference's tokens (both
draw one float64 uniform per token from the request's generator and invert the same CDF) and
reports its logprobs within fp32 rounding; StepSampler's batched verification keeps exactly what
`speculator.verify_rows` keeps and leaves each generator in the same state. Logprob tolerance: a
log-softmax of fp32 values of magnitude m over V tokens is exact to a few ulps of (m + log V);
four ulps of that bound is the tolerance (on the CPU the two agree bit for bit in practice).
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from llmc.kernels.token_bitmask import apply_token_bitmask_ref
from llmc.runtime import batch_sampler
from llmc.runtime.batch_sampler import (NEG_INF, TOP_P_CANDIDATES, SamplingRow, draw_tokens, filter_logits,
                                        sample_rows, uniforms)
from llmc.runtime.sampler import filter_logits as filter_logits_ref
from llmc.runtime.sampler import make_generator, sample_row
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.scheduler import Chunk
from llmc.runtime.sequence import Sequence
from llmc.runtime.speculative.speculator import verify_rows
from llmc.runtime.step_sampling import StepSampler

VOCAB = 997                     # not a power of two, not a multiple of 32
EPS32 = torch.finfo(torch.float32).eps


def logprob_tolerance(logits: torch.Tensor) -> float:
    finite = logits[torch.isfinite(logits)]
    return 4 * EPS32 * (float(finite.abs().max()) + math.log(logits.shape[-1]))


def random_params(rng: random.Random, vocab: int, **fixed) -> SamplingParams:
    """Every feature drawn at random (off often), then `fixed` on top."""
    pick = rng.choice
    drawn = dict(temperature=pick([0.0, 0.0, 0.3, 0.7, 1.0, 1.5]), top_k=pick([0, 0, 1, 5, 50, vocab - 1, vocab,
                                                                                vocab + 10]),
                 top_p=pick([1.0, 1.0, 0.5, 0.9, 0.99]), min_p=pick([0.0, 0.0, 0.02, 0.2]),
                 repetition_penalty=pick([1.0, 1.0, 1.3, 0.8]), frequency_penalty=pick([0.0, 0.0, 0.5, -0.4]),
                 presence_penalty=pick([0.0, 0.0, 0.7, -1.0]), logprobs=pick([None, None, 0, 1, 2, 3, 4, 5]),
                 seed=rng.randrange(2**40))
    drawn.update(fixed)
    return SamplingParams(**drawn)


def random_logits(rng: random.Random, rows: int, vocab: int, ties: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    logits = torch.randn(rows, vocab, generator=gen) * rng.choice([1.0, 3.0, 8.0])
    return logits.round(decimals=1) if ties else logits        # rounded: many tied values


def grammar_masked(rng: random.Random, logits: torch.Tensor) -> torch.Tensor:
    """Half the rows masked by a random bitmask, as a grammar masks them: about a quarter of the
    tokens allowed, or only 1 to 3 (fewer than the top logprobs asked for)."""
    rows = [i for i in range(logits.shape[0]) if rng.random() < 0.5]
    if not rows:
        return logits
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    words = (logits.shape[1] + 31) // 32
    bitmask = torch.randint(-2**31, 2**31, (len(rows), words), dtype=torch.int32, generator=gen) \
        & torch.randint(-2**31, 2**31, (len(rows), words), dtype=torch.int32, generator=gen)
    for i in range(len(rows)):
        if rng.random() < 0.5:
            bitmask[i] = 0
            for t in rng.sample(range(logits.shape[1]), rng.randint(1, 3)):
                bitmask[i, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
    bitmask[:, 0] |= 1 << rng.randrange(31)      # no row left without a token
    return apply_token_bitmask_ref(logits.clone(), bitmask, torch.tensor(rows))


def random_history(rng: random.Random, vocab: int) -> tuple[list[int], list[int]]:
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
    output = [rng.choice(prompt) if rng.random() < 0.5 else rng.randrange(vocab) for _ in range(rng.randrange(0, 30))]
    return prompt, output


def assert_same_results(got, want, logits: torch.Tensor) -> None:
    tol = logprob_tolerance(logits)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.token_id == w.token_id, f"row {i}: token {g.token_id} != reference {w.token_id}"
        if w.logprob is None:
            assert g.logprob is None and g.top_logprobs == ()
            continue
        assert abs(g.logprob - w.logprob) <= tol, f"row {i}: logprob {g.logprob} != {w.logprob}"
        assert len(g.top_logprobs) == len(w.top_logprobs), f"row {i}: {g.top_logprobs} != {w.top_logprobs}"
        for (gt, gv), (wt, wv) in zip(g.top_logprobs, w.top_logprobs):
            assert abs(gv - wv) <= tol and (gt == wt or gv == wv), f"row {i}: {g.top_logprobs} != {w.top_logprobs}"


def run_steps(rng: random.Random, params: list[SamplingParams], steps: int, ties: bool = False,
              grammar: bool = False) -> None:
    """`steps` steps of both samplers over the same rows, each stream continuing from step to step and
    each row's output growing by the reference's token (its penalties see a growing history)."""
    histories = [random_history(rng, VOCAB) for _ in params]
    ref_gens = [make_generator(p) for p in params]
    gens = [make_generator(p) for p in params]
    for _ in range(steps):
        logits = random_logits(rng, len(params), VOCAB, ties)
        logits = grammar_masked(rng, logits) if grammar else logits
        want = [sample_row(logits[i], p, g, *h) for i, (p, g, h) in enumerate(zip(params, ref_gens, histories))]
        rows = [SamplingRow(p, h[0], h[1], uniforms(g, 1)[0]) for p, g, h in zip(params, gens, histories)]
        before = logits.clone()
        assert_same_results(sample_rows(logits, rows), want, logits)
        assert torch.equal(logits, before)                        # the caller's logits are left alone
        for h, w in zip(histories, want):
            h[1].append(w.token_id)


FEATURES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=1.0, top_k=7),
    "top_k_over_vocab": dict(temperature=1.0, top_k=VOCAB + 5),
    "top_p": dict(temperature=1.0, top_p=0.8),
    "top_p_one": dict(temperature=1.0, top_p=1.0),
    "min_p": dict(temperature=1.0, min_p=0.1),
    "min_p_zero": dict(temperature=1.0, min_p=0.0),
    "repetition": dict(temperature=1.0, repetition_penalty=1.5),
    "frequency": dict(temperature=1.0, frequency_penalty=0.8),
    "presence": dict(temperature=1.0, presence_penalty=-0.9),
    "logprobs_greedy": dict(temperature=0.0, logprobs=5),
    "logprobs_sampled": dict(temperature=1.2, logprobs=3),
}


@pytest.mark.parametrize("feature", FEATURES)
def test_each_feature_alone_matches_the_reference(feature):
    rng = random.Random(feature)
    fixed = FEATURES[feature]
    params = [SamplingParams(**fixed, seed=rng.randrange(2**40)) for _ in range(6)]
    run_steps(rng, params, steps=3)


@pytest.mark.parametrize("case", range(8))
def test_random_mixes_match_the_reference(case):
    """Greedy and sampled rows mixed, every feature at random, ties, grammar masks, logprobs 0..5."""
    rng = random.Random(1000 + case)
    params = [random_params(rng, VOCAB) for _ in range(rng.randrange(1, 24))]
    run_steps(rng, params, steps=3, ties=case % 2 == 1, grammar=case % 4 >= 2)


def test_rows_with_different_top_k_match_the_reference():
    """Top-k alone (no top-p in the batch): one partial sort serves every row's k."""
    rng = random.Random(5)
    params = [SamplingParams(temperature=1.0, top_k=k, seed=rng.randrange(2**40)) for k in (1, 3, 7, 50, 0, VOCAB - 1)]
    run_steps(rng, params, steps=3)


def test_rows_sampled_in_several_cpu_passes_match_the_reference(monkeypatch):
    """A CPU samples rows in passes that fit its cache (3 rows each here): results stay in row order."""
    monkeypatch.setattr(batch_sampler, "CPU_PASS_BYTES", 3 * 8 * VOCAB)
    sampled = [SamplingRow(SamplingParams(temperature=1.0), [1], [], 0.5)] * 10
    assert batch_sampler.rows_per_pass(torch.zeros(10, VOCAB), sampled) == 3
    rng = random.Random(77)
    run_steps(rng, [random_params(rng, VOCAB) for _ in range(11)], steps=3, grammar=True)


@pytest.mark.parametrize("n", range(6))
def test_logprobs_of_every_count_match_the_reference(n):
    rng = random.Random(n)
    params = [random_params(rng, VOCAB, logprobs=n) for _ in range(5)]
    run_steps(rng, params, steps=2, grammar=True)


def test_a_row_count_mismatch_is_refused():
    with pytest.raises(ValueError, match="2 logit rows were given for 1 sampling rows"):
        sample_rows(torch.zeros(2, 8), [SamplingRow(SamplingParams(temperature=0.0), [1], [])])


# ------------------------------------------------------------------------------ verification


def verify_case(rng: random.Random, params: SamplingParams, k: int):
    """A verifying chunk of K drafts whose rows favour a random number of leading drafts."""
    prompt, output = random_history(rng, VOCAB)
    seq = Sequence(rng.randrange(2**20), prompt, params, output_ids=list(output))
    seq.draft_ids = [rng.randrange(VOCAB) for _ in range(k)]
    rows = random_logits(rng, k + 1, VOCAB, ties=False)
    for i in range(rng.randrange(k + 1)):
        rows[i, seq.draft_ids[i]] += rng.choice([6.0, 40.0])
    return seq, rows


def test_batched_verification_keeps_what_verify_rows_keeps():
    """Several verifying sequences and single-row sequences in one step: verdicts, kept results and
    each generator's state afterwards equal the per-sequence reference's."""
    rng, accepted, rejected = random.Random(7), 0, 0
    for trial in range(10):
        specs = [(random_params(rng, VOCAB), rng.randrange(0, 5)) for _ in range(rng.randrange(1, 6))]
        cases = [verify_case(rng, p, k) for p, k in specs]
        chunks, blocks, row = [], [], 0
        for seq, rows in cases:
            seq.num_computed = seq.num_tokens - 1
            chunks.append((row, Chunk(seq, seq.num_tokens - 1, seq.num_tokens + len(seq.draft_ids),
                                      num_logits=len(seq.draft_ids) + 1), SimpleNamespace(seq=seq, grammar=None)))
            blocks.append(rows)
            row += rows.shape[0]
        logits = torch.cat(blocks)
        gens = {seq.seq_id: make_generator(seq.params) for seq, _ in cases}
        ref_gens = {seq.seq_id: make_generator(seq.params) for seq, _ in cases}
        got = StepSampler(None, VOCAB).sample(chunks, logits.clone(), gens)
        for seq, rows in cases:
            verdict, kept = verify_rows(rows, seq, ref_gens[seq.seq_id])
            got_kept, got_verdict = got[seq.seq_id]
            label = f"trial {trial}, K={len(seq.draft_ids)}, {seq.params}"
            assert (got_verdict.tokens if got_verdict else (got_kept[0].token_id,)) == verdict.tokens, label
            assert_same_results(got_kept, kept, rows)
            accepted += verdict.num_accepted
            rejected += verdict.num_accepted < len(seq.draft_ids)
            if gens[seq.seq_id] is not None:
                assert torch.equal(gens[seq.seq_id].get_state(), ref_gens[seq.seq_id].get_state()), label
    assert accepted > 5 and rejected > 5, (accepted, rejected)        # both outcomes were checked


def test_a_uniform_past_the_rounded_total_takes_the_last_token_with_probability():
    """u above the float64 sum of the fp32 probabilities (rounding) lands past the end: the draw walks
    back to the last token with probability, as `sampler.draw_token` does, not onto a masked token."""
    u = torch.tensor([0.25, 1.0 - 2**-53, 1.0 - 2**-53], dtype=torch.float64)
    for seed in range(1, 100):          # softmax's rounding differs with the CPU's vector width: find rows
        logits = torch.full((3, VOCAB), NEG_INF)
        logits[:, :500] = torch.randn(3, 500, generator=torch.Generator().manual_seed(seed))
        logits[1, 700] = 0.5                              # row 1's last kept token is 700, row 2's 499
        total = torch.softmax(logits, dim=-1).double().sum(dim=-1)
        if bool((total[1:] < u[1:]).all()):               # both rounded totals below u
            break
    else:
        pytest.fail(f"no seed below 100 gave rows whose rounded totals fall below u (last: {total.tolist()})")
    tokens = draw_tokens(logits, u).tolist()
    assert tokens[1:] == [700, 499] and 0 <= tokens[0] < 500


@pytest.mark.gpu
def test_on_a_gpu_the_tokens_are_the_cpu_references_up_to_float_sums():
    """The same rows and uniforms on a GPU: greedy rows pick the same tokens; a sampled row may differ
    only where the GPU's differently ordered sums move a CDF or top-p / min-p boundary across u,
    which a random u meets in a small share of rows (allowed: 1%); logprobs agree within fp32 rounding."""
    rng = random.Random(11)
    params = [random_params(rng, 32000) for _ in range(256)]
    histories = [random_history(rng, 32000) for _ in params]
    logits = random_logits(rng, len(params), 32000, ties=False)
    rows = [SamplingRow(p, *h, uniforms(make_generator(p), 1)[0]) for p, h in zip(params, histories)]
    want, got = sample_rows(logits, rows), sample_rows(logits.cuda(), rows)
    same = [g.token_id == w.token_id for g, w in zip(got, want)]
    assert all(s for s, p in zip(same, params) if p.greedy)
    assert sum(same) >= 0.99 * len(same), f"{len(same) - sum(same)} of {len(same)} tokens differ"
    tol = 4 * logprob_tolerance(logits)
    for g, w, s in zip(got, want, same):
        if s and w.logprob is not None:
            assert abs(g.logprob - w.logprob) <= tol


TOP_P_VOCAB = 5003              # more tokens than TOP_P_CANDIDATES: the partial sort can stop short of a row


@pytest.mark.parametrize("shape", ["peaked", "medium", "flat", "tied"])
def test_top_p_cuts_each_row_where_the_reference_does_from_a_partial_or_a_full_sort(shape, monkeypatch):
    """The batched top-p's kept tokens equal the per-row reference's exactly: from partial sorts of
    the most likely tokens where they reach p (peaked rows within the first 64; medium ones need up to
    1024: a full sort would fail the test), from a full sort of the rows whose nucleus is wider (flat),
    and with tied probabilities."""
    gen = torch.Generator().manual_seed(7)
    scale = {"peaked": 8.0, "medium": 4.0, "flat": 0.05, "tied": 3.0}[shape]
    logits = torch.randn(12, TOP_P_VOCAB, generator=gen) * scale
    logits = logits.round(decimals=0) if shape == "tied" else logits
    params = [SamplingParams(temperature=1.0, top_p=p, top_k=k) for p in (0.3, 0.9, 0.99) for k in (0, 0, 0, 50)]
    want = torch.stack([filter_logits_ref(logits[i], p) for i, p in enumerate(params)])
    if shape in ("peaked", "medium"):
        monkeypatch.setattr(torch, "sort", lambda *a, **k: pytest.fail(f"a {shape} batch took a full sort"))
    got = filter_logits(logits, [SamplingRow(p, [], [], 0.5) for p in params])
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    kept = (~torch.isinf(want)).sum(dim=-1)
    assert shape != "medium" or kept.max() > min(TOP_P_CANDIDATES)        # the wider partial sort was needed
    assert shape != "flat" or kept.max() > max(TOP_P_CANDIDATES)          # the full sort was needed
