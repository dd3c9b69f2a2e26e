"""BlockManager.trim on plain integers: after speculative verification rejects drafts, the
manager's state is exactly that of a manager that only ever saw the accepted tokens.

`Twin` drives two managers through the same requests: `spec` grows each table for the drafts,
computes them, then trims back to the accepted length and registers only accepted blocks (what
the engine does); `plain` decodes the accepted tokens one at a time (a non-speculative engine).
"""

from __future__ import annotations

import random

import pytest

from llmc.runtime.block_manager import BlockManager

BS = 4


def snapshot(bm: BlockManager) -> dict:
    """Everything the manager keeps: block ids included, so equal means interchangeable."""
    return {
        "free": list(bm._free),
        "ref_counts": [b.ref_count for b in bm.blocks],
        "hashes": [b.hash for b in bm.blocks],
        "cached": dict(bm._cached),
        "tables": {s: list(t) for s, t in bm._tables.items()},
        "hashed_upto": dict(bm._hashed_upto),
        "copies": list(bm._copies),
        "prefix": (bm.prefix_queries, bm.prefix_hits),
    }


class Twin:
    def __init__(self, num_blocks: int = 32):
        self.spec = BlockManager(num_blocks, BS)
        self.plain = BlockManager(num_blocks, BS)
        self.ids: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}

    def assert_same(self) -> None:
        assert snapshot(self.spec) == snapshot(self.plain)

    def admit(self, seq_id: int, prompt: list[int], first_token: int) -> int:
        """Prefill the prompt (prefix cache + copy-on-write as the scheduler does), sample one token."""
        cached, plain_cached = (bm.allocate(seq_id, prompt) for bm in (self.spec, self.plain))
        assert cached == plain_cached
        start = min(cached, len(prompt) - 1)
        for bm in (self.spec, self.plain):
            bm.prepare_write(seq_id, start, len(prompt))
            bm.take_copies()
            bm.register_full_blocks(seq_id, prompt, len(prompt))
        self.ids[seq_id], self.computed[seq_id] = prompt + [first_token], len(prompt)
        self.assert_same()
        return cached

    def decode(self, seq_id: int, drafts: list[int], accepted: int, next_token: int) -> int:
        """One verify step of `drafts`, `accepted` of them kept; return blocks the trim freed."""
        ids, start = self.ids[seq_id], self.computed[seq_id]
        new_ids = ids + drafts[:accepted] + [next_token]
        new_computed = len(ids) + accepted
        end = len(ids) + len(drafts)                     # the verify chunk: [start, end)
        self.spec.append(seq_id, end)
        self.spec.prepare_write(seq_id, start, end)
        self.spec.take_copies()
        grown = len(self.spec.block_table(seq_id))
        self.spec.trim(seq_id, new_computed)
        self.spec.register_full_blocks(seq_id, new_ids, new_computed)
        for pos in range(start, new_computed):           # the same tokens, one step each
            self.plain.append(seq_id, pos + 1)
            self.plain.prepare_write(seq_id, pos, pos + 1)
            self.plain.take_copies()
            self.plain.register_full_blocks(seq_id, new_ids, pos + 1)
        self.ids[seq_id], self.computed[seq_id] = new_ids, new_computed
        self.assert_same()
        return grown - len(self.spec.block_table(seq_id))

    def free(self, seq_id: int) -> None:
        for bm in (self.spec, self.plain):
            bm.free(seq_id)
        self.assert_same()


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_rejection_inside_one_block():
    twin = Twin()
    twin.admit(0, tokens(5), 50)                 # 6 tokens, 5 computed: blocks 0-1
    assert twin.decode(0, [60, 61], accepted=1, next_token=70) == 0


def test_rejection_that_crosses_a_block_boundary_frees_the_draft_blocks():
    twin = Twin()
    twin.admit(0, tokens(5), 50)
    freed = twin.decode(0, [60, 61, 62, 63, 64, 65, 66], accepted=1, next_token=70)
    assert freed == 2                            # drafts filled positions 6..12: blocks 2-3 went
    assert twin.spec.num_free_blocks == twin.plain.num_free_blocks


def test_rejection_of_every_draft():
    twin = Twin()
    twin.admit(0, tokens(7), 50)
    assert twin.decode(0, tokens(9, start=100), accepted=0, next_token=70) == 3
    assert twin.decode(0, tokens(3, start=200), accepted=0, next_token=71) == 0


def test_all_drafts_accepted_then_bonus():
    twin = Twin()
    twin.admit(0, tokens(6), 50)
    assert twin.decode(0, tokens(5, start=100), accepted=5, next_token=70) == 0
    assert twin.computed[0] == 12 and len(twin.spec.block_table(0)) == 3


