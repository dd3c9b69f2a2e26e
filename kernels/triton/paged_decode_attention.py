"""Paged decode attention in Triton: one query token per sequence, split-K over the context
(flash-decoding), grouped-query aware.

Contract: kernels/triton/paged_kv.py (layouts, dtypes, limits); the meaning is
`paged_decode_attention_ref`: sequence s's query (row s of q) attends to the seq_lens[s] keys of
its blocks (with a window, the last `window` of them; softcap: paged_kv.py). A sequence with
seq_len 0 (a padding row) reads no block and gets zeros.

Tiling:
  stage 1  grid (S, KVH, splits). The G = H / KVH query heads sharing a KV head are the rows of
           one [BLOCK_G, D_PAD] tile (BLOCK_G = max(16, next_pow2(G)), padded rows masked), so one
           K/V tile load feeds a single tl.dot for the whole group. Split j covers key positions
           [j * split_len, (j + 1) * split_len) of the sequence, in TILE-key steps from the
           window's start where that lies inside it, and writes its unnormalised fp32 output,
           running max and exp-sum to a workspace (an empty split, or one wholly before the
           window, reads nothing and writes acc 0, max -inf, sum 0).
  stage 2  grid (S, H): rescales each split by exp2(max_j - max), sums, divides by the total
           exp-sum (0 for an empty sequence: divides by 1 instead and writes zeros).
  one split  where `decode_splits` gives one (a large batch fills the GPU, or the block table is
           short), stage 1 divides by its own exp-sum and writes the output itself (SINGLE): the
           merge of one split is that division (weight exp2(max - max) = 1), so the result is the
           same and the step launches one kernel, not two. The choice is the shapes' (no sync).
  stage 1 alone  `paged_decode_attention_parts` launches stage 1 and returns the output (one split)
           or the workspace (`DecodeParts`), whose merge the O projection then takes as its GEMM's
           prologue (kernels/triton/gemm.py `merge_linear_triton`): attention and O in two launches.
Split rule (`decode_splits`), from shapes only so nothing syncs with the device and the launch
can be captured in a CUDA graph: the most context any row may have is MB * BS (block table
width times block size); use enough splits to put ~TARGET_PROGRAMS programs in flight, no more
than MAX_SPLITS, and none shorter than MIN_SPLIT_KEYS keys. Split lengths are whole tiles.
Workspace: fp32 [S, H, splits, D_PAD] plus two [S, H, splits], allocated per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmc.kernels.attention import paged_decode_attention_ref
from llmc.kernels.triton.paged_kv import (check_options, check_paged_inputs, load_kv_tile, online_softmax_step,
                                          qk_scale, window_start)

__all__ = ["DecodeParts", "decode_merge_ref", "decode_splits", "paged_decode_attention_parts",
           "paged_decode_attention_ref", "paged_decode_attention_triton"]

TILE = 32                 # keys per inner step: tl.dot's K dim in p @ v (>= 16 on a GPU)
MIN_SPLIT_KEYS = 64       # a split shorter than this costs more to merge than it saves
MAX_SPLITS = 16
TARGET_PROGRAMS = 264     # about two waves of an H100/H200's 132 SMs


def decode_splits(num_seqs: int, kv_heads: int, max_context: int) -> tuple[int, int]:
    """(number of splits, keys per split) for `max_context` = block table width * block size."""
    context = max(max_context, 1)
    by_length = triton.cdiv(context, MIN_SPLIT_KEYS)
    by_occupancy = triton.cdiv(TARGET_PROGRAMS, max(num_seqs * kv_heads, 1))
    splits = max(1, min(MAX_SPLITS, by_length, by_occupancy))
    split_len = triton.cdiv(triton.cdiv(context, splits), TILE) * TILE
    return triton.cdiv(context, split_len), split_len          # rounding to tiles may leave fewer splits


@triton.jit
def _decode_split_kernel(
    q_ptr,            # [S, H * D] one query per sequence (row stride stride_q)
    k_cache_ptr,      # [NB, KVH, BS, D] keys of this layer (int8: rows of D + 4 bytes)
    v_cache_ptr,      # [NB, KVH, BS, D] values of this layer (likewise)
    block_tables_ptr,  # [S, MB] block ids of each sequence
    seq_lens_ptr,     # [S] keys of each sequence
    part_acc_ptr,     # [S, H, splits, D_PAD] fp32 out: unnormalised sum of p * v per split
    part_max_ptr,     # [S, H, splits] fp32 out: the split's max score (log2 domain)
    part_sum_ptr,     # [S, H, splits] fp32 out: sum of exp2(score - max) over the split
    out_ptr,          # [S, H * D] out, q's dtype (row stride stride_out): written instead if SINGLE
    qk_scale, window, softcap_log2, split_len, stride_q, stride_table, stride_block, stride_head, stride_offset,
    stride_out,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr,
    D_PAD: tl.constexpr, TILE: tl.constexpr, KV_INT8: tl.constexpr, SOFTCAP: tl.constexpr,
    SINGLE: tl.constexpr,  # one split: normalise and write out (module docstring)
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_heads, num_splits = GROUP * tl.num_programs(1), tl.num_programs(2)
    rows, offs_d = tl.arange(0, BLOCK_G), tl.arange(0, D_PAD)
    row_mask, d_mask = rows < GROUP, offs_d < HEAD_DIM
    heads = kv_head * GROUP + rows                                                    # [BLOCK_G]
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_q + heads[:, None] * HEAD_DIM + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)                 # [BLOCK_G, D_PAD]

    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)                               # int32 or int64 in memory
    start = tl.maximum(split * split_len, window_start(seq_len - 1, window))      # keys before: not read
    end = tl.minimum(split * split_len + split_len, seq_len)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table
    k_head, v_head = k_cache_ptr + kv_head * stride_head, v_cache_ptr + kv_head * stride_head
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D_PAD], tl.float32)
    for tile_start in range(start, end, TILE):
        keys = tile_start + tl.arange(0, TILE)                                        # [TILE]
        key_mask = keys < end
        k, v = load_kv_tile(table_row, k_head, v_head, keys, key_mask, offs_d, d_mask, stride_block,  # [TILE, D_PAD]
                            stride_offset, BLOCK_SIZE, HEAD_DIM, KV_INT8)
        k, v = k.to(q.dtype), v.to(q.dtype)                                           # no-op for a float cache
        m, l, acc = online_softmax_step(q, k, v, key_mask[None, :], m, l, acc, qk_scale, softcap_log2, SOFTCAP)

    if SINGLE:                                                                        # the merge of one split
        o = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(out_ptr + seq.to(tl.int64) * stride_out + heads[:, None] * HEAD_DIM + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
    else:
        part = (seq * num_heads + heads) * num_splits + split                        # [BLOCK_G]
        tl.store(part_acc_ptr + part[:, None] * D_PAD + offs_d[None, :], acc, mask=row_mask[:, None])
        tl.store(part_max_ptr + part, m, mask=row_mask)
        tl.store(part_sum_ptr + part, l, mask=row_mask)


@triton.jit
def _decode_merge_kernel(
    part_acc_ptr,     # [S, H, splits, D_PAD] fp32: stage 1's unnormalised outputs
    part_max_ptr,     # [S, H, splits] fp32: their max scores
    part_sum_ptr,     # [S, H, splits] fp32: their exp-sums
    out_ptr,          # [S, H * D] out, q's dtype (row stride stride_out)
    num_splits, stride_out,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    seq, head = tl.program_id(0), tl.program_id(1)
    splits, offs_d = tl.arange(0, SPLITS_PAD), tl.arange(0, D_PAD)
    split_mask = splits < num_splits
    part = (seq * tl.num_programs(1) + head) * num_splits + splits                    # [SPLITS_PAD]
    m = tl.load(part_max_ptr + part, mask=split_mask, other=float("-inf"))
    l = tl.load(part_sum_ptr + part, mask=split_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * D_PAD + offs_d[None, :], mask=split_mask[:, None], other=0.0)
    m_max = tl.max(m, 0)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))              # empty split -> 0
    total = tl.sum(weight * l, 0)
    o = tl.sum(weight[:, None] * acc, 0) / tl.where(total == 0.0, 1.0, total)        # [D_PAD]
    tl.store(out_ptr + seq.to(tl.int64) * stride_out + head * HEAD_DIM + offs_d,
             o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@dataclass(frozen=True)
class DecodeParts:
    """Stage 1's workspace where the context takes more than one split: what the merge reads (stage
    2, or the O projection's prologue: kernels/triton/gemm.py `merge_linear_triton`)."""

    acc: torch.Tensor     # [S, H, splits, D_PAD] fp32: each split's unnormalised sum of p * v
    max: torch.Tensor     # [S, H, splits] fp32: its max score (log2 domain), -inf where it read no key
    sum: torch.Tensor     # [S, H, splits] fp32: its exp-sum
    head_dim: int         # D (D_PAD: the next power of two)
    dtype: torch.dtype    # the attention output's (q's): the merge rounds to it


