"""The read floor (kernels/cpu/read_floor.cpp, tools/read_floor.py): it reads every byte once, and
it is a ceiling: llmc's own GEMV, reading a weight of the same size, does not read faster."""

from __future__ import annotations

import time

import pytest
import torch

from llmc.kernels.gemv import gemv_cpu, prepare_linear_weight
from llmc.kernels.native import load_native_kernels
from llmc.kernels.read_floor import READ_STRATEGIES, read_floor_cpu, read_floor_ref
from llmc.tools import read_floor as read_floor_tool
from llmc.tools.profile_steps import best_of
from llmc.tools.read_floor import ReadBandwidth, buffer_sizes, last_level_cache_bytes, strategy_rows

EPS32 = 2.0**-23


@pytest.fixture(scope="module", autouse=True)
def native():
    load_native_kernels()


@pytest.mark.parametrize("strategy", READ_STRATEGIES)
@pytest.mark.parametrize("n", [1, 127, 128, 129, 4096 + 77, 1_000_003])
def test_the_floor_reads_every_element_once(n, strategy):
    # integers below 8 sum exactly in fp32 while the total stays under 2^24: a skipped tail, a slice
    # read twice, or one part of a slice read in place of another (the same count) shows
    x = torch.randint(0, 8, (n,), generator=torch.Generator().manual_seed(n)).float()
    assert read_floor_cpu(x, *strategy).item() == x.double().sum().item()


def test_the_floor_sums_as_the_ref_does():
    x = torch.randn(1_000_003, generator=torch.Generator().manual_seed(0))
    # fp32 accumulation: each lane's chain is at most n / 16 adds of values bounded by sum |x|
    bound = EPS32 * (x.numel() / 16 + 16) * x.abs().sum().item()
    assert abs(read_floor_cpu(x).item() - read_floor_ref(x).item()) <= bound


def test_the_launcher_refuses_what_the_kernel_does_not_read():
    with pytest.raises(ValueError, match="contiguous f32"):
        read_floor_cpu(torch.ones(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="not contiguous"):
        read_floor_cpu(torch.ones(8, 8).t())
    with pytest.raises(ValueError, match="1, 2 or 4 streams"):
        read_floor_cpu(torch.ones(8), streams=3)


def test_buffers_are_larger_than_the_last_level_cache():
    assert all(size >= 4 * last_level_cache_bytes() and size >= 128 * 2**20 for size in buffer_sizes())


MIN_ROUNDS, MAX_ROUNDS = 3, 16
RESOLUTION = 0.03      # the best-of-5 times of one pass move by ~3% between rounds on an idle machine


def floor_against_gemv(floor: ReadBandwidth) -> tuple[float, float]:
    """(floor, GEMV) bytes/s on the same 128 MiB: a float32 weight read by the batch-1 panel GEMV and
    by the floor (its panels themselves, so where the memory behind them sits favours neither: in a
    CI run on the 2-core AMD EPYC VM the GEMV once read its own 128 MiB at 50 GB/s in every round while
    the floor read another buffer at 42), interleaved round by round so both see the same neighbours,
    the best of each; rounds go on (up to MAX_ROUNDS) while the GEMV is ahead, since a busy moment can
    only slow a round down."""
    n, k = 16384, 2048                                     # 128 MiB: beyond a 32 MiB last-level cache
    weight, x = prepare_linear_weight(torch.randn(n, k)), torch.randn(1, k)
    floor.buffers = [weight.weight.view(-1)]
    gemv_s, floor_bps = float("inf"), 0.0
    for round in range(MAX_ROUNDS):
        gemv_s = min(gemv_s, best_of(lambda: gemv_cpu(x, weight), 5))
        floor_bps = max(floor_bps, floor.sample(5))
        if round + 1 >= MIN_ROUNDS and floor_bps * (1 + RESOLUTION) >= n * k * 4 / gemv_s:
            break
    return floor_bps, n * k * 4 / gemv_s


def test_no_gemv_reads_faster_than_the_floor_on_the_same_bytes():
    floor = ReadBandwidth([128 * 2**20])
    assert floor.kernel.startswith("native read_floor")
    floor_bps, gemv_bps = floor_against_gemv(floor)
    assert floor_bps * (1 + RESOLUTION) >= gemv_bps, f"GEMV {gemv_bps / 1e9:.1f} GB/s beats the floor's {floor_bps / 1e9:.1f}"


def test_a_floor_slower_than_the_gemv_fails_the_check():
    """The same check against a floor that reads every byte twice (half the machine's rate): the
    GEMV is then ahead in every round and the assertion above must not hold."""
    slow = ReadBandwidth([128 * 2**20])
    slow.reads = [lambda x: (read_floor_cpu(x, 0), read_floor_cpu(x, 0))]
    floor_bps, gemv_bps = floor_against_gemv(slow)
    assert floor_bps * (1 + RESOLUTION) < gemv_bps


def test_strategy_rows_name_every_strategy_once_fastest_first():
    rows = strategy_rows(torch.ones(1 << 16), repeats=1)
    assert len(rows) == len(READ_STRATEGIES)
    rates = [float(r.split()[0]) for r in rows]
    assert rates == sorted(rates, reverse=True)
    named = {(int(r.split("GB/s")[1].split()[0]), r.split("prefetch ")[1].split(" KiB")[0] if "KiB" in r else "0",
              "non-temporal" in r) for r in rows}
    assert named == {(s, str(a // 1024), a > 0 and not k) for a, k, s in READ_STRATEGIES}


def test_strategy_rows_label_each_rate_with_its_own_strategy(monkeypatch):
    slowest = {(4096, True, 4): 0.06, (4096, False, 4): 0.03}     # two strategies told apart by the cache hint
    monkeypatch.setattr(read_floor_tool, "read_floor_cpu", lambda x, *s: time.sleep(slowest.get(s, 0.0)))
    rows = strategy_rows(torch.ones(1 << 10), repeats=3)
    assert rows[-1].endswith("4 streams a thread, prefetch 4 KiB ahead, for the caches")
    assert rows[-2].endswith("4 streams a thread, prefetch 4 KiB ahead, non-temporal")


def test_beside_reads_the_bytes_asked_with_the_fastest_strategy_window_after_window():
    """`beside` (a decode step's pair): the last sample's fastest strategy, and only it, reads windows
    of the asked size one after another through the largest buffer, wrapping at its end, so no
    window is read again until the whole buffer has been."""
    floor = ReadBandwidth([2**20, 2**21])
    base = floor.buffers[-1].data_ptr()
    calls = []

    def strategy(i: int, delay: float):
        def read(x):
            time.sleep(delay)
            calls.append((i, x.data_ptr() - base, x.numel()))
        return read

    floor.reads = [strategy(0, 0.004), strategy(1, 0.0), strategy(2, 0.008)]
    floor.sample(1)
    assert floor.fastest == 1
    calls.clear()
    n = floor.buffers[-1].numel()
    for _ in range(3):
        floor.beside(n // 5 * 4 * 2)                       # two fifths of the buffer a step
    assert {i for i, _, _ in calls} == {1}
    windows = [(offset // 4, numel) for _, offset, numel in calls]
    fifth = n // 5
    assert windows == [(0, 2 * fifth), (2 * fifth, 2 * fifth), (4 * fifth, n - 4 * fifth), (0, 6 * fifth - n)]
