"""CPU memory that a decode step streams (the weights' arena, the paged KV cache) in one private anonymous
mapping advised for transparent huge pages.

Contract: `huge_page_bytes(nbytes, what)` -> (a zeroed uint8 tensor of `nbytes` bytes whose first byte
starts a 2 MiB page, whether the kernel took the advice). The tensor, and every view of it, keeps the
mapping alive. It raises OSError (or AttributeError, TypeError) where no such mapping can be made; a
mapping whose advice is refused is plain memory, said at INFO naming `what`. `huge_page_zeros(shape,
dtype, what)` is such memory viewed as a zeroed tensor with every page already faulted in, or torch's own
memory where no mapping can be made.

Why: a batch-1 decode step streams every weight and every cached K/V row once, and on many CPUs the
hardware prefetchers follow a stream only within a 4 KiB page while each new page costs a TLB walk. In 2
MiB pages (Linux's transparent huge pages, which the kernel gives a mapping advised MADV_HUGEPAGE where
/sys/kernel/mm/transparent_hugepage/enabled is "always" or "madvise") the TLB holds a whole model and the
cache of a long context. The README has what each gained. A page the kernel maps at its first touch costs
a fault that zeroes 2 MiB; inside a step plan one thread's fault stalls the team at the next barrier (the
default `llmc bench` workload ran 13% slower with the KV cache's pages faulted in as the steps reached
them), so huge_page_zeros touches every page when it allocates.
"""

from __future__ import annotations

import logging
import math
import mmap

import torch

log = logging.getLogger("llmc")

HUGE_PAGE = 2 << 20


def huge_page_bytes(nbytes: int, what: str) -> tuple[torch.Tensor, bool]:
    """`nbytes` zeroed bytes on huge pages where the kernel grants them (module docstring)."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advised = _advise_huge_pages(mapping, what)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)        # keeps the mapping alive
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes], advised


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype, what: str) -> torch.Tensor:
    """A zeroed CPU tensor of `shape` and `dtype` on huge pages where the kernel grants them."""
    nbytes = math.prod(shape) * dtype.itemsize
    try:
        memory, _ = huge_page_bytes(max(nbytes, 1), what)
    except (AttributeError, TypeError, OSError) as why:       # no private anonymous mappings here
        log.info("%s stays in torch's memory (no anonymous mapping for it: %s)", what, why)
        return torch.zeros(shape, dtype=dtype)
    memory.zero_()               # every page faulted in now, as torch.zeros does, not in a step (see above)
    return memory[:nbytes].view(dtype).view(shape)


def _advise_huge_pages(mapping: mmap.mmap, what: str) -> bool:
    """Ask the kernel for transparent huge pages under `mapping`; False where it cannot be asked."""
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError) as why:      # no MADV_HUGEPAGE off Linux; EINVAL without THP
        log.info("%s stays on the system's base pages (transparent huge pages not granted: %s)", what, why)
        return False
    return True