def test_registered_hashes_hold_only_accepted_tokens():
    twin = Twin()
    twin.admit(0, tokens(6), 50)
    twin.decode(0, [60, 61, 62, 63, 64], accepted=1, next_token=70)   # ids: 0..5 50 60 70
    full_with_drafts = tokens(6) + [50, 60, 61, 62, 63, 64]        # block 2 held drafts 61..64
    assert twin.spec.allocate(1, full_with_drafts) == 8           # blocks 0-1 hit, block 2 not
    assert twin.plain.allocate(1, full_with_drafts) == 8
    twin.assert_same()


def test_prefix_cache_hits_before_and_after_speculation():
    twin = Twin()
    shared = tokens(8)
    twin.admit(0, shared + [90, 91], 50)
    assert twin.admit(1, shared, 51) == 8        # fully cached prompt: last block copied on write
    twin.decode(1, [60, 61, 62, 63, 64, 65], accepted=2, next_token=70)
    twin.decode(1, [80, 81, 82, 83, 84, 85, 86, 87], accepted=3, next_token=71)
    twin.decode(0, [60, 61, 62], accepted=0, next_token=72)
    accepted = twin.ids[1][:twin.computed[1]]    # 8 + 1 + 2 + 1 + 3 = 15 computed tokens
    assert twin.admit(2, accepted + [99], 52) == 12
    twin.free(1)
    assert twin.admit(3, accepted, 53) == 12
    for seq_id in (0, 2, 3):
        twin.free(seq_id)
    assert twin.spec.num_free_blocks == twin.spec.num_blocks


def test_preemption_after_trim_then_recompute():
    twin = Twin(num_blocks=12)
    twin.admit(0, tokens(9), 50)
    twin.decode(0, tokens(6, start=100), accepted=2, next_token=70)
    twin.free(0)                                 # preempted by recompute
    cached = twin.admit(0, twin.ids[0], 51)      # all its tokens are a prompt again
    assert cached == (len(twin.ids[0]) - 1) // BS * BS
    twin.decode(0, tokens(4, start=200), accepted=4, next_token=71)
    twin.free(0)


def test_trim_drops_a_pending_copy_into_a_freed_block():
    bm = BlockManager(8, BS)
    prompt = tokens(8)
    bm.allocate(0, prompt)
    bm.register_full_blocks(0, prompt, 8)
    bm.allocate(1, prompt)
    bm.prepare_write(1, 7, 8)                    # copy-on-write of the shared last block
    assert len(bm._copies) == 1
    bm.trim(1, 4)
    assert bm.take_copies() == []
    assert [bm.blocks[b].ref_count for b in bm.block_table(0)] == [2, 1]
    bm.free(0)
    bm.free(1)
    assert bm.num_free_blocks == 8 and all(b.ref_count == 0 for b in bm.blocks)


def test_trim_never_grows_and_keeps_a_partial_block():
    bm = BlockManager(8, BS)
    bm.allocate(0, tokens(6))
    bm.trim(0, 20)
    assert len(bm.block_table(0)) == 2
    bm.trim(0, 5)
    assert len(bm.block_table(0)) == 2
    bm.trim(0, 4)
    assert len(bm.block_table(0)) == 1


def test_trim_into_a_registered_block_is_a_contract_violation():
    bm = BlockManager(8, BS)
    bm.allocate(0, tokens(9))
    bm.register_full_blocks(0, tokens(9), 9)    # blocks 0 and 1 hashed
    with pytest.raises(AssertionError, match="cuts into its 2 hashed blocks"):
        bm.trim(0, 7)


def test_an_evicted_cached_block_is_not_revived_by_trim():
    """A draft block that evicted a cached prefix block overwrote it: the cache must forget it."""
    bm = BlockManager(3, BS)
    bm.allocate(0, tokens(4))
    bm.register_full_blocks(0, tokens(4), 4)
    bm.free(0)                                   # block cached on the free list
    bm.allocate(1, tokens(4, start=100))
    bm.append(1, 12)                             # drafts take every block, evicting the cached one
    bm.trim(1, 5)
    assert bm.allocate(2, tokens(4)) == 0


@pytest.mark.parametrize("seed", range(12))
def test_random_interleaved_requests_match_a_manager_that_saw_no_drafts(seed):
    rng = random.Random(seed)
    twin = Twin(num_blocks=64)
    stems = [tokens(rng.randrange(1, 10), start=1000 * s) for s in range(3)]
    live: list[int] = []
    for seq_id in range(8):
        prompt = rng.choice(stems) + [rng.randrange(500) for _ in range(rng.randrange(0, 6))]
        twin.admit(seq_id, prompt, rng.randrange(500))
        live.append(seq_id)
        for _ in range(rng.randrange(1, 8)):
            target = rng.choice(live)
            k = rng.randrange(0, 9)
            twin.decode(target, [rng.randrange(500) for _ in range(k)], rng.randrange(k + 1),
                        rng.randrange(500))
        if rng.random() < 0.4:
            gone = live.pop(rng.randrange(len(live)))
            twin.free(gone)
    for seq_id in live:
        twin.free(seq_id)
    assert twin.spec.num_free_blocks == twin.spec.num_blocks
