"""Causal attention over packed tokens, with and without the paged KV cache.

Layouts (tokens of all sequences flattened, heads packed per token):
  q            [T, H * D]         k, v   [T, KVH * D]     (H a multiple of KVH: grouped queries)
  kv_cache     [L, 2, NB, BS, KVH, D]   (layer, key/value, block, offset in block, head, dim)
  slot_mapping [T] int: block * BS + offset where token t's K/V go; negative = padding, skipped
  block_tables [S, MB] int: the blocks of each sequence, in order (padding entries unused)
  seq_lens     [S] int: tokens of each sequence in the cache after this step's writes
  query_start_loc [S + 1] int: sequence s owns query rows qsl[s] .. qsl[s+1]-1; those are its
               last tokens, so query i of a chunk of n sits at position seq_len - n + i
Scores are scaled by `scale` and softmaxed in fp32 (by SDPA); a query sees keys at positions
<= its own. Returns [T, H * D] in q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    return x.view(x.shape[0], -1, head_dim)                                 # [T, H, D]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float, causal: bool = False) -> torch.Tensor:
    """q [n, H, D], k/v [L, KVH, D] -> [n, H, D]; mask [n, L] bool (True = attend)."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc: torch.Tensor,
                  head_dim: int, scale: float) -> torch.Tensor:
    """Causal attention within each packed sequence (a prompt with no earlier context)."""
    qh, kh, vh = _heads(q, head_dim), _heads(k, head_dim), _heads(v, head_dim)
    out = torch.empty_like(qh)
    bounds = query_start_loc.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            out[start:end] = _sdpa(qh[start:end], kh[start:end], vh[start:end], None, scale, causal=True)
    return out.view(q.shape)


def kv_write_ref(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor, layer: int) -> torch.Tensor:
    """Store each token's K and V at its slot of `layer`, in place; returns the cache."""
    kvh, head_dim = kv_cache.shape[-2:]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    for which, x in ((0, k), (1, v)):
        flat = kv_cache[layer, which].view(-1, kvh, head_dim)              # [NB*BS, KVH, D]
        flat[slots] = x.view(-1, kvh, head_dim)[valid].to(kv_cache.dtype)
    return kv_cache


def _gather_context(kv_cache: torch.Tensor, layer: int, table: torch.Tensor, length: int):
    """Keys and values [length, KVH, D] of one sequence, read through its block table."""
    block_size = kv_cache.shape[3]
    blocks = table[: (length + block_size - 1) // block_size].long()
    k = kv_cache[layer, 0, blocks].flatten(0, 1)[:length]
    v = kv_cache[layer, 1, blocks].flatten(0, 1)[:length]
    return k, v


def paged_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, layer: int,
                        head_dim: int, scale: float) -> torch.Tensor:
    """Each sequence's query chunk attends causally to its whole cached context."""
    qh = _heads(q, head_dim)
    out = torch.empty_like(qh)
    bounds, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        n, length = end - start, lens[s]
        if n == 0:
            continue
        k, v = _gather_context(kv_cache, layer, block_tables[s], length)
        q_pos = torch.arange(length - n, length, device=q.device)[:, None]   # [n, 1]
        mask = torch.arange(length, device=q.device)[None, :] <= q_pos        # [n, L]
        out[start:end] = _sdpa(qh[start:end], k.to(q.dtype), v.to(q.dtype), mask, scale)
    return out.view(q.shape)


def paged_decode_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, layer: int, head_dim: int,
                               scale: float) -> torch.Tensor:
    """One query per sequence (the newest token) over its cached context, batched.

    Query heads are grouped by the KV head they share ([S, KVH, G, D]), so K and V are read
    once per KV head rather than repeated for every query head.
    """
    num_seqs, kv_heads = q.shape[0], kv_cache.shape[4]
    tables = block_tables.long()
    k = kv_cache[layer, 0][tables].flatten(1, 2).to(q.dtype)              # [S, L, KVH, D]
    v = kv_cache[layer, 1][tables].flatten(1, 2).to(q.dtype)
    qg = q.view(num_seqs, kv_heads, -1, head_dim)                           # [S, KVH, G, D]
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() * scale        # [S, KVH, G, L]
    beyond = torch.arange(k.shape[1], device=q.device)[None, :] >= seq_lens[:, None].long()
    probs = torch.softmax(scores.masked_fill(beyond[:, None, None, :], float("-inf")), dim=-1)
    out = torch.matmul(probs.to(q.dtype), v.permute(0, 2, 1, 3))            # [S, KVH, G, D]
    return out.reshape(num_seqs, -1)