def decode_merge_ref(parts: DecodeParts) -> torch.Tensor:
    """Stage 2's arithmetic in torch: the attention output [S, H * D] in parts.dtype (empty
    sequence: every split's max -inf and sum 0, so it divides by 1 and writes zeros)."""
    m_max = parts.max.amax(-1, keepdim=True)                                      # [S, H, 1]
    weight = torch.exp2(parts.max - torch.where(m_max == float("-inf"), 0.0, m_max))   # [S, H, splits]
    total = (weight * parts.sum).sum(-1, keepdim=True)                           # [S, H, 1]
    o = (weight[..., None] * parts.acc).sum(-2) / torch.where(total == 0.0, 1.0, total)   # [S, H, D_PAD]
    return o[..., :parts.head_dim].reshape(o.shape[0], -1).to(parts.dtype)


def paged_decode_attention_triton(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                                  seq_lens: torch.Tensor, layer: int, scale: float,
                                  out: torch.Tensor | None = None, *, window: int = 0,
                                  softcap: float = 0.0) -> torch.Tensor:
    """paged_decode_attention_ref's result [S, H * D] in q's dtype, written into `out` if given."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    parts = _split_stage(q, kv_cache, block_tables, seq_lens, layer, scale, out, window, softcap)
    if isinstance(parts, DecodeParts):
        num_seqs, heads, num_splits, d_pad = parts.acc.shape
        _decode_merge_kernel[(num_seqs, heads)](
            parts.acc, parts.max, parts.sum, out, num_splits, out.stride(0),
            HEAD_DIM=parts.head_dim, D_PAD=d_pad, SPLITS_PAD=triton.next_power_of_2(num_splits))
    return out


def paged_decode_attention_parts(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                                 seq_lens: torch.Tensor, layer: int, scale: float, *, window: int = 0,
                                 softcap: float = 0.0) -> torch.Tensor | DecodeParts:
    """Stage 1 alone (one launch): the output [S, H * D] where one split covers the context (SINGLE),
    else the workspace that the merge reads. Which one is the shapes' (`decode_splits`), never the
    data's, so a CUDA graph captures the same launches every replay."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return _split_stage(q, kv_cache, block_tables, seq_lens, layer, scale, out, window, softcap)


