"""BlockManager: the paged KV cache's allocator, in pure Python (no torch).

The cache is `num_blocks` blocks of `block_size` token slots. A sequence owns a list of blocks
(its block table); token i of the sequence lives in slot `table[i // block_size] * block_size
+ i % block_size`. Blocks are handed out from a free list and returned when the sequence ends.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        """Whether the sequence can grow to `num_tokens` tokens with the free blocks left."""
        have = len(self._tables.get(seq_id, []))
        return self.blocks_needed(num_tokens) - have <= len(self._free)

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grow the sequence's block table to hold `num_tokens` tokens; return the table."""
        table = self._tables.setdefault(seq_id, [])
        missing = self.blocks_needed(num_tokens) - len(table)
        if missing > len(self._free):
            raise MemoryError(f"sequence {seq_id} needs {missing} more KV blocks, {len(self._free)} are free")
        table.extend(self._free.popleft() for _ in range(max(missing, 0)))
        return table

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables[seq_id]

    def slot(self, seq_id: int, position: int) -> int:
        table = self._tables[seq_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def free(self, seq_id: int) -> None:
        """Return every block of the sequence to the free list."""
        self._free.extend(self._tables.pop(seq_id, []))
