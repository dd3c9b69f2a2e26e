"""The sampler on a fixed logits vector: distributions, filters, penalties, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from llmc.runtime.sampler import filter_logits, make_generator, sample, sample_row
from llmc.runtime.sampling_params import RequestError, SamplingParams

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
DRAWS = 20_000


def empirical(params: SamplingParams, logits: torch.Tensor = LOGITS) -> torch.Tensor:
    gen = make_generator(params)
    counts = torch.zeros(logits.numel())
    for _ in range(DRAWS):
        counts[sample_row(logits, params, gen, [], []).token_id] += 1
    return counts / DRAWS


def assert_matches(freq: torch.Tensor, probs: torch.Tensor) -> None:
    """Every frequency within 5 standard errors of its probability (a binomial bound)."""
    sigma = torch.sqrt(probs * (1 - probs) / DRAWS).clamp_min(1e-4)
    assert torch.all((freq - probs).abs() <= 5 * sigma), (freq, probs)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_draws_follow_softmax(temperature):
    freq = empirical(SamplingParams(temperature=temperature, seed=1))
    assert_matches(freq, torch.softmax(LOGITS / temperature, dim=-1))


def test_top_k_keeps_the_k_most_likely_renormalised():
    freq = empirical(SamplingParams(temperature=1.0, top_k=3, seed=2))
    probs = torch.zeros_like(LOGITS)
    probs[:3] = torch.softmax(LOGITS[:3], dim=-1)
    assert_matches(freq, probs)


def test_top_p_keeps_the_smallest_set_reaching_p():
    p = torch.softmax(LOGITS, dim=-1)
    keep = int((torch.cumsum(p, 0) < 0.8).sum()) + 1          # first prefix whose mass reaches 0.8
    freq = empirical(SamplingParams(temperature=1.0, top_p=0.8, seed=3))
    probs = torch.zeros_like(LOGITS)
    probs[:keep] = p[:keep] / p[:keep].sum()
    assert_matches(freq, probs)
    assert freq[keep:].sum() == 0


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    p = torch.softmax(LOGITS, dim=-1)
    kept = p >= 0.2 * p.max()
    freq = empirical(SamplingParams(temperature=1.0, min_p=0.2, seed=4))
    assert_matches(freq, torch.where(kept, p, 0) / p[kept].sum())


def test_filters_compose_in_order():
    out = filter_logits(LOGITS.clone(), SamplingParams(temperature=0.5, top_k=4, top_p=0.9))
    assert torch.isinf(out[4:]).all() and torch.isfinite(out[:2]).all()


def test_greedy_is_argmax_and_needs_no_generator():
    assert make_generator(SamplingParams(temperature=0.0)) is None
    assert sample_row(LOGITS, SamplingParams(temperature=0.0), None, [], []).token_id == 0


def test_repetition_penalty_discourages_seen_tokens():
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    # token 0 (logit 2.0) is in the prompt: 2.0 / 2 = 1.0 < 1.5, so token 1 wins
    assert sample_row(LOGITS, params, None, [0], []).token_id == 1
    # a negative logit is multiplied, pushing it further down
    logits = torch.tensor([-0.1, -0.15])
    assert sample_row(logits, params, None, [0], []).token_id == 1


def test_frequency_and_presence_penalties_count_output_tokens():
    freq = SamplingParams(temperature=0.0, frequency_penalty=0.3)
    assert sample_row(LOGITS, freq, None, [], [0]).token_id == 0       # 2.0 - 0.3 > 1.5
    assert sample_row(LOGITS, freq, None, [], [0, 0]).token_id == 1    # 2.0 - 0.6 < 1.5
    presence = SamplingParams(temperature=0.0, presence_penalty=0.6)
    assert sample_row(LOGITS, presence, None, [], [0]).token_id == 1
    assert sample_row(LOGITS, presence, None, [0], []).token_id == 0   # prompt tokens do not count


def test_same_seed_same_tokens_regardless_of_batch():
    params = SamplingParams(temperature=1.0, seed=7)
    alone_gen = make_generator(params)
    alone = [sample(LOGITS[None], [params], [alone_gen], [([], [])])[0].token_id for _ in range(50)]
    other = SamplingParams(temperature=1.5, seed=99)
    gens = [make_generator(other), make_generator(params)]
    batched = [sample(torch.stack([LOGITS.flip(0), LOGITS]), [other, params], gens, [([], []), ([], [])])[1].token_id
               for _ in range(50)]
    assert alone == batched
    different = make_generator(SamplingParams(temperature=1.0, seed=8))
    assert alone != [sample_row(LOGITS, params, different, [], []).token_id for _ in range(50)]


def test_logprobs_of_chosen_and_top_n():
    result = sample_row(LOGITS, SamplingParams(temperature=0.0, logprobs=3), None, [], [])
    reference = torch.log_softmax(LOGITS, dim=-1)
    assert result.logprob == pytest.approx(float(reference[0]))
    assert [t for t, _ in result.top_logprobs] == [0, 1, 2]
    assert [lp for _, lp in result.top_logprobs] == pytest.approx(reference[:3].tolist())
    assert math.isclose(sum(math.exp(lp) for lp in reference.tolist()), 1.0, rel_tol=1e-6)


@pytest.mark.parametrize("bad, word", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.1), "temperature"), (dict(top_k=-1), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(min_p=1.5), "min_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(frequency_penalty=3.0), "frequency_penalty"), (dict(presence_penalty=-3.0), "presence_penalty"),
    (dict(logprobs=50), "logprobs"), (dict(stop=("",)), "stop"),
])
def test_invalid_parameters_name_themselves(bad, word):
    with pytest.raises(RequestError, match=word):
        SamplingParams(**bad)
