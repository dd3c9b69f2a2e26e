"""Adaptive K on plain numbers: acceptance estimate, step cost model, the policy and its probe."""

from __future__ import annotations

import pytest

from llmc.runtime.speculative.adaptive import (AcceptanceEstimate, AdaptiveK, StepCostModel,
                                               choose_num_draft_tokens, expected_tokens)

MAX_K = 8


def measured(cost_of) -> StepCostModel:
    """A cost model that has measured `cost_of(tokens)` at 1, 2, 4, ..., 4096 tokens."""
    model = StepCostModel()
    for shift in range(13):
        model.record(1 << shift, cost_of(1 << shift))
    return model


def roofline(tokens: int) -> float:
    """Memory-bound up to 64 tokens (20 ms), compute-bound beyond; plus 0.3 ms of per-token work
    (attention, sampling) everywhere."""
    return 0.02 * max(1.0, tokens / 64) + 0.0003 * tokens


def linear(tokens: int) -> float:
    return 0.0003 * tokens


def k_for(batch: int, acceptance: float, cost: StepCostModel, **kw) -> int:
    return choose_num_draft_tokens(batch, [acceptance] * MAX_K, cost, MAX_K, **kw)


def test_expected_tokens_is_one_plus_the_sum_of_survival_products():
    assert expected_tokens([0.8, 0.5, 0.9], 0) == 1.0
    assert expected_tokens([0.8, 0.5, 0.9], 2) == pytest.approx(1 + 0.8 + 0.4)
    assert expected_tokens([0.8, 0.5, 0.9], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.36)
    assert expected_tokens([1.0] * 4, 4) == 5.0


def test_acceptance_updates_positions_up_to_the_first_rejection_only():
    est = AcceptanceEstimate(4, prior=0.5, decay=0.5)
    est.observe(num_drafted=3, num_accepted=1)          # draft 1 accepted, draft 2 rejected
    assert est.rates == [0.75, 0.25, 0.5, 0.5]
    est.observe(num_drafted=2, num_accepted=2)          # both accepted; position 3 not drafted
    assert est.rates == [0.875, 0.625, 0.5, 0.5]
    est.observe(num_drafted=0, num_accepted=0)
    assert est.rates == [0.875, 0.625, 0.5, 0.5]


def test_cost_model_prior_then_measured_points_with_interpolation():
    model = StepCostModel(fixed_s=0.01, per_token_s=0.001)
    assert model.seconds(10) == pytest.approx(0.02)                    # prior
    model.record(8, 0.05)
    assert model.seconds(8) == pytest.approx(0.05)
    assert model.seconds(18) == pytest.approx(0.06)                    # prior's slope from the point
    model.record(32, 0.11)
    assert model.seconds(20) == pytest.approx(0.08)                    # interpolated
    assert model.seconds(64) == pytest.approx(0.19)                    # extrapolated with that slope
    model.record(8, 0.10)                                              # same bucket: moving average
    assert model.seconds(8) == pytest.approx(0.8 * 0.05 + 0.2 * 0.10)


def test_cost_model_never_extrapolates_a_falling_cost():
    model = StepCostModel()
    model.record(4, 0.03)
    model.record(64, 0.02)                                             # noise: cheaper with more
    assert model.seconds(1000) == pytest.approx(0.03)                  # read through the running maximum
    assert model.seconds(34) == pytest.approx(0.03)


def test_cost_model_never_makes_more_tokens_cheaper():
    """Noise that measured a wider step faster than a narrow one must not make drafts look free
    (SmolLM2 once measured 1 token 25.0 ms, 2 tokens 24.0 ms, 5 tokens 21.85 ms)."""
    model = StepCostModel()
    for tokens, seconds in ((1, 0.0250), (2, 0.0240), (5, 0.02185)):
        model.record(tokens, seconds)
    costs = [model.seconds(n) for n in range(1, 12)]
    assert costs == sorted(costs) and costs[0] == pytest.approx(0.0250)


