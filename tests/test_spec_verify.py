"""Speculative verification on toy distributions: greedy, rejection sampling, one-hot drafts.

Statistical claims use Pearson's chi-square at a fixed seed: the test fails when the p-value of
the observed counts against the target distribution is below ALPHA (1e-3), i.e. a correct sampler
fails a given seed with probability 1e-3; the seeds are fixed, so the outcome is deterministic.
"""

from __future__ import annotations

import random

import pytest
import torch

from llmc.runtime.sampler import apply_penalties, filter_logits, make_generator, sample_row
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.speculative.verify import Verdict, verify_greedy, verify_sampled

ALPHA = 1e-3
N = 20000

# Target rows p_0..p_2 and draft rows q_0, q_1 over six tokens (K = 2). Token 5 is masked in p_0
# (top-k / top-p would do that) but likely under q_0; token 3 has target mass that q_0 never drafts.
P = [[0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
     [0.05, 0.45, 0.10, 0.10, 0.20, 0.10],
     [0.20, 0.20, 0.20, 0.20, 0.10, 0.10]]
Q = [[0.05, 0.10, 0.40, 0.00, 0.20, 0.25],
     [0.30, 0.20, 0.10, 0.20, 0.10, 0.10]]


def logits_of(probs: list[list[float]]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()          # masked tokens: -inf


def chi_square_p_value(counts: list[int], probs: list[float]) -> float:
    """Pearson's statistic over the tokens with mass; the p-value from the chi-square survival
    function Q(df/2, x/2) (regularised upper incomplete gamma). Mass on a masked token is 0."""
    total = sum(counts)
    assert all(c == 0 for c, p in zip(counts, probs) if p == 0), f"a masked token was emitted: {counts}"
    kept = [(c, p * total) for c, p in zip(counts, probs) if p > 0]
    statistic = sum((c - e) ** 2 / e for c, e in kept)
    df = torch.tensor((len(kept) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, torch.tensor(statistic / 2, dtype=torch.float64)))


def run_rejection_sampling(p: list[list[float]], q: list[list[float]], trials: int) -> list[Verdict]:
    """Draft each trial's tokens from q (a separate stream), verify them against p."""
    drafter, generator = random.Random(1), torch.Generator().manual_seed(0)
    target, draft = logits_of(p), logits_of(q)
    verdicts = []
    for _ in range(trials):
        drafts = [drafter.choices(range(len(row)), weights=row)[0] for row in q]
        verdicts.append(verify_sampled(target, drafts, generator, draft))
    return verdicts


def counts_at(verdicts: list[Verdict], position: int, vocab: int = 6) -> list[int]:
    counts = [0] * vocab
    for v in verdicts:
        if len(v.tokens) > position:
            counts[v.tokens[position]] += 1
    return counts


@pytest.fixture(scope="module")
def verdicts() -> list[Verdict]:
    return run_rejection_sampling(P, Q, N)


def test_first_token_is_distributed_as_the_target(verdicts):
    assert chi_square_p_value(counts_at(verdicts, 0), P[0]) > ALPHA


def test_token_after_an_accepted_draft_is_distributed_as_the_target(verdicts):
    counts = counts_at(verdicts, 1)
    assert sum(counts) > N // 3                  # sum(min(p_0, q_0)) = 0.45 of trials get here
    assert chi_square_p_value(counts, P[1]) > ALPHA


def test_bonus_token_is_distributed_as_the_last_target_row(verdicts):
    counts = counts_at(verdicts, 2)
    assert sum(counts) > N // 5                  # 0.45 * sum(min(p_1, q_1)) = 0.29
    assert chi_square_p_value(counts, P[2]) > ALPHA


def test_acceptance_rate_is_the_overlap_of_p_and_q(verdicts):
    accepted_first = sum(v.num_accepted >= 1 for v in verdicts) / N
    overlap = sum(min(a, b) for a, b in zip(P[0], Q[0]))
    assert abs(accepted_first - overlap) < 4 * (overlap * (1 - overlap) / N) ** 0.5


def test_draft_equal_to_target_is_always_accepted():
    for v in run_rejection_sampling(P, P[:2], 2000):
        assert v.num_accepted == 2 and len(v.tokens) == 3


@pytest.mark.parametrize("first_wrong", [0, 1, 3, 4])
def test_one_hot_drafts_give_exactly_the_non_speculative_seeded_tokens(first_wrong):
    """Drafts right up to `first_wrong` (4 = all right): the same tokens, the same generator state."""
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=1234)
    rows = torch.randn(5, 50, generator=torch.Generator().manual_seed(5)) * 3     # [K+1, V], K = 4
    reference = make_generator(params)
    plain = [sample_row(rows[i], params, reference, [], []).token_id for i in range(first_wrong + 1)]
    drafts = [(t + 1) % 50 if i == first_wrong else t for i, t in enumerate((plain + [0] * 4)[:4])]
    filtered = torch.stack([filter_logits(apply_penalties(r.clone(), params, [], []), params) for r in rows])
    generator = make_generator(params)
    verdict = verify_sampled(filtered, drafts, generator)
    assert verdict.tokens == tuple(plain)
    assert verdict.num_accepted == first_wrong
    assert torch.equal(generator.get_state(), reference.get_state())


def greedy_rows(best: list[int], vocab: int = 10) -> torch.Tensor:
    rows = torch.randn(len(best), vocab, generator=torch.Generator().manual_seed(3))
    for i, token in enumerate(best):
        rows[i, token] = 10.0
    return rows


def test_greedy_accepts_every_matching_draft_and_adds_the_bonus():
    verdict = verify_greedy(greedy_rows([4, 7, 1, 9]), [4, 7, 1])
    assert verdict.tokens == (4, 7, 1, 9) and verdict.num_accepted == 3


def test_greedy_first_draft_rejected_gives_the_correction():
    verdict = verify_greedy(greedy_rows([4, 7, 1, 9]), [5, 7, 1])
    assert verdict.tokens == (4,) and verdict.num_accepted == 0


def test_greedy_stops_at_the_first_mismatch():
    assert verify_greedy(greedy_rows([4, 7, 1, 9]), [4, 7, 2]).tokens == (4, 7, 1)
    assert verify_greedy(greedy_rows([4, 7, 1, 9]), [4, 3, 1]).tokens == (4, 7)


def test_no_drafts_is_one_ordinary_token():
    assert verify_greedy(greedy_rows([6]), []).tokens == (6,)
    params = SamplingParams(seed=9)
    rows = torch.randn(1, 10, generator=torch.Generator().manual_seed(2))
    expected = sample_row(rows[0], params, make_generator(params), [], []).token_id
    verdict = verify_sampled(filter_logits(rows[0], params)[None], [], make_generator(params))
    assert verdict.tokens == (expected,)


def test_rows_that_do_not_fit_the_drafts_are_refused():
    with pytest.raises(ValueError, match="K\\+1 = 3 rows"):
        verify_greedy(torch.zeros(2, 10), [1, 2])
    with pytest.raises(ValueError, match="not all in the vocabulary of 10"):
        verify_greedy(torch.zeros(3, 10), [1, 12])
    with pytest.raises(ValueError, match="not \\[K, V\\] = \\[2, 10\\]"):
        verify_sampled(torch.zeros(3, 10), [1, 2], torch.Generator(), torch.zeros(3, 10))
