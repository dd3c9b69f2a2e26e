"""The native paged attention's tiled prompt path (kernels/cpu/attention_tiles.h) against the ref.

Chunks of more than one query run as tiles of 32 queries x 64 keys; these shapes put the tile
edges everywhere: prompts of several query and key tiles, odd lengths, chunks whose cached
context ends mid-tile, decodes mixed in, head_dim 16 to 128 and 1 to 6 query heads per KV head.
Unused cache rows are NaN (int8: NaN scales), so a read past a sequence's end shows.
"""

from __future__ import annotations

import pytest
import torch

from llmc.kernels.amx import AMX_OVERRIDE
from llmc.kernels.attention import paged_attention_cpu, paged_attention_ref
from paged_layout import poisoned_caches
from test_native_int8_kv import check_attention
from test_native_kernels import assert_matches

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


@pytest.mark.parametrize("path", ["f32", "bf16", "bf16-no-amx"])
def test_scores_rising_tile_after_tile(path, monkeypatch):
    """Keys that grow with their position (times 1 + p / 32): each 64-key tile's largest score passes
    the last tile's by more than the softmax reference may trail a row's max (attention_tiles.h's kLag),
    so the rows rescale their earlier output on most tiles, which random keys seldom make them do.
    bf16 runs on AMX where it is usable and on the AVX-512 tiles."""
    dtype = torch.float32 if path == "f32" else torch.bfloat16
    if path == "bf16-no-amx":
        monkeypatch.setenv(AMX_OVERRIDE, "off")
    lens, chunks = [300, 130], [300, 65]
    clean, poisoned, tables = poisoned_caches(lens, 3, 64, dtype, dtype, 16, seed=18)
    for s, n in enumerate(lens):
        for p in range(n):
            for cache in (clean, poisoned):
                cache[1, 0, tables[s, p // 16], :, p % 16] *= 1 + p / 32
    q = torch.randn(sum(chunks), 9 * 64, generator=torch.Generator().manual_seed(19)).to(dtype)
    qsl = torch.tensor([0, chunks[0], sum(chunks)], dtype=torch.int32)
    args = (tables, torch.tensor(lens, dtype=torch.int32), qsl, 1)
    got = paged_attention_cpu(q, poisoned, *args, 0.125)
    want = paged_attention_ref(q, clean, *args, 64, 0.125)
    exact = paged_attention_ref(q.double(), clean.double(), *args, 64, 0.125)
    assert_matches(got, want, exact, dtype, max(lens))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_kernel_matches_ref(dtype):
    """The one-query-at-a-time kernel, kept as the benchmarks' baseline, means the same."""
    lens, chunks = [100, 9, 40], [100, 1, 17]
    check_attention(lens, chunks, 9, 3, 64, torch.int8, dtype, seed=13, kernel=torch.ops.llmc.paged_attention_rows)
    check_attention(lens, chunks, 9, 3, 64, dtype, dtype, seed=13, kernel=torch.ops.llmc.paged_attention_rows)


# window 1 (only itself), 16 (a block exactly), 64 (a key tile exactly), 37 (mid-block); softcap
# small enough to bite (scores here have a standard deviation of about 3)
WINDOWS = [dict(window=1), dict(window=16), dict(window=64), dict(window=37), dict(softcap=1.5),
           dict(window=37, softcap=1.5)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("options", WINDOWS, ids=str)
def test_window_and_softcap_match_ref(dtype, cache, options):
    """Prompts and chunks over a cached context with decodes mixed in; blocks before every
    query's window hold NaN (check_attention), so a read of one shows."""
    lens, chunks = [200, 130, 40, 9, 300], [200, 33, 1, 9, 77]
    check_attention(lens, chunks, 9, 3, 64, cache_type(cache, dtype), dtype, seed=14, **options)


@pytest.mark.parametrize("options", [dict(window=16), dict(window=37, softcap=1.5)], ids=str)
def test_rows_kernel_window_and_softcap_match_ref(options):
    lens, chunks = [100, 9, 40], [100, 1, 17]
    for cache_dtype, dtype in [(torch.float32, torch.float32), (torch.int8, torch.bfloat16)]:
        check_attention(lens, chunks, 9, 3, 64, cache_dtype, dtype, seed=15,
                        kernel=torch.ops.llmc.paged_attention_rows, **options)


@pytest.mark.parametrize("cache_dtype,dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.int8, torch.bfloat16)], ids=["f32", "bf16", "int8-bf16"])
def test_head_dim_256(cache_dtype, dtype):
    """Gemma's head_dim, with its window and softcap and without."""
    lens, chunks = [90, 20, 33], [90, 1, 5]
    check_attention(lens, chunks, 4, 2, 256, cache_dtype, dtype, seed=16)
    check_attention(lens, chunks, 4, 2, 256, cache_dtype, dtype, seed=16, window=32, softcap=2.0)
