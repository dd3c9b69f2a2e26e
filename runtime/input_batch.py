"""A persistent input batch: the step metadata of `build_step_inputs`, built from block tables kept
on the host across steps (vLLM V1's "persistent batch" idea, written for our BlockManager).

`build_step_inputs` rebuilds every step from scratch in Python: a `slot()` call per token and a
copy of every scheduled sequence's whole block table, O(context / block_size) Python ints per
sequence per step. `InputBatch` keeps one row per live sequence in a numpy array instead:
  block_table   [rows, width] int32   row r: its sequence's block table; 0 past `num_blocks[r]`
  num_blocks    [rows]        int32   valid entries of each row
Before each step it applies the BlockManager's `take_table_changes()`: a changed sequence's
entries from the first changed index on are copied in (appends, copy-on-write replacements, a
trim's shorter table, a whole table after `allocate`), and a freed sequence's row is zeroed and
given back. Rows and width grow by doubling, never shrink.

`build(chunks)` then computes the step vectorised: positions by np.repeat / arange over the chunks'
starts and lengths, slot_mapping = table[row, pos // block_size] * block_size + pos % block_size by
fancy indexing, block_tables = table[rows, :width]. Python work per step: O(chunks + step tokens)
(the token ids come from `Sequence.step_ids`) plus the changed entries; nothing proportional to a
sequence's context. A decode step (one token and its logits per sequence) takes the same values from
a few Python ints per sequence instead (`_build_decode`): after a forward has streamed the weights
through the caches, each vectorised call costs 10-25 us. One InputBatch per BlockManager:
`take_table_changes()` hands the changes to whoever calls it. The result equals
`build_step_inputs(chunks, blocks)` exactly (dtypes, shapes, values); `entries_copied` counts the
table entries copied in, for tests and profiles.
"""

from __future__ import annotations

import numpy as np
import torch

from .block_manager import BlockManager
from .scheduler import Chunk
from .step_inputs import StepInputs


