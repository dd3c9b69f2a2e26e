"""The native paged attention's decode path (kernels/cpu/attention_decode.h: one query per
sequence) against the ref, on one thread and on two: with 4 or more decodes per thread an item
is a whole sequence (all its KV heads), with fewer one KV head of it (paged_attention.cpp).

Its edges: the 16 scores of a block reduced together (a short last block: lengths 1, 15, 16,
17, 33, 300 end everywhere in a block and in a 64-key softmax tile), G = 1..8 query heads per
KV head and more than 8 (the rows' accumulators in registers, 8 at a time), head_dim 64 and 128
(bf16 straight into vdpbf16ps) and 16, 80 (bf16 widened: not a multiple of 32), f32, bf16 and
int8 caches. Blocks are scattered over the cache and every row no sequence owns is NaN.
"""

from __future__ import annotations

import pytest
import torch

from test_native_int8_kv import check_attention

LENS = [1, 15, 16, 17, 33, 300]
CACHES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.int8, torch.float32),
          (torch.int8, torch.bfloat16)]


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """The intra-op threads, restored after the test."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def check_decode(lens, groups, kv_heads, head_dim, cache_dtype, dtype, seed):
    check_attention(lens, [1] * len(lens), groups * kv_heads, kv_heads, head_dim, cache_dtype, dtype, seed=seed)


@pytest.mark.parametrize("cache_dtype,dtype", CACHES, ids=["f32", "bf16", "int8-f32", "int8-bf16"])
@pytest.mark.parametrize("groups", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_matches_ref(cache_dtype, dtype, groups, head_dim, threads):
    check_decode(LENS, groups, 2, head_dim, cache_dtype, dtype, seed=groups + head_dim)


@pytest.mark.parametrize("cache_dtype,dtype", CACHES, ids=["f32", "bf16", "int8-f32", "int8-bf16"])
@pytest.mark.parametrize("groups,head_dim", [(3, 16), (5, 80), (10, 32), (9, 48)])
def test_decode_other_shapes_match_ref(cache_dtype, dtype, groups, head_dim, threads):
    """head_dim not a multiple of 32 or 64; 9 and 10 rows (two register blocks of rows)."""
    check_decode([300, 17, 1, 64, 130], groups, 1, head_dim, cache_dtype, dtype, seed=groups)


def test_decode_reads_nothing_past_a_sequence_end_after_a_tile(threads):
    """A sequence one key past two softmax tiles, next to one that fills its last block, in a
    cache whose unowned rows are NaN: a read past either end would turn the output NaN."""
    check_decode([129, 128, 65], 3, 3, 64, torch.bfloat16, torch.bfloat16, seed=5)
    check_decode([129, 128, 65], 3, 3, 64, torch.int8, torch.float32, seed=5)


@pytest.mark.parametrize("cache_dtype,dtype", CACHES, ids=["f32", "bf16", "int8-f32", "int8-bf16"])
def test_many_decodes_as_whole_sequences_match_ref(cache_dtype, dtype, threads):
    """Nine decodes (whole-sequence items on up to two threads) of 3 KV heads next to each other."""
    check_decode([300, 1, 16, 17, 70, 129, 15, 200, 33], 3, 3, 64, cache_dtype, dtype, seed=9)


@pytest.mark.parametrize("cache_dtype,dtype", CACHES, ids=["f32", "bf16", "int8-f32", "int8-bf16"])
@pytest.mark.parametrize("options", [dict(window=1), dict(window=16), dict(window=64), dict(window=50),
                                     dict(softcap=1.5), dict(window=50, softcap=1.5)], ids=str)
def test_decode_window_and_softcap_match_ref(cache_dtype, dtype, options, threads):
    """Window 1, a block, a softmax tile exactly and mid-block, longer and shorter than the
    sequences; the blocks before each window hold NaN (check_attention): they must not be read."""
    check_attention([300, 17, 1, 64, 130, 65], [1] * 6, 6, 2, 64, cache_dtype, dtype, seed=21, **options)


@pytest.mark.parametrize("cache_dtype,dtype", CACHES, ids=["f32", "bf16", "int8-f32", "int8-bf16"])
@pytest.mark.parametrize("head_dim", [256, 80])
def test_decode_head_dim_256(cache_dtype, dtype, head_dim, threads):
    """Gemma's head_dim (bf16 pairs: a multiple of 32) and 80 (not one), with a window and softcap
    and without."""
    check_decode([300, 17, 1, 64], 2, 2, head_dim, cache_dtype, dtype, seed=22)
    check_attention([300, 17, 1, 64], [1] * 4, 4, 2, head_dim, cache_dtype, dtype, seed=22, window=40, softcap=2.0)


@pytest.mark.parametrize("cache_dtype,dtype", CACHES, ids=["f32", "bf16", "int8-f32", "int8-bf16"])
@pytest.mark.parametrize("kv_heads", [1, 3])
def test_split_decodes_match_ref(cache_dtype, dtype, kv_heads, threads):
    """Decodes long enough to be split among two threads (attention_work.h's split_decodes,
    decode_splits.h merging the parts): one sequence, a whole item (all its KV heads) in 2 parts,
    ending mid-tile and on one; three sequences, one too short to split, so per-head items (3 or
    9), the two long ones' in 2 parts each; a window that leaves a first part nothing to read (its
    blocks NaN), and a softcap. On one thread nothing is split: the same check of the unsplit path."""
    check_decode([1100], 3, kv_heads, 64, cache_dtype, dtype, seed=31)
    check_decode([1024], 2, kv_heads, 128, cache_dtype, dtype, seed=32)
    check_decode([1100, 100, 600], 3, kv_heads, 64, cache_dtype, dtype, seed=33)
    check_attention([1100], [1], 3 * kv_heads, kv_heads, 64, cache_dtype, dtype, seed=34, window=300, softcap=1.5)
