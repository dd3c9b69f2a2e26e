"""Rotary embedding of Q and K fused with the paged K/V cache write, one Triton template.

Contract (kernels/rope_kv_write.py's `rope_kv_write_ref`, same tensors):
  tensors       (qkv, positions, kv_cache, slot_mapping) with qkv [T, (H + 2*KVH) * D] (q, k, v
                columns of a merged QKV GEMM), or (q, k, v, positions, kv_cache, slot_mapping) with
                q [T, H * D], k and v [T, KVH * D]; one float dtype, each row contiguous
  positions     [T] int32/int64
  kv_cache      [L, 2, NB, KVH, BS, D] (kernels/attention.py), any float dtype, dim stride 1
  slot_mapping  [T] int32/int64: block * BS + offset; negative = padding, no K/V written. A slot
                must lie inside the cache: it is not checked (that would need a host sync)
  inv_freq      [D / 2] fp32 from kernels/rope.py `rope_inv_freq`, so every scaling rule applies
Rotates q and k (rotate-half: y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin on each head's halves),
cos/sin and the rotation in fp32, from positions * inv_freq computed in the kernel. Stores the
rotated k and v of each token at its slot of `layer` (cast to the cache's dtype), in place, and
returns (rotated q [T, H * D] in q's dtype, kv_cache). One program per token, all its heads as one
[heads, D/2] tile; head_dim must be even, and any even head_dim (80, 96) is padded to a power of
two with masks. The launcher never reads a tensor's values (no host sync: CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..rope_kv_write import rope_kv_write_ref, unpack_inputs

__all__ = ["rope_kv_write_ref", "rope_kv_write_triton"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _rotate_heads(src_ptr, src_row_stride, t, cos, sin, HEADS: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Token t's HEADS heads, rotated: the two halves [BLOCK_H, BLOCK_HALF] each, fp32."""
    heads = tl.arange(0, BLOCK_H)[:, None]                                 # [BH, 1]
    dims = tl.arange(0, BLOCK_HALF)[None, :]                               # [1, BHALF]
    mask = (heads < HEADS) & (dims < HALF)
    first = src_ptr + t * src_row_stride + heads * (2 * HALF) + dims       # [BH, BHALF]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin, mask


