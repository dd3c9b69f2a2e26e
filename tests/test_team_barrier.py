"""The team barrier step plans meet between kernels (kernels/cpu/team_barrier.h), through the rounds
of kernels/barrier_rounds.py: under every wait policy (spinning, yielding the core, sleeping in the
kernel) no thread passes a round its teammate has not finished, and every round reads its slice
once; tools/bench_barrier.py's table and bad input."""

from __future__ import annotations

import pytest
import torch

from llmc.kernels.barrier_rounds import barrier_rounds_cpu, barrier_rounds_ref, rounds_slice, step_plan_wait_policy
from llmc.kernels.native import load_native_kernels
from llmc.tools import bench_barrier

# (spin us, yield us): sleep at once, yield alone, spin alone, and the step plans' own
POLICIES = [(0, 0), (0, 1_000_000), (1_000_000, 0), None]


@pytest.fixture(scope="module", autouse=True)
def native():
    load_native_kernels()


@pytest.mark.parametrize("threads", [2, 3], indirect=True)
@pytest.mark.parametrize("policy", POLICIES)
def test_no_thread_passes_a_round_its_teammates_have_not_finished(threads, policy):
    # integers below 8 sum exactly in fp32 (each thread's share of a round stays under 2^24): a round
    # skipped, read twice or read by only one thread changes the total
    x = torch.randint(0, 8, (300 * 1024 + 77,), generator=torch.Generator().manual_seed(threads)).float()
    spin_us, yield_us = policy or step_plan_wait_policy()
    r = barrier_rounds_cpu(x, 300, spin_us, yield_us)
    assert r.behind == 0
    assert r.total == barrier_rounds_ref(x, 300)
    assert r.sleeps >= 0 and r.seconds > 0


def test_the_rounds_read_equal_slices_of_a_multiple_of_16():
    assert rounds_slice(torch.empty(1000), 3) == 320
    assert barrier_rounds_ref(torch.ones(1000), 3) == 960.0


def test_the_step_plans_spin_then_yield_before_they_sleep():
    spin_us, yield_us = step_plan_wait_policy()
    assert 0 < spin_us < yield_us


@pytest.mark.parametrize("args, words", [
    ((torch.ones(10), 1, 0, 0), "at least one round of 16"),
    ((torch.ones(100), 0, 0, 0), "at least one round of 16"),
    ((torch.ones(100), 1, -1, 0), "at least 0 us"),
    ((torch.ones(100, dtype=torch.float64), 1, 0, 0), "contiguous f32"),
])
def test_bad_rounds_are_refused_with_what_to_give(args, words):
    with pytest.raises(ValueError, match=words):
        barrier_rounds_cpu(*args)


def test_the_benchmark_prints_every_policy_against_the_step_plans(capsys):
    bench_barrier.main(["--rounds", "8", "--mib", "1", "--steps", "2"])
    out = capsys.readouterr().out
    assert "8 rounds over 1 MiB" in out
    rows = out.splitlines()[2:]
    assert len(rows) == len(bench_barrier.policies()) and rows[0].startswith("step plans'")
    assert rows[0].endswith("1.00x")


def test_the_benchmark_refuses_a_step_of_no_rounds(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_barrier.main(["--rounds", "0"])
    assert exit_info.value.code == 2
    assert "--rounds, --mib and --steps must be at least 1" in capsys.readouterr().err
