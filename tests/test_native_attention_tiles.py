"""The native paged attention's tiled prompt path (kernels/cpu/attention_tiles.h) against the ref.

Chunks of more than one query run as tiles of 32 queries x 64 keys; these shapes put the tile
edges everywhere: prompts of several query and key tiles, odd lengths, chunks whose cached
context ends mid-tile, decodes mixed in, head_dim 16 to 128 and 1 to 6 query heads per KV head.
Unused cache rows are NaN (int8: NaN scales), so a read past a sequence's end shows.
"""

from __future__ import annotations

import pytest
import torch

from test_native_int8_kv import check_attention

DTYPES = [torch.float32, torch.bfloat16]
CACHES = ["float", "int8"]


def cache_type(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.int8 if name == "int8" else dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache", CACHES)
def test_prompts_of_several_tiles(dtype, cache):
    """Whole prompts: 200 (7 query tiles, 4 key tiles), 64 (one tile exactly), 65, 2, 33."""
    lens = [200, 64, 65, 2, 33]
    check_attention(lens, lens, 9, 3, 64, cache_type(cache, dtype), dtype, seed=11)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache", CACHES)
def test_chunks_over_cached_context_mixed_with_decodes(dtype, cache):
    """Chunked prefill whose context ends mid-block and mid-tile, next to single decode tokens."""
    lens, chunks = [300, 5, 130, 1, 97, 64, 250], [77, 1, 3, 1, 32, 63, 1]
    check_attention(lens, chunks, 9, 3, 64, cache_type(cache, dtype), dtype, seed=12)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 32), (8, 2, 128), (6, 1, 16), (2, 1, 80)])
def test_other_head_shapes(heads, kv_heads, head_dim):
    """GQA groups 1, 4, 6 and 2; head_dim 16, 32, 80 (not a power of two) and 128."""
    lens, chunks = [150, 40, 9], [150, 23, 1]
    check_attention(lens, chunks, heads, kv_heads, head_dim, torch.float32, torch.float32, seed=head_dim)
    check_attention(lens, chunks, heads, kv_heads, head_dim, torch.int8, torch.bfloat16, seed=head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_kernel_matches_ref(dtype):
    """The one-query-at-a-time kernel, kept as the benchmarks' baseline, means the same."""
    lens, chunks = [100, 9, 40], [100, 1, 17]
    check_attention(lens, chunks, 9, 3, 64, torch.int8, dtype, seed=13, kernel=torch.ops.llmc.paged_attention_rows)
    check_attention(lens, chunks, 9, 3, 64, dtype, dtype, seed=13, kernel=torch.ops.llmc.paged_attention_rows)