def test_high_acceptance_at_small_batch_speculates():
    cost = measured(roofline)
    assert k_for(1, 0.9, cost) > 0
    assert k_for(1, 0.9, StepCostModel()) > 0                          # on the prior alone
    assert k_for(4, 0.8, cost) > 0


def test_low_acceptance_does_not_speculate():
    assert k_for(1, 0.0, measured(roofline)) == 0
    assert k_for(1, 0.01, measured(roofline)) == 0


def test_linear_step_cost_never_speculates():
    cost = measured(linear)
    for batch in (1, 8, 64):
        for acceptance in (0.5, 0.9, 0.99, 1.0):
            assert k_for(batch, acceptance, cost) == 0


def test_a_batch_past_the_compute_knee_does_not_speculate():
    cost = measured(roofline)
    assert k_for(64, 0.95, cost) == 0
    assert k_for(256, 0.95, cost) == 0


def test_k_grows_with_acceptance():
    cost = measured(roofline)
    for batch in (1, 4, 16, 32):
        ks = [k_for(batch, a / 20, cost) for a in range(21)]
        assert ks == sorted(ks), (batch, ks)
    assert k_for(1, 0.3, cost) < k_for(1, 0.95, cost)


def test_k_shrinks_with_batch_size():
    cost = measured(roofline)
    for acceptance in (0.5, 0.8, 0.95):
        ks = [k_for(batch, acceptance, cost) for batch in range(1, 129)]
        assert ks == sorted(ks, reverse=True), (acceptance, ks)
        assert ks[0] > 0 and ks[-1] == 0


def test_draft_cost_counts_against_speculation():
    cost = measured(roofline)
    cheap, dear = StepCostModel(fixed_s=0.001, per_token_s=0), StepCostModel(fixed_s=0.05, per_token_s=0)
    assert k_for(1, 0.8, cost, draft_cost=cheap) > 0
    assert k_for(1, 0.8, cost, draft_cost=dear) == 0
    assert k_for(1, 0.8, cost, draft_cost=cheap) <= k_for(1, 0.8, cost)


def test_min_gain_demands_a_margin():
    cost = measured(roofline)
    assert k_for(1, 0.3, cost) > 0
    assert k_for(1, 0.3, cost, min_gain=2.0) == 0


def test_adaptive_k_probes_after_a_run_of_zeros_only_where_speculation_could_pay():
    policy = AdaptiveK(4, AcceptanceEstimate(4, prior=0.0), measured(roofline), probe_interval=8)
    assert [policy.choose(1) for _ in range(16)] == [0] * 7 + [1] + [0] * 7 + [1]
    assert [policy.choose(128) for _ in range(40)] == [0] * 40        # past the knee: no probe
    for _ in range(100):
        policy.observe(num_drafted=1, num_accepted=1)                  # the probes keep succeeding
        policy.observe(num_drafted=4, num_accepted=4)
    assert policy.choose(1) == 4


def test_adaptive_k_learns_cost_from_recorded_steps():
    policy = AdaptiveK(4, AcceptanceEstimate(4, prior=0.9))
    assert policy.choose(8) > 0                                        # prior: flat up to 64 tokens
    for tokens in (1, 2, 4, 8, 16, 32, 64, 128):
        for _ in range(20):
            policy.record_step(tokens, linear(tokens))
    assert policy.choose(8) == 0


def test_bad_settings_are_one_sentence():
    with pytest.raises(ValueError, match="max_k >= 1"):
        AdaptiveK(0)
    with pytest.raises(ValueError, match="prior in \\[0, 1\\]"):
        AcceptanceEstimate(4, prior=1.5)
    with pytest.raises(ValueError, match="fixed_s=-1"):
        StepCostModel(fixed_s=-1)


def test_adaptive_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, llmc.runtime.speculative.adaptive; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
