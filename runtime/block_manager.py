"""BlockManager: the paged KV cache's allocator, with prefix caching. Pure Python, no torch.

The cache is `num_blocks` blocks of `block_size` token slots. A sequence owns a block table;
token i lives in slot `table[i // block_size] * block_size + i % block_size`.

Prefix caching: every *full* block is identified by a key chained over its tokens and all
tokens before it, `block_key(parent_key, tokens)`: sha256 of the parent's 32-byte key and the
block's token ids (as vLLM keys blocks since its security advisory: Python's `hash` collides on
purpose-built inputs, and a collision would let one request read another's cached KV). The
chain starts from the sequence's cache salt, so requests with different salts never share a
block. A new sequence whose leading full blocks' keys are in the cache shares those blocks
(reference count + 1) and skips computing them.
A block whose count drops to zero keeps its contents and hash on an LRU free list, so a later
request can still hit it; allocation takes the least recently freed block and forgets its hash.
A shared block that must be written (the last token of a fully cached prompt is recomputed to
get its logits) is copied first: copy-on-write, reported through `take_copies()`.

Speculative decoding grows a table for draft tokens, then `trim`s it back to the accepted length.
Hashes are registered only for accepted tokens (`register_full_blocks` after verification), so a
trim never cuts into a hashed block; the blank blocks it frees return to the front of the free
list, as if they had never been taken.

Change tracking, for a consumer that keeps its own copy of the block tables (`InputBatch`):
`take_table_changes()` returns what changed since its previous call, a `TableChanges`:
  changed  {seq_id: first index}  the lowest table index each sequence's table changed at (an
                                  `allocate`, `append`, copy-on-write in `prepare_write`, or `trim`):
                                  entries before it are as the consumer last read them, the table
                                  from it on (and its length) must be read again
  freed    {seq_id}               sequences whose tables `free` released (a sequence freed and then
                                  allocated again is in both: drop its old table, then read it whole)
Nothing is recorded until the first call, which reports every live table as changed from 0: a
manager without a consumer (the draft model's) keeps nothing, and a consumer may start late.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence as TokenIds


def cache_salt(server: str | None, request: str | None) -> str | None:
    """A sequence's prefix-cache salt: the server's and the request's, where given (None: neither)."""
    if server is None and request is None:
        return None
    return json.dumps([server, request])        # unambiguous: no two pairs spell the same salt


def salt_key(salt: str | None) -> bytes | None:
    """The chain's start: a key of the cache salt (None, no salt: the chain starts empty)."""
    return None if salt is None else hashlib.sha256(b"llmc-cache-salt\0" + salt.encode()).digest()


def block_key(parent: bytes | None, tokens: TokenIds[int]) -> bytes:
    """sha256 over the parent block's key (or nothing, for a first block) and the block's token ids
    (little-endian int64s): collision resistant, so distinct prefixes never share a key."""
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None         # its key (block_key), set once the block is full and registered