def _split_stage(q, kv_cache, block_tables, seq_lens, layer, scale, out, window, softcap) -> torch.Tensor | DecodeParts:
    """Checks the inputs, launches stage 1: `out` written (one split or no sequence) or the workspace."""
    shape = check_paged_inputs(q, kv_cache, block_tables, seq_lens, layer, out)
    window, softcap_log2 = check_options(window, softcap)
    if q.shape[0] != shape.num_seqs:
        raise ValueError(f"decode takes one query per sequence: q has {q.shape[0]} rows, block_tables "
                         f"{shape.num_seqs}")
    if shape.num_seqs == 0:
        return out
    num_splits, split_len = decode_splits(shape.num_seqs, shape.kv_heads, shape.max_blocks * shape.block_size)
    d_pad = shape.head_dim_padded
    part_acc = torch.empty(shape.num_seqs, shape.heads, num_splits, d_pad, dtype=torch.float32, device=q.device)
    part_max = torch.empty(shape.num_seqs, shape.heads, num_splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    k_cache, v_cache = kv_cache[layer, 0], kv_cache[layer, 1]                       # [NB, KVH, BS, D]
    _decode_split_kernel[(shape.num_seqs, shape.kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_acc, part_max, part_sum, out,
        qk_scale(scale), window, softcap_log2, split_len, q.stride(0), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), SINGLE=num_splits == 1,
        GROUP=shape.group, HEAD_DIM=shape.head_dim, BLOCK_SIZE=shape.block_size,
        BLOCK_G=max(16, triton.next_power_of_2(shape.group)), D_PAD=d_pad,
        KV_INT8=kv_cache.dtype == torch.int8, SOFTCAP=softcap_log2 > 0, **split_config(q.dtype))
    if num_splits == 1:
        return out
    return DecodeParts(part_acc, part_max, part_sum, shape.head_dim, q.dtype)


def split_config(dtype: torch.dtype) -> dict[str, int]:
    """Stage 1's TILE, warps and stages, chosen so a program fits sm_90's registers without a spill
    (kernels/triton/aot_compile.py checks every compile). fp16/bf16: TILE keys a step over 4 warps
    in 3 stages, the tensor-core dots reading the K/V tiles from shared memory. fp32: IEEE dots are
    FMAs whose operands a thread holds in registers (its K/V columns over the whole tile), and each
    pipeline stage keeps a dequantized K/V tile more in flight: 8 warps and one stage take 64-102
    registers (D_PAD 64 and 128, float or int8 cache); 4 warps in 3 stages spilled 404 B at D_PAD
    128 over an int8 cache, and either change alone still spilled (320 B; 152 B with TILE 16)."""
    if dtype == torch.float32:
        return dict(TILE=TILE, num_warps=8, num_stages=1)
    return dict(TILE=TILE, num_warps=4, num_stages=3)
