"""A decode step's GEMV panels claimed by the team (kernels/cpu/panel_claims.h): every panel goes to
exactly one claim whatever the shares and the team's timing, and a thread that finishes first takes
what a slow one leaves (the step plans' outputs against their refs are in test_step_plan.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("native_kernels_built")


def cover(count: int, shares: int, min_chunk: int, slow_us: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.llmc.panel_claims_cover(count, shares, min_chunk, slow_us)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("shares", [1, 2, 3])
@pytest.mark.parametrize("min_chunk", [1, 2, 5])
@pytest.mark.parametrize("count", [0, 1, 7, 64, 1537])
def test_every_panel_is_claimed_once(count, shares, min_chunk, threads):
    # more shares than threads: a plan built for a larger team; the missing threads' shares are taken too
    for _ in range(20):
        marks, taken = cover(count, shares, min_chunk)
        assert torch.equal(marks, torch.ones(count, dtype=torch.long)), marks.tolist()
        assert taken.sum().item() == count


@pytest.mark.parametrize("threads", [2], indirect=True)
def test_a_thread_done_first_takes_what_a_slow_one_leaves(threads):
    count = 200                                  # thread 0: 50 us a panel, 5 ms for its own share alone
    marks, taken = cover(count, 2, 1, slow_us=50.0)
    assert torch.equal(marks, torch.ones(count, dtype=torch.long))
    assert taken[1].item() > count // 2, taken.tolist()
