"""Rounds of a step plan's shape through the team barrier step plans meet between kernels
(kernels/cpu/team_barrier.h; kernels/cpu/barrier_rounds.cpp runs them): each thread of the team
sums its share of one slice of x a round, then waits for the others. tools/bench_barrier.py times
the barrier's wait policies with it; the tests check the barrier's contract with it.

Contract: x, a contiguous f32 CPU tensor cut into `rounds` (>= 1) slices of a multiple of 16
elements, and the barrier's WaitPolicy: `spin_us` microseconds of spinning, then `yield_us` of
yielding the core, then sleep (both >= 0) -> BarrierRounds: the rounds' wall seconds, how many waits
slept in the kernel, how many post-barrier checks found a teammate that had not yet recorded the
round (0 for a barrier that keeps its contract), and the sum of the slices read.
step_plan_wait_policy() is the policy step plans use.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class BarrierRounds(NamedTuple):
    seconds: float
    sleeps: int
    behind: int
    total: float


def rounds_slice(x: torch.Tensor, rounds: int) -> int:
    """Elements of x each round reads: an equal slice, a multiple of 16 (the tail is never read)."""
    return x.numel() // rounds // 16 * 16


def barrier_rounds_ref(x: torch.Tensor, rounds: int) -> float:
    """The meaning of the sum the rounds return: every slice's elements, in float64."""
    return float(x[: rounds * rounds_slice(x, rounds)].double().sum())


def step_plan_wait_policy() -> tuple[int, int]:
    """The microseconds a step plan's barrier spins, then yields, before it sleeps (team_barrier.h)."""
    spin_us, yield_us = torch.ops.llmc.barrier_wait_policy()
    return spin_us, yield_us


def barrier_rounds_cpu(x: torch.Tensor, rounds: int, spin_us: int, yield_us: int) -> BarrierRounds:
    """Launcher: the rounds through the native kernel (which must be loaded)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError(f"the barrier rounds read a contiguous f32 CPU tensor; got {x.dtype} on {x.device}")
    if rounds < 1 or rounds_slice(x, rounds) == 0:
        raise ValueError(f"{rounds} rounds over {x.numel()} elements: give at least one round of 16 elements or more")
    if spin_us < 0 or yield_us < 0:
        raise ValueError(f"the barrier's spin and yield times must be at least 0 us, not {spin_us} and {yield_us}")
    seconds, sleeps, behind, total = torch.ops.llmc.barrier_rounds(x, rounds, spin_us, yield_us).tolist()
    return BarrierRounds(seconds, int(sleeps), int(behind), total)
