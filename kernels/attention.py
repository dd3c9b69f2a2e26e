"""Causal attention over packed tokens, with and without the paged KV cache: the native CPU
launchers; the torch references are the op records' (compiler/ops/attention.py).

Layouts (tokens of all sequences flattened, heads packed per token):
  q            [T, H * D]         k, v   [T, KVH * D]     (H a multiple of KVH: grouped queries)
  kv_cache     [L, 2, NB, KVH, BS, D]   (layer, key/value, block, head, offset in block, dim):
               head-major blocks, so gathering a sequence's blocks per head yields [L, D] rows;
               an int8 cache is i8 [L, 2, NB, KVH, BS, D + 4], each row D codes and its fp32
               scale (kernels/quant.py): written quantized, read as code * scale
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

from llmc.compiler.ops.attention import attention_ref, kv_write_ref, paged_attention_ref, paged_decode_attention_ref

from .quant import cache_head_dim

__all__ = ["attention_ref", "kv_write_ref", "native_attention_fits", "paged_attention_cpu", "paged_attention_ref",
           "paged_decode_attention_cpu", "paged_decode_attention_ref", "run_paged_decode_attention"]


def native_attention_fits(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether kernels/cpu/paged_attention.cpp takes these inputs (else use the refs above): q f32
    or bf16 on the CPU, a cache of q's dtype or int8, block size 16, head_dim a multiple of 16."""
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and kv_cache.dtype in (q.dtype, torch.int8) and kv_cache.shape[4] == 16
            and cache_head_dim(kv_cache) > 0 and cache_head_dim(kv_cache) % 16 == 0)


def _check_native(q: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """The launchers' check: ValueError naming the inputs where the native kernel does not take them."""
    if not native_attention_fits(q, kv_cache):
        raise ValueError(f"native paged attention takes f32/bf16 q on the CPU, a cache of q's dtype or int8, "
                         f"block size 16 and head_dim a multiple of 16; got q {q.dtype}, "
                         f"cache {kv_cache.dtype} {tuple(kv_cache.shape)}")


def paged_attention_cpu(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, layer: int,
                        scale: float) -> torch.Tensor:
    """Launcher of the native kernel (kernels/cpu/paged_attention.cpp states its contract):
    paged_attention_ref's meaning, reading K/V blocks in place (an int8 cache's rows dequantized
    as they are read) with an online softmax."""
    _check_native(q, kv_cache)
    as_int = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
    return torch.ops.llmc.paged_attention(q.contiguous(), kv_cache, as_int(block_tables), as_int(seq_lens),
                                          as_int(query_start_loc), layer, scale)


def paged_decode_attention_cpu(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    """The decode case of `paged_attention_cpu`: one query per sequence (the kernel numbers them)."""
    _check_native(q, kv_cache)
    return run_paged_decode_attention(q, kv_cache, block_tables, seq_lens, layer, scale)


def run_paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    """`paged_decode_attention_cpu` for inputs that `native_attention_fits` has passed (the op
    table checks once, then runs this)."""
    return torch.ops.llmc.paged_decode_attention(q.contiguous(), kv_cache, block_tables.to(torch.int32).contiguous(),
                                                 seq_lens.to(torch.int32).contiguous(), layer, scale)
