"""Paged-attention test layouts: each sequence's blocks scattered over the cache; caches whose
unused rows are NaN, so a kernel that reads one shows it."""

from __future__ import annotations

import torch

from llmc.kernels.attention import kv_write_ref

NAN_SCALE = torch.tensor([float("nan")]).view(torch.int8)          # an fp32 NaN's 4 bytes


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


def poisoned_caches(lens: list[int], kv_heads: int, head_dim: int, cache_dtype: torch.dtype,
                    dtype: torch.dtype, block_size: int, seed: int):
    """(clean, poisoned) 2-layer caches holding the same random K/V (of `dtype`) for each
    sequence's tokens in shuffled blocks; rows nobody owns are 0 in `clean`, NaN in `poisoned`."""
    g = torch.Generator().manual_seed(seed)
    tables, block_tables, num_blocks = shuffled_block_tables(lens, block_size, g, spare=2)
    row = head_dim + (4 if cache_dtype == torch.int8 else 0)
    clean = torch.zeros(2, 2, num_blocks, kv_heads, block_size, row, dtype=cache_dtype)
    if cache_dtype == torch.int8:
        poisoned = torch.randint(-127, 128, clean.shape, generator=g, dtype=torch.int8)
        poisoned[..., head_dim:] = NAN_SCALE
    else:
        poisoned = torch.full_like(clean, float("nan"))
    for s, n in enumerate(lens):
        slots = torch.tensor([tables[s][p // block_size] * block_size + p % block_size for p in range(n)])
        k, v = ((torch.randn(n, kv_heads * head_dim, generator=g) * 3).to(dtype) for _ in range(2))
        for cache in (clean, poisoned):
            kv_write_ref(cache, k, v, slots, layer=1)
    return clean, poisoned, block_tables
