"""Shuffled block tables for paged-attention tests: each sequence's blocks scattered over the cache."""

from __future__ import annotations

import torch


def shuffled_block_tables(lens: list[int], block_size: int, generator: torch.Generator,
                          spare: int) -> tuple[list[list[int]], torch.Tensor, int]:
    """Per-sequence block lists, the padded int32 block table, and the number of cache blocks
    (`spare` more than needed, so some blocks belong to nobody)."""
    needed = [-(-n // block_size) for n in lens]
    order = torch.randperm(sum(needed) + spare, generator=generator).tolist()
    tables, at = [], 0
    for n in needed:
        tables.append(order[at:at + n])
        at += n
    width = max(needed)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return tables, block_tables, len(order)
