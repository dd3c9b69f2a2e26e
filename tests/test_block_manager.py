"""BlockManager on plain integers: allocation, reference counts, prefix cache, LRU, copy-on-write."""

from __future__ import annotations

import sys

import pytest

from llmc.runtime.block_manager import BlockManager

BS = 4

def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))

def all_free(bm: BlockManager) -> bool:
    return bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)

def test_bookkeeping_imports_no_torch():
    import subprocess

    code = ("import sys, llmc.runtime.block_manager, llmc.runtime.scheduler, llmc.runtime.sequence; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0

def test_allocate_append_free_returns_every_block():
    bm = BlockManager(8, BS)
    assert bm.allocate(0, tokens(6)) == 0
    assert len(bm.block_table(0)) == 2
    bm.append(0, 9)
    assert len(bm.block_table(0)) == 3
    assert bm.slot(0, 5) == bm.block_table(0)[1] * BS + 1
    bm.free(0)
    assert all_free(bm)

def test_out_of_blocks_is_refused_not_overcommitted():
    bm = BlockManager(2, BS)
    assert not bm.can_allocate(tokens(9))
    with pytest.raises(MemoryError):
        bm.allocate(0, tokens(9))
    bm.allocate(1, tokens(8))
    assert not bm.can_append(1, 9)

def test_shared_prefix_hits_the_cache_and_shares_blocks():
    bm = BlockManager(16, BS)
    prefix = tokens(8)
    bm.allocate(0, prefix + [100, 101])
    bm.register_full_blocks(0, prefix + [100, 101], 10)
    cached = bm.allocate(1, prefix + [200, 201, 202])
    assert cached == 8
    assert bm.block_table(1)[:2] == bm.block_table(0)[:2]
    assert bm.block_table(1)[2] != bm.block_table(0)[2]
    assert [bm.blocks[b].ref_count for b in bm.block_table(1)[:2]] == [2, 2]
    assert bm.hit_rate() == pytest.approx(2 / 4)
    bm.free(0)
    bm.free(1)
    assert all_free(bm)

def test_different_earlier_tokens_break_the_chain():
    bm = BlockManager(16, BS)
    a = tokens(8)
    bm.allocate(0, a)
    bm.register_full_blocks(0, a, 8)
    b = [99] + a[1:]           # same second block, different first: no hit at all
    assert bm.allocate(1, b) == 0

def test_uncomputed_blocks_are_not_registered():
    bm = BlockManager(16, BS)
    bm.allocate(0, tokens(12))
    bm.register_full_blocks(0, tokens(12), 5)   # only the first block is computed
    assert bm.allocate(1, tokens(12)) == 4

def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(4, BS)
    bm.allocate(0, tokens(8))
    bm.register_full_blocks(0, tokens(8), 8)
    bm.free(0)
    assert bm.allocate(1, tokens(8)) == 8            # revived from the free list
    bm.free(1)
    bm.allocate(2, tokens(16, start=500))            # needs all 4 blocks: evicts both cached ones
    bm.free(2)
    assert bm.allocate(3, tokens(8)) == 0

def test_fully_cached_prompt_copies_the_block_it_rewrites():
    bm = BlockManager(8, BS)
    prompt = tokens(8)
    bm.allocate(0, prompt)
    bm.register_full_blocks(0, prompt, 8)
    assert bm.allocate(1, prompt) == 8
    last = bm.block_table(1)[1]
    bm.prepare_write(1, 7, 8)                        # recompute the last token for its logits
    assert bm.take_copies() == [(last, bm.block_table(1)[1])]
    assert bm.block_table(1)[1] != last and bm.block_table(1)[0] == bm.block_table(0)[0]
    assert bm.blocks[last].ref_count == 1
    assert bm.take_copies() == []
    bm.free(0)
    bm.free(1)
    assert all_free(bm)

def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    bm.allocate(0, tokens(8))
    bm.register_full_blocks(0, tokens(8), 8)
    assert bm.allocate(1, tokens(8)) == 0


def test_a_fully_cached_prompt_waits_for_the_block_its_copy_needs():
    """Its last token is recomputed into a copy of the shared last block: with no free block for the
    copy it is refused (it waits) rather than taken and failing at the write."""
    bm = BlockManager(num_blocks=2, block_size=4)
    prompt = list(range(8))
    bm.allocate(0, prompt)
    bm.register_full_blocks(0, prompt, 8)
    assert not bm.can_allocate(prompt)                       # both blocks shared, none free for the copy
    bm.free(0)
    assert bm.can_allocate(prompt)                           # nobody shares them now: no copy is needed
    assert bm.allocate(1, prompt) == 8


def test_a_sequence_that_does_not_reuse_the_cache_gets_blocks_of_its_own():
    bm = BlockManager(num_blocks=4, block_size=4)
    prompt = list(range(8))
    bm.allocate(0, prompt)
    bm.register_full_blocks(0, prompt, 8)
    assert bm.allocate(1, prompt, reuse=False) == 0
    assert set(bm.block_table(1)).isdisjoint(bm.block_table(0))