@dataclass(frozen=True)
class TableChanges:
    """Block-table changes since the consumer's last `take_table_changes()` (see module docstring)."""

    changed: dict[int, int]          # seq_id -> lowest block-table index written, appended or cut
    freed: set[int]                  # seq_ids whose tables were freed


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}        # block key -> block id
        self._tables: dict[int, list[int]] = {}
        self._hashed_upto: dict[int, int] = {}     # seq -> full blocks already hashed
        self._salts: dict[int, bytes | None] = {}  # seq -> its chain's start (salt_key)
        self._copies: list[tuple[int, int]] = []   # pending (src, dst) copy-on-write pairs
        self._table_changes: dict[int, int] | None = None  # seq -> lowest changed index (None: untracked)
        self._tables_freed: set[int] = set()       # seqs freed since the last take_table_changes
        self.prefix_queries = 0                    # full prompt blocks looked up
        self.prefix_hits = 0                       # ... of which were found in the cache

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables[seq_id]

    def has_table(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def slot(self, seq_id: int, position: int) -> int:
        table = self._tables[seq_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    # ---------------------------------------------------------- change tracking

    def take_table_changes(self) -> TableChanges:
        """The block-table changes since the previous call (the first call: every live table, whole)."""
        if self._table_changes is None:
            changes = TableChanges({seq_id: 0 for seq_id in self._tables}, set())
        else:
            changes = TableChanges(self._table_changes, self._tables_freed)
        self._table_changes, self._tables_freed = {}, set()
        return changes

    def _table_changed(self, seq_id: int, index: int) -> None:
        """Record that the sequence's table changed from `index` on (once a consumer tracks changes)."""
        if self._table_changes is not None:
            self._table_changes[seq_id] = min(index, self._table_changes.get(seq_id, index))

    # --------------------------------------------------------------- allocation

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)          # least recently freed
        block = self.blocks[block_id]
        if block.hash is not None and self._cached.get(block.hash) == block_id:
            del self._cached[block.hash]                       # evicted from the prefix cache
        block.hash, block.ref_count = None, 1
        return block_id

    def _share(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _cached_prefix(self, token_ids: TokenIds[int], salt: str | None) -> list[int]:
        """Block ids of the longest run of leading full blocks found in the prefix cache (the chain
        is keyed from `salt`, and stops at the first miss)."""
        if not self.enable_prefix_caching:
            return []
        hits, key = [], salt_key(salt)
        for i in range(len(token_ids) // self.block_size):
            key = block_key(key, token_ids[i * self.block_size:(i + 1) * self.block_size])
            if key not in self._cached:
                break
            hits.append(self._cached[key])
        return hits

    def can_allocate(self, token_ids: TokenIds[int], reserve: int = 0, salt: str | None = None,
                     reuse: bool = True) -> bool:
        """Whether a new sequence with these tokens (and cache salt) fits, keeping `reserve` blocks free.
        A fully cached prompt counts one block more: its last token is recomputed into a copy of its
        last block when another sequence shares that block (copy-on-write)."""
        hits = self._cached_prefix(token_ids, salt) if reuse else []
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        fresh = self.blocks_needed(len(token_ids)) - len(hits)
        copy = int(bool(hits) and len(hits) * self.block_size == len(token_ids) and self.blocks[hits[-1]].ref_count > 0)
        return fresh + revived + copy + reserve <= len(self._free)

    def allocate(self, seq_id: int, token_ids: TokenIds[int], salt: str | None = None, reuse: bool = True) -> int:
        """Give a new sequence blocks for its tokens; return how many leading tokens are cached. Its
        blocks are looked up (unless `reuse` is off: the sequence computes every token), and later
        registered, under keys chained from `salt`."""
        assert seq_id not in self._tables, f"sequence {seq_id} already has blocks"
        hits = self._cached_prefix(token_ids, salt) if reuse else []
        self.prefix_queries += len(token_ids) // self.block_size
        self.prefix_hits += len(hits)
        for b in hits:
            self._share(b)
        fresh = self.blocks_needed(len(token_ids)) - len(hits)
        if fresh > len(self._free):
            raise MemoryError(f"sequence {seq_id} needs {fresh} free KV blocks, {len(self._free)} are free")
        self._tables[seq_id] = hits + [self._take_free() for _ in range(fresh)]
        self._table_changed(seq_id, 0)
        self._hashed_upto[seq_id] = len(hits)
        self._salts[seq_id] = salt_key(salt)
        return len(hits) * self.block_size

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        """Whether the sequence can grow to `num_tokens` tokens."""
        return self.blocks_needed(num_tokens) - len(self._tables[seq_id]) <= len(self._free)

    def append(self, seq_id: int, num_tokens: int) -> None:
        """Grow the sequence's table to hold `num_tokens` tokens."""
        table = self._tables[seq_id]
        missing = self.blocks_needed(num_tokens) - len(table)
        if missing > len(self._free):
            raise MemoryError(f"sequence {seq_id} needs {missing} more KV blocks, {len(self._free)} are free")
        if missing > 0:
            self._table_changed(seq_id, len(table))
            table.extend(self._take_free() for _ in range(missing))

    def prepare_write(self, seq_id: int, start: int, end: int) -> None:
        """Make the blocks that positions [start, end) will be written to private (copy-on-write)."""
        table = self._tables[seq_id]
        for index in range(start // self.block_size, self.blocks_needed(end)):
            block = self.blocks[table[index]]
            if block.ref_count > 1:
                block.ref_count -= 1
                table[index] = self._take_free()
                self._copies.append((block.block_id, table[index]))
                self._table_changed(seq_id, index)
                self._hashed_upto[seq_id] = min(self._hashed_upto[seq_id], index)

    def take_copies(self) -> list[tuple[int, int]]:
        """Pending (source, destination) block copies the runner must apply before the step."""
        copies, self._copies = self._copies, []
        return copies

    def register_full_blocks(self, seq_id: int, token_ids: TokenIds[int], num_computed: int) -> None:
        """Enter the sequence's newly filled (and computed) blocks into the prefix cache. `token_ids`
        is anything with len() and slices (only the new blocks' tokens are read)."""
        if not self.enable_prefix_caching:
            return
        table, done = self._tables[seq_id], self._hashed_upto[seq_id]
        full = min(num_computed, len(token_ids)) // self.block_size
        if full <= done:
            return
        # Continue the chain from the last hashed block (live blocks keep their hash) instead of
        # rehashing the whole sequence each time a block fills.
        parent = self.blocks[table[done - 1]].hash if done else self._salts[seq_id]
        for index in range(done, full):
            block = self.blocks[table[index]]
            parent = block_key(parent, token_ids[index * self.block_size:(index + 1) * self.block_size])
            block.hash = parent
            self._cached.setdefault(parent, block.block_id)
        self._hashed_upto[seq_id] = full

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Shrink the sequence's table to the slots of its first `num_tokens` tokens (rollback).

        After speculative verification `num_tokens` is the sequence's computed length: the tokens
        before the drafts plus the accepted drafts (the correction or bonus token is not computed
        yet; the next step's `append` makes room for it, as for any sampled token). A table that
        holds no more blocks than that is left as it is (trim never grows a table).
        Requires: no registered hash covers a token at or after `num_tokens` (hashes are entered
        only for accepted tokens), asserted. Frees the blocks past the new length as `free` does
        (reference counts), but a freed blank block (no hash) goes to the *front* of the LRU free
        list: it caches nothing, so it is reused before any cached block is evicted, and trims that
        undo appends in reverse order leave the free list exactly as if the drafts never existed.
        A cached block that a draft's block evicted stays evicted (its slots were overwritten).
        The kept last block's slots past `num_tokens` hold stale K/V that later writes overwrite.
        Pending copy-on-write copies into freed blocks are dropped.
        """
        assert num_tokens >= 0, f"cannot trim sequence {seq_id} to {num_tokens} tokens"
        table = self._tables[seq_id]
        hashed = self._hashed_upto[seq_id]
        assert num_tokens >= hashed * self.block_size, (
            f"trimming sequence {seq_id} to {num_tokens} tokens cuts into its {hashed} hashed blocks "
            f"of {self.block_size}: a rejected token was registered")
        keep = self.blocks_needed(num_tokens)
        dropped = table[keep:]
        del table[keep:]
        if dropped:
            self._table_changed(seq_id, keep)
        for block_id in reversed(dropped):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.hash is None:
                    self._free.move_to_end(block_id, last=False)
        if dropped and self._copies:
            gone = set(dropped)
            self._copies = [(src, dst) for src, dst in self._copies if dst not in gone]

    def free(self, seq_id: int) -> None:
        """Release the sequence's blocks; unreferenced ones stay cached until evicted (LRU)."""
        if seq_id in self._tables and self._table_changes is not None:
            self._table_changes.pop(seq_id, None)
            self._tables_freed.add(seq_id)
        for block_id in reversed(self._tables.pop(seq_id, [])):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        self._hashed_upto.pop(seq_id, None)
        self._salts.pop(seq_id, None)
