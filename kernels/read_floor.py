"""The read-bandwidth floor's kernel: one pass over a buffer as fast as the CPU reads memory
(kernels/cpu/read_floor.cpp: every thread of the team streams its own slice with eight 64-byte
loads in flight and nothing else to do), so that no llmc kernel reading the same bytes can beat
it. tools/read_floor.py turns its time into the floor every "% of floor" figure is against.

Contract: x, a contiguous f32 CPU tensor of any length, `ahead`, bytes of software prefetch ahead
of the loads (0: the hardware prefetcher alone), `keep`, prefetching for the caches (as the
panel GEMVs do) rather than as lines read once, and `streams`, how many parts of its slice each
thread reads side by side (1, 2 or 4, as a GEMV reads several panels) -> a f32 scalar, the sum of x
accumulated in fp32 per thread and lane (another order than torch.sum: equal within fp32 rounding).
"""

from __future__ import annotations

import torch


def read_floor_ref(x: torch.Tensor) -> torch.Tensor:
    """The meaning: the sum of x, in float64."""
    return x.double().sum()


# (ahead, keep) prefetches tools/read_floor.py tries, the best differing by CPU; (4096, True) is the GEMVs' own
PREFETCHES = ((0, False), *((ahead, keep) for ahead in (4096, 16384, 65536) for keep in (True, False)))
# streams a thread reads side by side: a batch-1 GEMV reads 2-4 weight panels at once
STREAMS = (1, 2, 4)
# (ahead, keep, streams): every prefetch with every stream count
READ_STRATEGIES = tuple((ahead, keep, streams) for streams in STREAMS for ahead, keep in PREFETCHES)


def read_floor_cpu(x: torch.Tensor, ahead: int = 0, keep: bool = False, streams: int = 1) -> torch.Tensor:
    """Launcher: read_floor_ref's meaning through the native kernel (which must be loaded)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError(f"the read floor reads a contiguous f32 CPU tensor; got {x.dtype} on {x.device}"
                         f"{'' if x.is_contiguous() else ', not contiguous'}")
    if ahead < 0:
        raise ValueError(f"the prefetch distance must be at least 0 bytes, not {ahead}")
    if streams not in STREAMS:
        raise ValueError(f"the floor reads 1, 2 or 4 streams a thread, not {streams}")
    return torch.ops.llmc.read_floor(x, ahead, keep, streams)
