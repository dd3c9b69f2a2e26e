"""The read floor (kernels/cpu/read_floor.cpp, tools/read_floor.py): it reads every byte once, and
it is a ceiling: llmc's own GEMV, reading a weight of the same size, does not read faster."""

from __future__ import annotations

import pytest
import torch

from llmc.kernels.gemv import gemv_cpu, prepare_linear_weight
from llmc.kernels.native import load_native_kernels
from llmc.kernels.read_floor import read_floor_cpu, read_floor_ref
from llmc.tools.read_floor import ReadBandwidth, best_pass_seconds, buffer_sizes, last_level_cache_bytes

EPS32 = 2.0**-23


@pytest.fixture(scope="module", autouse=True)
def native():
    load_native_kernels()


@pytest.mark.parametrize("n", [1, 127, 128, 129, 4096 + 77, 1_000_003])
def test_the_floor_reads_every_element_once(n):
    # sums of ones are exact in fp32 up to 2^24 a lane: a skipped tail or a slice read twice shows
    assert read_floor_cpu(torch.ones(n)).item() == n


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


def test_buffers_are_larger_than_the_last_level_cache():
    assert all(size >= 4 * last_level_cache_bytes() and size >= 128 * 2**20 for size in buffer_sizes())


ROUNDS = 5
RESOLUTION = 0.03      # the best-of-5 times of one pass move by ~3% between rounds on an idle machine


def test_no_gemv_reads_faster_than_the_floor_on_the_same_bytes():
    """A 128 MiB float32 weight read by the batch-1 panel GEMV against the floor over a buffer of
    the same size, interleaved round by round so both see the same neighbours, best of each."""
    n, k = 16384, 2048                                     # 128 MiB: beyond a 32 MiB last-level cache
    weight = prepare_linear_weight(torch.randn(n, k))
    x = torch.randn(1, k)
    floor = ReadBandwidth([n * k * 4])
    gemv_s, floor_s = float("inf"), float("inf")
    for _ in range(ROUNDS):
        gemv_s = min(gemv_s, best_pass_seconds(lambda: gemv_cpu(x, weight), 5))
        floor_s = min(floor_s, n * k * 4 / floor.sample(5))
    assert floor.kernel.startswith("native read_floor")
    assert floor_s <= gemv_s * (1 + RESOLUTION), f"GEMV {n * k * 4 / gemv_s / 1e9:.1f} GB/s beats the floor's " \
                                                  f"{n * k * 4 / floor_s / 1e9:.1f}"