@triton.jit
def _rope_kv_write_kernel(
    q_ptr,          # q [T, H*D], row stride stride_q: read
    k_ptr,          # k [T, KVH*D], row stride stride_k: read
    v_ptr,          # v [T, KVH*D], row stride stride_v: read
    positions_ptr,  # positions [T] int
    inv_freq_ptr,   # inv_freq [D/2] fp32
    slots_ptr,      # slot_mapping [T] int, negative = padding
    q_out_ptr,      # q_out [T, H*D], row stride stride_qo: the rotated q, written for every token
    k_cache_ptr,    # kv_cache[layer, 0] [NB, KVH, BS, D]: rotated k written at each valid slot
    v_cache_ptr,    # kv_cache[layer, 1] [NB, KVH, BS, D]: v written at each valid slot
    stride_q, stride_k, stride_v, stride_qo,
    stride_block, stride_head, stride_offset,       # the cache's strides (dim stride is 1)
    BLOCK_SIZE,                                     # BS: tokens per cache block
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    inv_freq = tl.load(inv_freq_ptr + dims, mask=dims < HALF, other=0.0)
    freqs = tl.load(positions_ptr + t).to(tl.float32) * inv_freq           # [BHALF]
    cos, sin = tl.cos(freqs)[None, :], tl.sin(freqs)[None, :]              # [1, BHALF]

    q1, q2, q_mask = _rotate_heads(q_ptr, stride_q, t, cos, sin, HEADS, HALF, BLOCK_H, BLOCK_HALF)
    heads = tl.arange(0, BLOCK_H)[:, None]
    q_out = q_out_ptr + t * stride_qo + heads * (2 * HALF) + dims[None, :]  # [BH, BHALF]
    tl.store(q_out, q1.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_out + HALF, q2.to(q_out_ptr.dtype.element_ty), mask=q_mask)

    k1, k2, kv_mask = _rotate_heads(k_ptr, stride_k, t, cos, sin, KV_HEADS, HALF, BLOCK_KVH, BLOCK_HALF)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    kv_mask = kv_mask & (slot >= 0)                                        # padding: no K/V write
    kv_heads = tl.arange(0, BLOCK_KVH)[:, None]
    at = (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_offset
    cache = at + kv_heads * stride_head + dims[None, :]                    # [BKVH, BHALF]
    tl.store(k_cache_ptr + cache, k1.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(k_cache_ptr + cache + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    v_row = v_ptr + t * stride_v + kv_heads * (2 * HALF) + dims[None, :]   # [BKVH, BHALF]
    for half in tl.static_range(2):
        v = tl.load(v_row + half * HALF, mask=kv_mask, other=0.0)
        tl.store(v_cache_ptr + cache + half * HALF, v.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


def rope_kv_write_triton(*tensors: torch.Tensor, layer: int, num_heads: int, num_kv_heads: int, head_dim: int,
                         inv_freq: torch.Tensor, q_out: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: checks the contract (ValueError naming the bad value) from shapes, dtypes and
    devices only, then launches one program per token. `q_out` may be q itself."""
    if len(tensors) not in (4, 6):
        raise ValueError(f"rope_kv_write_triton takes (qkv, positions, cache, slots) or (q, k, v, positions, "
                         f"cache, slots); got {len(tensors)} tensors")
    q, k, v, positions, kv_cache, slot_mapping = unpack_inputs(tensors, num_heads, num_kv_heads, head_dim)
    _check_inputs(q, k, v, positions, kv_cache, slot_mapping, layer, num_heads, num_kv_heads, head_dim, inv_freq)
    q_out = _checked_q_out(q_out, q)
    tokens = q.shape[0]
    if tokens == 0:
        return q_out, kv_cache
    k_cache, v_cache = kv_cache[layer, 0], kv_cache[layer, 1]             # [NB, KVH, BS, D] each
    _rope_kv_write_kernel[(tokens,)](
        q, k, v, positions, inv_freq, slot_mapping, q_out, k_cache, v_cache,
        q.stride(0), k.stride(0), v.stride(0), q_out.stride(0), *k_cache.stride()[:3], kv_cache.shape[4],
        HEADS=num_heads, KV_HEADS=num_kv_heads, HALF=head_dim // 2,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KVH=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
    )
    return q_out, kv_cache


def _check_inputs(q, k, v, positions, kv_cache, slot_mapping, layer, num_heads, num_kv_heads, head_dim,
                  inv_freq) -> None:
    if head_dim <= 0 or head_dim % 2 or num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"rope_kv_write_triton takes an even head_dim and num_heads a multiple of num_kv_heads; "
                         f"got head_dim {head_dim}, num_heads {num_heads}, num_kv_heads {num_kv_heads}")
    tokens = q.shape[0] if q.dim() == 2 else -1
    for name, t, width in (("q", q, num_heads * head_dim), ("k", k, num_kv_heads * head_dim),
                           ("v", v, num_kv_heads * head_dim)):
        if tuple(t.shape) != (tokens, width) or t.stride(1) != 1 or t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be [T, {width}] of a float dtype with contiguous rows; got "
                             f"{tuple(t.shape)} {t.dtype} strides {t.stride()}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if tuple(t.shape) != (tokens,) or t.dtype not in INDEX_DTYPES:
            raise ValueError(f"{name} must be [{tokens}] int32/int64; got {tuple(t.shape)} {t.dtype}")
    layout_ok = kv_cache.dim() == 6 and kv_cache.shape[1] == 2 and kv_cache.shape[3] == num_kv_heads
    if not layout_ok or kv_cache.shape[5] != head_dim or kv_cache.stride(5) != 1 or kv_cache.dtype not in FLOAT_DTYPES:
        raise ValueError(f"kv_cache must be [L, 2, NB, {num_kv_heads}, BS, {head_dim}] of a float dtype with "
                         f"contiguous rows; got {tuple(kv_cache.shape)} {kv_cache.dtype}")
    if not 0 <= layer < kv_cache.shape[0]:
        raise ValueError(f"layer {layer} is outside the cache's {kv_cache.shape[0]} layers")
    if tuple(inv_freq.shape) != (head_dim // 2,) or inv_freq.dtype != torch.float32:
        raise ValueError(f"inv_freq must be [{head_dim // 2}] float32 (rope_inv_freq); got "
                         f"{tuple(inv_freq.shape)} {inv_freq.dtype}")
    devices = {t.device for t in (q, k, v, positions, kv_cache, slot_mapping, inv_freq)}
    if len(devices) != 1:
        raise ValueError(f"every tensor must be on one device; got {sorted(map(str, devices))}")


def _checked_q_out(q_out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    if q_out is None:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    if q_out.shape != q.shape or q_out.dtype != q.dtype or q_out.device != q.device or q_out.stride(1) != 1:
        raise ValueError(f"q_out must be {list(q.shape)} {q.dtype} on {q.device} with contiguous rows; got "
                         f"{list(q_out.shape)} {q_out.dtype} on {q_out.device}")
    return q_out
