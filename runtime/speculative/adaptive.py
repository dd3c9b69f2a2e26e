"""Adaptive K: how many tokens to draft in a step, from measured acceptance and measured step cost.

Speculation pays while verifying K drafts costs little more than decoding one token: decode is
memory-bound at small batch, so a step's time is nearly flat in its token count there; at large
batch it is compute-bound and grows about linearly, and K drafts per sequence multiply the work by
K+1 for fewer than K+1 tokens gained. The policy maximises expected tokens per second:

    rate(K) = B * E[tokens | K] / (step_seconds(B * (K+1)) + K * draft_seconds(B))
    E[tokens | K] = 1 + sum_{i=1..K} prod_{j<=i} a_j

with a_j the conditional acceptance of the j-th draft given the earlier ones were accepted, and
returns 0 unless some K > 0 beats rate(0) = B / step_seconds(B) (by a factor `min_gain`).

Pure Python, no torch: the engine records what it measures (`AdaptiveK.observe`,
`AdaptiveK.record_step`) and asks for K once per step (`AdaptiveK.choose`). All state lives in the
objects (one per engine), none in the module.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

_TINY_S = 1e-9          # floor of an estimate, so rates stay finite


class AcceptanceEstimate:
    """Running estimate a_1..a_max_k of per-position acceptance: a_i = P(draft i accepted | drafts
    before it accepted), an exponential moving average over verified sequences, seeded at `prior`."""

    def __init__(self, max_k: int, prior: float = 0.7, decay: float = 0.95):
        if max_k < 1 or not 0.0 <= prior <= 1.0 or not 0.0 <= decay < 1.0:
            raise ValueError(f"acceptance estimate needs max_k >= 1 (got {max_k}), prior in [0, 1] "
                             f"(got {prior}) and decay in [0, 1) (got {decay})")
        self.rates = [prior] * max_k
        self.decay = decay

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """One sequence's verification: drafts 1..num_accepted accepted, the next (if drafted)
        rejected. Positions after the first rejection were never tested and are left alone."""
        assert 0 <= num_accepted <= num_drafted <= len(self.rates), (num_drafted, num_accepted)
        for i in range(min(num_accepted + 1, num_drafted)):
            accepted = 1.0 if i < num_accepted else 0.0
            self.rates[i] = self.decay * self.rates[i] + (1.0 - self.decay) * accepted


def expected_tokens(rates: Sequence[float], k: int) -> float:
    """Expected tokens a sequence emits in a step with k drafts (accepted drafts plus the target's
    own token): 1 + sum_{i=1..k} prod_{j<=i} a_j, for per-position acceptance `rates` (a_1 first)."""
    total, survive = 1.0, 1.0
    for rate in rates[:k]:
        survive *= rate
        total += survive
    return total


class StepCostModel:
    """Seconds one model step takes for a number of tokens: measured, interpolated, with a prior.

    The table holds one point per power-of-two bucket of token counts: the moving average of the
    token counts and of the seconds recorded in that bucket. Between points: linear interpolation;
    beyond them: the slope of the two nearest points (the prior's slope with only one point, never
    below 0). Before anything is recorded: the prior, `fixed_s + per_token_s * tokens` (a flat,
    memory-bound step that grows once the tokens' compute matters).
    """

    def __init__(self, fixed_s: float = 0.02, per_token_s: float = 0.02 / 64, decay: float = 0.8):
        if fixed_s < 0 or per_token_s < 0 or fixed_s + per_token_s <= 0 or not 0.0 <= decay < 1.0:
            raise ValueError(f"step cost prior fixed_s={fixed_s}, per_token_s={per_token_s} must be "
                             f"non-negative and not both 0, decay={decay} in [0, 1)")
        self.fixed_s, self.per_token_s, self.decay = fixed_s, per_token_s, decay
        self._points: dict[int, tuple[float, float]] = {}     # bucket -> (mean tokens, mean seconds)

    def record(self, num_tokens: int, seconds: float) -> None:
        """Enter one measured step of `num_tokens` tokens that took `seconds`."""
        assert num_tokens >= 1 and seconds >= 0, (num_tokens, seconds)
        bucket = num_tokens.bit_length()
        if bucket not in self._points:
            self._points[bucket] = (float(num_tokens), seconds)
            return
        tokens, secs = self._points[bucket]
        keep = self.decay
        self._points[bucket] = (keep * tokens + (1 - keep) * num_tokens, keep * secs + (1 - keep) * seconds)

    def seconds(self, num_tokens: int) -> float:
        """Estimated seconds (> 0) of a step of `num_tokens` tokens, never less than a step of fewer
        tokens: the measured points are read through their running maximum (a 5-token step measured
        faster than a 1-token one is noise, and believing it would make every draft look free)."""
        points = _running_max(sorted(self._points.values()))
        if not points:
            return max(self.fixed_s + self.per_token_s * num_tokens, _TINY_S)
        if len(points) == 1:
            (t0, s0), = points
            return max(s0 + self.per_token_s * (num_tokens - t0), _TINY_S)
        upper = bisect.bisect_left([t for t, _ in points], num_tokens)
        upper = min(max(upper, 1), len(points) - 1)      # its segment, or the end segment beyond
        (t0, s0), (t1, s1) = points[upper - 1], points[upper]
        slope = (s1 - s0) / (t1 - t0)
        if num_tokens > t1:                               # extrapolating: never cheaper with more tokens
            return max(s1 + max(slope, 0.0) * (num_tokens - t1), _TINY_S)
        if num_tokens < t0:
            slope = max(slope, 0.0)
        return max(s0 + slope * (num_tokens - t0), _TINY_S)


def _running_max(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(tokens, seconds) points sorted by tokens, each one's seconds raised to the most before it."""
    out, most = [], 0.0
    for tokens, secs in points:
        most = max(most, secs)
        out.append((tokens, most))
    return out


def choose_num_draft_tokens(batch_size: int, rates: Sequence[float], step_cost: StepCostModel,
                            max_k: int, draft_cost: StepCostModel | None = None,
                            min_gain: float = 1.0) -> int:
    """K for a step of `batch_size` decoding sequences: the K in 0..max_k with the most expected
    tokens per second, 0 unless that beats no speculation by the factor `min_gain` (>= 1).

    Takes per-position acceptance `rates` (at least max_k of them), the target's step cost, and
    the draft's cost per drafted token for the batch (`draft_cost.seconds(batch_size)` per draft
    position; None for free drafts such as n-gram lookup).
    """
    assert batch_size >= 1 and 0 <= max_k <= len(rates) and min_gain >= 1.0, (batch_size, max_k, min_gain)
    baseline = batch_size / step_cost.seconds(batch_size)
    best_k, best_rate = 0, baseline * min_gain
    for k in range(1, max_k + 1):
        drafting = k * draft_cost.seconds(batch_size) if draft_cost is not None else 0.0
        rate = batch_size * expected_tokens(rates, k) / (step_cost.seconds(batch_size * (k + 1)) + drafting)
        if rate > best_rate * (1 + 1e-9):                # more than rounding: ties keep the smaller K
            best_k, best_rate = k, rate
    return best_k


class AdaptiveK:
    """One engine's K policy: acceptance estimate + step cost model + a periodic probe.

    An estimate only moves when drafts are verified, so after K falls to 0 the policy would never
    learn that acceptance came back. While speculation could pay at this batch size (it would
    with perfect acceptance), every `probe_interval`-th step in a row that chose 0 drafts one
    token instead, so the estimate of a_1 keeps being measured; at batch sizes where even perfect
    acceptance would not pay, no probe runs (a loaded server pays nothing).
    """

    def __init__(self, max_k: int, acceptance: AcceptanceEstimate | None = None,
                 step_cost: StepCostModel | None = None, draft_cost: StepCostModel | None = None,
                 min_gain: float = 1.0, probe_interval: int = 32):
        if max_k < 1 or probe_interval < 1:
            raise ValueError(f"adaptive K needs max_k >= 1 (got {max_k}) and probe_interval >= 1 "
                             f"(got {probe_interval})")
        self.max_k, self.min_gain, self.probe_interval = max_k, min_gain, probe_interval
        self.acceptance = acceptance or AcceptanceEstimate(max_k)
        self.step_cost = step_cost or StepCostModel()
        self.draft_cost = draft_cost
        self._steps_at_zero = 0

    def choose(self, batch_size: int) -> int:
        """K (0..max_k) for the next step of `batch_size` decoding sequences."""
        k = self._best(batch_size, self.acceptance.rates)
        if k > 0:
            self._steps_at_zero = 0
            return k
        self._steps_at_zero += 1
        if self._steps_at_zero >= self.probe_interval and self._best(batch_size, [1.0] * self.max_k) > 0:
            self._steps_at_zero = 0
            return 1
        return 0

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """One sequence's verification result (see AcceptanceEstimate.observe)."""
        self.acceptance.observe(num_drafted, num_accepted)

    def record_step(self, num_tokens: int, seconds: float) -> None:
        """One measured target step (any step: prefill, decode or verify)."""
        self.step_cost.record(num_tokens, seconds)

    def _best(self, batch_size: int, rates: Sequence[float]) -> int:
        return choose_num_draft_tokens(batch_size, rates, self.step_cost, self.max_k,
                                       self.draft_cost, self.min_gain)
