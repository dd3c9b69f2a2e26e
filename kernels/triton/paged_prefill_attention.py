"""Paged variable-length causal attention in Triton for a mixed step: prompt chunks (over
context already in the cache) and decode tokens of several sequences in one launch.

Contract: kernels/triton/paged_kv.py (layouts, dtypes, limits), plus
  query_start_loc [S + 1] int32/int64: sequence s owns query rows qsl[s] .. qsl[s+1]-1, its last
  n = qsl[s+1] - qsl[s] tokens, so query i sits at position seq_len - n + i and sees the keys at
  positions <= its own (and, with a window, > its own - window). All K/V, this step's included,
  are already in the cache. qsl[S] = T and n <= seq_len are the caller's to keep (checking them
  would need a host sync).
The meaning is `paged_attention_ref` (window and softcap too: paged_kv.py).

Tiling (vLLM's unified attention): grid (T // BLOCK_Q + S, KVH). A program takes BLOCK_Q
queries of one sequence times the G = H / KVH heads sharing a KV head: row r of its
[BLOCK_M, D_PAD] tile is query r // G_PAD, head r % G_PAD (G_PAD = next_pow2(G), BLOCK_M =
BLOCK_Q * G_PAD = max(ROWS, G_PAD)), so one K/V tile load feeds a tl.dot for the whole group.
Sequence s's query blocks are numbered from qsl[s] // BLOCK_Q + s, which bounds the total by
T // BLOCK_Q + S from shapes alone; a program finds its sequence by binary search over
query_start_loc and returns if its block is past the sequence's queries. Keys are visited in
TILE steps from the tile holding the block's first query's window start (0 without a window) up
to the block's last query position (causal tiles beyond it are skipped), with an online softmax
in fp32. ROWS halves for D_PAD 256 (Gemma), so a program's fp32 accumulator stays [64, 128]-sized.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmc.kernels.attention import paged_attention_ref
from llmc.kernels.triton.paged_kv import (INDEX_DTYPES, check_index_tensor, check_options, check_paged_inputs,
                                          load_kv_tile, online_softmax_step, qk_scale, window_start)

__all__ = ["paged_attention_ref", "paged_prefill_attention_triton"]

TILE = 32                 # keys per inner step: tl.dot's K dim in p @ v (>= 16 on a GPU; fp32: half)
ROWS = 64                 # query rows (queries x heads of a group) per program (fp32: half, prefill_config)


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The last sequence s whose first query block, qsl[s] // BLOCK_Q + s, is <= q_block."""
    left: tl.int32 = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        first_block = tl.load(query_start_loc_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        if first_block <= q_block:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _prefill_kernel(
    q_ptr,            # [T, H * D] queries of all sequences, packed (row stride stride_q)
    k_cache_ptr,      # [NB, KVH, BS, D] keys of this layer (int8: rows of D + 4 bytes)
    v_cache_ptr,      # [NB, KVH, BS, D] values of this layer (likewise)
    block_tables_ptr,  # [S, MB] block ids of each sequence
    seq_lens_ptr,     # [S] keys of each sequence, this step's included
    query_start_loc_ptr,  # [S + 1] first query row of each sequence
    out_ptr,          # [T, H * D] out, q's dtype (row stride stride_out)
    num_seqs, qk_scale, window, softcap_log2, stride_q, stride_out, stride_table, stride_block, stride_head,
    stride_offset,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, D_PAD: tl.constexpr, TILE: tl.constexpr, KV_INT8: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    q_block, kv_head = tl.program_id(0), tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)                         # int32 or int64 in memory
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:
        return                                                   # a spare program of the upper bound

    rows, offs_d = tl.arange(0, BLOCK_Q * G_PAD), tl.arange(0, D_PAD)
    query = local_block * BLOCK_Q + rows // G_PAD                                     # [BLOCK_M] in the chunk
    heads = kv_head * GROUP + rows % G_PAD
    row_mask, d_mask = (query < q_len) & (rows % G_PAD < GROUP), offs_d < HEAD_DIM
    tokens = (q_start + query).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_q + heads[:, None] * HEAD_DIM + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)                 # [BLOCK_M, D_PAD]

    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    positions = seq_len - q_len + query                                               # [BLOCK_M]
    end = tl.minimum(seq_len, seq_len - q_len + tl.minimum((local_block + 1) * BLOCK_Q, q_len))
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table
    k_head, v_head = k_cache_ptr + kv_head * stride_head, v_cache_ptr + kv_head * stride_head
    lowest = tl.where(window > 0, positions - window, -1)                          # [BLOCK_M] keys <= it: hidden
    first_key = window_start(seq_len - q_len + local_block * BLOCK_Q, window)        # keys before: not read
    start = first_key // TILE * TILE
    m = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], tl.float32)
    for tile_start in range(start, end, TILE):
        keys = tile_start + tl.arange(0, TILE)                                        # [TILE]
        key_mask = (keys < end) & (keys >= first_key)
        k, v = load_kv_tile(table_row, k_head, v_head, keys, key_mask, offs_d, d_mask, stride_block,  # [TILE, D_PAD]
                            stride_offset, BLOCK_SIZE, HEAD_DIM, KV_INT8)
        k, v = k.to(q.dtype), v.to(q.dtype)                                           # no-op for a float cache
        visible = key_mask[None, :] & (keys[None, :] <= positions[:, None]) & (keys[None, :] > lowest[:, None])
        m, l, acc = online_softmax_step(q, k, v, visible, m, l, acc, qk_scale, softcap_log2, SOFTCAP)

    o = acc / tl.where(l == 0.0, 1.0, l)[:, None]                                     # each row sees its own key
    tl.store(out_ptr + tokens[:, None] * stride_out + heads[:, None] * HEAD_DIM + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def paged_prefill_attention_triton(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                                   seq_lens: torch.Tensor, query_start_loc: torch.Tensor, layer: int,
                                   scale: float, out: torch.Tensor | None = None, *, window: int = 0,
                                   softcap: float = 0.0) -> torch.Tensor:
    """paged_attention_ref's result [T, H * D] in q's dtype, written into `out` if given."""
    shape = check_paged_inputs(q, kv_cache, block_tables, seq_lens, layer, out)
    window, softcap_log2 = check_options(window, softcap)
    if query_start_loc.shape != (shape.num_seqs + 1,) or query_start_loc.dtype not in INDEX_DTYPES:
        raise ValueError(f"query_start_loc must be [{shape.num_seqs + 1}] int32/int64; got "
                         f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    check_index_tensor("query_start_loc", query_start_loc, q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if q.shape[0] == 0 or shape.num_seqs == 0:
        return out
    group_padded = triton.next_power_of_2(shape.group)
    config = prefill_config(q.dtype, shape.head_dim_padded, group_padded)
    k_cache, v_cache = kv_cache[layer, 0], kv_cache[layer, 1]                       # [NB, KVH, BS, D]
    _prefill_kernel[(q.shape[0] // config['BLOCK_Q'] + shape.num_seqs, shape.kv_heads)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        shape.num_seqs, qk_scale(scale), window, softcap_log2, q.stride(0), out.stride(0), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=shape.group, HEAD_DIM=shape.head_dim, BLOCK_SIZE=shape.block_size, G_PAD=group_padded,
        D_PAD=shape.head_dim_padded,
        KV_INT8=kv_cache.dtype == torch.int8, SOFTCAP=softcap_log2 > 0, **config)
    return out


def prefill_config(dtype: torch.dtype, head_dim_padded: int, group_padded: int) -> dict[str, int]:
    """BLOCK_Q, TILE and the launch's warps and stages, chosen so a program fits sm_90's registers
    without a spill (kernels/triton/aot_compile.py checks every compile).
    fp16/bf16: ROWS query rows over 4 warps, TILE keys a step, 3 stages: the fp32 accumulator
    [64, D_PAD] is D_PAD / 2 registers a thread (64 at D_PAD 128; rows halved for D_PAD 256), the
    tensor-core dots read q and the K/V tile from shared memory.
    fp32: IEEE dots are FMAs whose operands a thread holds in registers (its rows of q over all of
    D_PAD, its K/V columns over the whole tile), and each pipeline stage keeps a dequantized K/V
    tile more in flight: ROWS // 2 rows, TILE // 2 keys, 8 warps, one stage take 70-80 registers
    at D_PAD 64 and 128, float or int8 cache; ROWS rows over 4 warps in 3 stages spilled 328-672 B
    (D_PAD 64) and 6-7 KB (D_PAD 128, where ptxas fell back to 32 registers), and any of the
    three cuts alone still spilled with an int8 cache at D_PAD 128."""
    rows = ROWS if head_dim_padded <= 128 else ROWS // 2
    if dtype == torch.float32:
        return dict(BLOCK_Q=max(rows // 2, group_padded) // group_padded, TILE=TILE // 2, num_warps=8, num_stages=1)
    return dict(BLOCK_Q=max(rows, group_padded) // group_padded, TILE=TILE, num_warps=4, num_stages=3)