class InputBatch:
    """Block tables of the live sequences, one row each, kept in step with a BlockManager."""

    def __init__(self, blocks: BlockManager, max_rows: int = 64, max_width: int = 64):
        if max_rows < 1 or max_width < 1:
            raise ValueError(f"max_rows={max_rows} and max_width={max_width} must be at least 1")
        self.blocks = blocks
        self.block_table = np.zeros((max_rows, max_width), dtype=np.int32)
        self.num_blocks = np.zeros(max_rows, dtype=np.int32)
        self._rows: dict[int, int] = {}                     # seq_id -> its row
        self._free_rows = list(range(max_rows - 1, -1, -1))  # a stack: the lowest row on top
        self.entries_copied = 0                             # block-table entries copied in, in all

    @property
    def num_rows(self) -> int:
        return self.block_table.shape[0]

    @property
    def width(self) -> int:
        return self.block_table.shape[1]

    @property
    def seq_ids(self) -> set[int]:
        """The sequences that hold a row."""
        return set(self._rows)

    def row(self, seq_id: int) -> int:
        """The sequence's row (KeyError when it has none)."""
        return self._rows[seq_id]

    # ------------------------------------------------------------ table sync

    def sync(self) -> None:
        """Apply the BlockManager's table changes since the last sync: freed rows first (a sequence
        freed and allocated again since gets a new row), then each changed table's new entries."""
        changes = self.blocks.take_table_changes()
        for seq_id in changes.freed:
            self._release(seq_id)
        for seq_id, first in changes.changed.items():
            self._copy_from(seq_id, first)

    def _release(self, seq_id: int) -> None:
        """Zero the sequence's row and give it back (a sequence this batch never held is ignored)."""
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self.block_table[row, :self.num_blocks[row]] = 0
            self.num_blocks[row] = 0
            self._free_rows.append(row)

    def _copy_from(self, seq_id: int, first: int) -> None:
        """Copy the sequence's table entries from `first` on into its row (a new row: all of them);
        zero the entries a shorter table no longer has."""
        row = self._rows.get(seq_id)
        if row is None:
            row, first = self._take_row(seq_id), 0
        table = self.blocks.block_table(seq_id)
        old, new = int(self.num_blocks[row]), len(table)
        self._ensure_width(new)
        if new > first:
            self.block_table[row, first:new] = table[first:]
            self.entries_copied += new - first
        if old > new:
            self.block_table[row, new:old] = 0
        self.num_blocks[row] = new

    def _take_row(self, seq_id: int) -> int:
        if not self._free_rows:
            self._grow(2 * self.num_rows, self.width)
        row = self._free_rows.pop()
        self._rows[seq_id] = row
        return row

    def _ensure_width(self, width: int) -> None:
        if width > self.width:
            self._grow(self.num_rows, max(width, 2 * self.width))

    def _grow(self, rows: int, width: int) -> None:
        """Reallocate to [rows, width], keeping every row's entries; new rows go on the free stack."""
        table = np.zeros((rows, width), dtype=np.int32)
        table[:self.num_rows, :self.width] = self.block_table
        num_blocks = np.zeros(rows, dtype=np.int32)
        num_blocks[:self.num_rows] = self.num_blocks
        self._free_rows[:0] = range(rows - 1, self.num_rows - 1, -1)   # below the current free rows
        self.block_table, self.num_blocks = table, num_blocks

    # ----------------------------------------------------------------- build

    def build(self, chunks: list[Chunk]) -> StepInputs:
        """Host metadata for computing tokens [start, end) of each chunk's sequence in one step:
        equal to `build_step_inputs(chunks, self.blocks)` (see step_inputs.py for the fields)."""
        assert chunks, "a step has at least one chunk"
        self.sync()
        if all(c.end - c.start == 1 and c.num_logits == 1 for c in chunks):
            return self._build_decode(chunks)
        n, bs = len(chunks), self.blocks.block_size
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=n)
        ends = np.fromiter((c.end for c in chunks), dtype=np.int64, count=n)
        num_logits = np.fromiter((c.num_logits for c in chunks), dtype=np.int64, count=n)
        rows = np.fromiter((self._rows[c.seq.seq_id] for c in chunks), dtype=np.int64, count=n)
        lengths = ends - starts                                             # [S]
        query_start_loc = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=query_start_loc[1:])                         # [S+1]
        positions = _ranges(starts, lengths)                                # [T]
        token_rows = np.repeat(rows, lengths)                               # [T]
        blocks = self.block_table[token_rows, positions // bs].astype(np.int64)
        slot_mapping = blocks * bs + positions % bs                         # [T]
        width = int(self.num_blocks[rows].max())
        block_tables = np.ascontiguousarray(self.block_table[rows, :width])  # [S, width], a copy
        logits_indices = _ranges(query_start_loc[1:] - num_logits, num_logits)  # [R]
        ids = [t for c in chunks for t in c.seq.step_ids(c.start, c.end)]
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.from_numpy(positions),
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)),
            seq_lens=torch.from_numpy(ends.astype(np.int32)),
            slot_mapping=torch.from_numpy(slot_mapping),
            block_tables=torch.from_numpy(block_tables),
            logits_indices=torch.from_numpy(logits_indices),
        )

    def _build_decode(self, chunks: list[Chunk]) -> StepInputs:
        """`build` of a step of one token and its logits per sequence (a decode step), the same values
        from a few Python ints per sequence in two numpy arrays, each field a view of one: after a
        forward pass has streamed the weights through the caches, each vectorised pass of the
        general path, and each kind of call, costs ~10-25 us (a torch slice more than a numpy one)."""
        bs, table, n = self.blocks.block_size, self.block_table, len(chunks)
        rows = [self._rows[c.seq.seq_id] for c in chunks]
        positions = [c.start for c in chunks]
        ids = [c.seq.step_ids(c.start, c.end)[0] for c in chunks]
        slots = [int(table[r, p // bs]) * bs + p % bs for r, p in zip(rows, positions)]
        longs = np.array(ids + positions + slots + list(range(n)), dtype=np.int64)
        ints = np.array(list(range(n + 1)) + [p + 1 for p in positions], dtype=np.int32)
        tables = table[rows, :max(int(self.num_blocks[r]) for r in rows)]     # [S, width], a copy
        views = dict(input_ids=longs[:n], positions=longs[n:2 * n], slot_mapping=longs[2 * n:3 * n],
                     logits_indices=longs[3 * n:], query_start_loc=ints[:n + 1], seq_lens=ints[n + 1:],
                     block_tables=tables)
        return StepInputs(**{name: torch.from_numpy(v) for name, v in views.items()})


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of range(starts[i], starts[i] + lengths[i]) over i, as int64."""
    total = int(lengths.sum())
    offsets = np.cumsum(lengths) - lengths                              # where each range begins
    return np.repeat(starts - offsets, lengths) + np.arange(total, dtype=np.int64)
