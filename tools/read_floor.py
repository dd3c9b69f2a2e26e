"""The read-bandwidth floor that every "% of floor" figure is measured against, and that no llmc
kernel may beat: bytes per second of kernels/read_floor.py's native pass (all threads, 64-byte
loads, eight in flight per thread) over buffers of several sizes, the best of several passes.

The sizes are 128, 256 and 512 MiB, each at least four times the last-level cache (so they are
read from memory; a CPU with a larger cache takes larger buffers), and a sample is the best rate
over them. Software prefetch helps some CPUs and not others, at distances and cache hints that
differ, and so does whether a core reads several streams faster than one, so every strategy in
kernels/read_floor.py's list (prefetches times 1, 2 or 4 streams a thread; the panel GEMVs' own among
them) is tried each time and the best counts. The floor moves with the neighbours' load on a shared
machine, so a profile samples it beside each measurement, and `beside` reads a step's own bytes with
the strategy that was fastest, right after the step: a pair that sees the same neighbours (the best
of many passes, the floor, is what a step could read at the machine's best moment in the run; the
pair, what it could read at the step's own). Without the native kernels it falls back to
torch.sum (which llmc's own GEMV has read faster than, so it is no ceiling) and says so once.
`python -m llmc.tools.read_floor` prints the floor against torch.sum round by round; with
`--strategies`, each strategy alone over 512 MiB, fastest first.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from llmc.kernels.native import NativeBuildError, load_native_kernels
from llmc.kernels.read_floor import READ_STRATEGIES, read_floor_cpu

SIZES_MIB = (128, 256, 512)
CACHE_MULTIPLE = 4


def last_level_cache_bytes() -> int:
    """The largest cache the kernel reports for CPU 0 (0 where it does not say)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=0)


def buffer_sizes() -> list[int]:
    """Bytes of each buffer: SIZES_MIB, each raised to CACHE_MULTIPLE x the last-level cache."""
    floor = CACHE_MULTIPLE * last_level_cache_bytes()
    return sorted({max(mib * 2**20, floor) for mib in SIZES_MIB})


class ReadBandwidth:
    """The read floor, sampled as often as asked (bytes/s)."""

    def __init__(self, sizes: list[int] | None = None):
        self.buffers = [torch.ones(n // 4) for n in (sizes or buffer_sizes())]
        self.fastest = 0          # index into `reads` of the last sample's fastest strategy
        self.position = 0         # where `beside` reads next in the largest buffer (elements)
        try:
            load_native_kernels()
        except NativeBuildError:
            logging.getLogger("llmc").info("the read floor falls back to torch.sum: without the native kernels "
                                           "it is not a ceiling for llmc's kernels")
            self.reads, self.kernel = [torch.sum], "torch.sum"
            return
        self.reads = [lambda x, a=a, k=k, s=s: read_floor_cpu(x, a, k, s) for a, k, s in READ_STRATEGIES]
        self.kernel = f"native read_floor, {len(READ_STRATEGIES)} prefetch and stream strategies"

    def sample(self, repeats: int = 2) -> float:
        """The best rate over the buffers and prefetch strategies, each the best of `repeats` passes
        (a buffer is read once untimed first); the fastest strategy is kept for `beside`."""
        best = 0.0
        for x in self.buffers:
            self.reads[0](x)
            for i, read in enumerate(self.reads):
                rate = x.numel() * 4 / min(seconds_of(lambda: read(x)) for _ in range(repeats))
                if rate > best:
                    best, self.fastest = rate, i
        return best

    def beside(self, nbytes: int) -> float:
        """Seconds for the last sample's fastest strategy to read `nbytes` of the largest buffer, from
        where its last read stopped (wrapping round): a window read at least four caches' bytes ago,
        so from memory, as a decode step's weights are."""
        x, read = self.buffers[-1], self.reads[self.fastest]
        left, seconds = max(1, nbytes // 4), 0.0
        while left:
            take = min(left, x.numel() - self.position)
            window = x[self.position:self.position + take]
            seconds += seconds_of(lambda: read(window))
            self.position, left = (self.position + take) % x.numel(), left - take
        return seconds

    def describe(self) -> str:
        sizes = "/".join(f"{x.numel() * 4 // 2**20}" for x in self.buffers)
        return f"{self.kernel} over {sizes} MiB"


def seconds_of(fn) -> float:
    """Wall seconds of one call of `fn`."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def read_bandwidth() -> float:
    """One sample of the read floor, the best of 5 passes per buffer."""
    return ReadBandwidth().sample(5)


def strategy_rows(x: torch.Tensor, repeats: int = 3) -> list[str]:
    """Each of kernels/read_floor.py's strategies alone over `x` (the best of `repeats` passes), fastest
    first: which prefetch and how many streams a thread this CPU reads fastest with. On a 2-core AMD
    EPYC VM (Zen 5) two streams a thread read 63-76 GB/s and one 31-40 in one run, and every strategy
    34-44 GB/s an hour later: the host's load decides as much as the pattern."""
    rates = [(x.numel() * 4 / min(seconds_of(lambda: read_floor_cpu(x, *s)) for _ in range(repeats)), s)
             for s in READ_STRATEGIES]
    return [f"{rate / 1e9:6.1f} GB/s   {streams} stream{'s' if streams > 1 else ' '} a thread, "
            + ("no software prefetch" if ahead == 0 else
               f"prefetch {ahead // 1024} KiB ahead, {'for the caches' if keep else 'non-temporal'}")
            for rate, (ahead, keep, streams) in sorted(rates, key=lambda r: -r[0])]


def main(rounds: int = 5) -> None:
    """`python -m llmc.tools.read_floor`: the floor against the torch.sum it replaced, round by round
    in one run (torch.sum over 512 MiB, the best of 5 passes, beside ReadBandwidth().sample(5)), and
    the best of each over the rounds: this machine's bandwidth moves within seconds, so one round
    says little and the best of several is what a floor is."""
    floor, x = ReadBandwidth(), torch.ones(512 * 2**20 // 4)
    print(f"read floor: {floor.describe()}")
    best_old = best_new = 0.0
    for _ in range(rounds):
        old = x.numel() * 4 / min(seconds_of(lambda: x.sum()) for _ in range(5))
        new = floor.sample(5)
        best_old, best_new = max(best_old, old), max(best_new, new)
        print(f"torch.sum over 512 MiB {old / 1e9:6.1f} GB/s   read floor {new / 1e9:6.1f} GB/s")
    print(f"best of {rounds} rounds: torch.sum {best_old / 1e9:.1f} GB/s, read floor {best_new / 1e9:.1f} GB/s "
          f"({best_new / best_old:.2f}x)")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--strategies"]:        # each strategy alone over 512 MiB
        load_native_kernels()
        print("\n".join(strategy_rows(torch.ones(512 * 2**20 // 4))))
    elif sys.argv[1:]:
        sys.exit(f"read_floor takes no arguments or --strategies, not {' '.join(sys.argv[1:])!r}")
    else:
        main()
