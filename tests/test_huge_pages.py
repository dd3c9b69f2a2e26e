"""CPU memory a decode step streams, on huge pages (runtime/huge_pages.py): zeroed, aligned to a huge
page, alive as long as a view of it, every page faulted in when allocated; torch's memory where no
mapping can be made; and the paged KV cache an executor allocates on a CPU is such memory."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from llmc.runtime import huge_pages
from llmc.runtime.executor import KVCacheSpec
from llmc.runtime.huge_pages import HUGE_PAGE, huge_page_zeros


def test_the_memory_is_zeroed_aligned_and_alive_while_viewed():
    t = huge_page_zeros((3, 5, 7), torch.bfloat16, "a test tensor")
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert torch.count_nonzero(t) == 0
    view = t[1]
    del t
    gc.collect()
    view.fill_(2.5)                        # the mapping is still there
    assert torch.equal(view, torch.full((5, 7), 2.5, dtype=torch.bfloat16))


def test_without_an_anonymous_mapping_it_is_torchs_memory(monkeypatch, caplog):
    def refuse(nbytes, what):
        raise OSError("no mapping")
    monkeypatch.setattr(huge_pages, "huge_page_bytes", refuse)
    with caplog.at_level(logging.INFO, logger="llmc"):
        t = huge_page_zeros((4, 4), torch.float32, "a test tensor")
    assert "a test tensor stays in torch's memory" in caplog.text
    assert torch.equal(t, torch.zeros(4, 4))


def test_a_cpu_kv_cache_asks_for_huge_pages(monkeypatch):
    asked = []
    monkeypatch.setattr(huge_pages, "_advise_huge_pages", lambda mapping, what: asked.append(what) or True)
    cache = KVCacheSpec(2, 8, 3, 16, 64, torch.float32).allocate(torch.device("cpu"), extra_blocks=1)
    assert asked == ["the KV cache"]
    assert cache.shape == (2, 2, 9, 3, 16, 64) and torch.count_nonzero(cache) == 0
    assert cache.data_ptr() % HUGE_PAGE == 0


def resident_kib(address: int) -> int | None:
    """Rss of the mapping holding `address` (/proc/self/smaps), None where that file is not there."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "Rss:":
            return int(line.split()[1])
    return None


def test_every_page_is_faulted_in_when_allocated():
    t = huge_page_zeros((4, 2 << 20), torch.uint8, "a test tensor")        # 8 MiB
    rss = resident_kib(t.data_ptr())
    if rss is None:
        pytest.skip("no /proc/self/smaps to read the mapping's resident bytes from")
    assert rss >= 8 << 10
