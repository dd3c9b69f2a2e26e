"""Rotary embedding of Q and K fused with the paged K/V cache write, one Triton template.

Contract (kernels/rope_kv_write.py's `rope_kv_write_ref`, same tensors):
  tensors       (qkv, positions, kv_cache, slot_mapping) with qkv [T, (H + 2*KVH) * D] (q, k, v
                columns of a merged QKV GEMM), or (q, k, v, positions, kv_cache, slot_mapping) with
                q [T, H * D], k and v [T, KVH * D]; one float dtype, each row contiguous
  positions     [T] int32/int64
  kv_cache      [L, 2, NB, KVH, BS, D] (kernels/attention.py), any float dtype, dim stride 1; or
                int8 [L, 2, NB, KVH, BS, D + 4] (kernels/quant.py), D a multiple of 4 (the scale's
                alignment), each row quantized as `quantize_kv_rows` (k after rounding to k's dtype)
  slot_mapping  [T] int32/int64: block * BS + offset; negative = padding, no K/V written. A slot
                must lie inside the cache: it is not checked (that would need a host sync)
  inv_freq      [R / 2] fp32 from kernels/rope.py `rope_inv_freq` of the rotary dim R (`rotary_dim`:
                D but for a partial rotary, whose heads turn their first R values and copy the
                rest), so every scaling rule applies
  attention_factor  a float cos and sin are multiplied by (kernels/rope.py `rope_attention_factor`:
                longrope's, else 1.0)
  q_norm, k_norm  with qk_norm "head" ([D] each) or "all" ([H*D], [KVH*D]), after the slots in
                `tensors`, q's dtype: q and k are RMS-normed before the rotation as rmsnorm_ref
                (fp32 mean of squares and rsqrt; with norm_rounding "normed" the normed value
                rounded to q's dtype, then the weight's product rounded; with "product" the fp32
                product with the weight rounded once), eps `norm_eps`
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

from ..quant import KV_SCALE_BYTES, cache_head_dim, is_int8_cache
from ..rope_kv_write import rope_kv_write_ref, unpack_inputs

__all__ = ["rope_kv_write_ref", "rope_kv_write_triton"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _normed(x, scale, w_ptrs, mask, dtype, NORM_PRODUCT: tl.constexpr):
    """rmsnorm_ref's rounding: x * scale rounded to dtype, times the weight, rounded again; with
    NORM_PRODUCT the fp32 product x * scale * weight rounded once (fp32 out)."""
    w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
    scaled = x * scale
    if not NORM_PRODUCT:
        scaled = scaled.to(dtype).to(tl.float32)
    return (scaled * w).to(dtype).to(tl.float32)


@triton.jit
def _rotate_heads(src_ptr, src_row_stride, t, cos, sin, norm_ptr, eps, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
                  NORM_SPAN: tl.constexpr, NORM_PRODUCT: tl.constexpr):
    """Token t's HEADS heads, normed (NORM_SPAN 1 per head, 2 the whole row; 0 not; rounded as
    NORM_PRODUCT says) and rotated:
    the rotated halves [BLOCK_H, BLOCK_HALF] each and the values past the rotary dim 2 * HALF
    [BLOCK_H, BLOCK_PASS] (none but for a partial rotary), fp32, with their masks."""
    heads = tl.arange(0, BLOCK_H)[:, None]                                 # [BH, 1]
    dims = tl.arange(0, BLOCK_HALF)[None, :]                               # [1, BHALF]
    pass_dims = tl.arange(0, BLOCK_PASS)[None, :]                          # [1, BPASS]
    mask = (heads < HEADS) & (dims < HALF)
    pass_mask = (heads < HEADS) & (pass_dims < HEAD_DIM - 2 * HALF)
    row = src_ptr + t * src_row_stride + heads * HEAD_DIM                  # [BH, 1]
    x1 = tl.load(row + dims, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + dims, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(row + 2 * HALF + pass_dims, mask=pass_mask, other=0.0).to(tl.float32)
    if NORM_SPAN != 0:
        dtype = src_ptr.dtype.element_ty
        squares = tl.sum(x1 * x1 + x2 * x2, 1) + tl.sum(xp * xp, 1)         # [BH]
        if NORM_SPAN == 1:
            scale = tl.rsqrt(squares / HEAD_DIM + eps)[:, None]            # [BH, 1]
            w = norm_ptr + heads * 0                                       # one weight [D]
        else:
            scale = tl.rsqrt(tl.sum(squares, 0) / (HEADS * HEAD_DIM) + eps)
            w = norm_ptr + heads * HEAD_DIM                                # weight [H*D]
        x1 = _normed(x1, scale, w + dims, mask, dtype, NORM_PRODUCT)
        x2 = _normed(x2, scale, w + HALF + dims, mask, dtype, NORM_PRODUCT)
        xp = _normed(xp, scale, w + 2 * HALF + pass_dims, pass_mask, dtype, NORM_PRODUCT)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin, xp, mask, pass_mask


@triton.jit
def _rope_kv_write_kernel(
    q_ptr,          # q [T, H*D], row stride stride_q: read
    k_ptr,          # k [T, KVH*D], row stride stride_k: read
    v_ptr,          # v [T, KVH*D], row stride stride_v: read
    positions_ptr,  # positions [T] int
    inv_freq_ptr,   # inv_freq [R/2] fp32 (R: the rotary dim, D but for a partial rotary)
    attention_factor,  # fp32 scalar: cos and sin are multiplied by it (longrope; else 1.0)
    slots_ptr,      # slot_mapping [T] int, negative = padding
    q_out_ptr,      # q_out [T, H*D], row stride stride_qo: the rotated q, written for every token
    k_cache_ptr,    # kv_cache[layer, 0] [NB, KVH, BS, D] (int8: D + 4): rotated k written at each valid slot
    v_cache_ptr,    # kv_cache[layer, 1] [NB, KVH, BS, D] (int8: D + 4): v written at each valid slot
    q_norm_ptr,     # q's norm weight [D] (NORM_SPAN 1) or [H*D] (2); unread with NORM_SPAN 0
    k_norm_ptr,     # k's norm weight [D] or [KVH*D]; unread with NORM_SPAN 0
    norm_eps,       # fp32: the norms' eps
    stride_q, stride_k, stride_v, stride_qo,
    stride_block, stride_head, stride_offset,       # the cache's strides (dim stride is 1)
    BLOCK_SIZE,                                     # BS: tokens per cache block
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,   # HALF = R/2
    BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    KV_INT8: tl.constexpr,
    NORM_SPAN: tl.constexpr,                        # q/k norms: 0 none, 1 per head, 2 the whole row
    NORM_PRODUCT: tl.constexpr,                     # their rounding: False "normed", True "product"
):
    t = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    inv_freq = tl.load(inv_freq_ptr + dims, mask=dims < HALF, other=0.0)
    freqs = tl.load(positions_ptr + t).to(tl.float32) * inv_freq           # [BHALF]
    cos = (tl.cos(freqs) * attention_factor)[None, :]                      # [1, BHALF]
    sin = (tl.sin(freqs) * attention_factor)[None, :]
    dims, pass_dims = dims[None, :], tl.arange(0, BLOCK_PASS)[None, :] + 2 * HALF

    q1, q2, qp, q_mask, qp_mask = _rotate_heads(q_ptr, stride_q, t, cos, sin, q_norm_ptr, norm_eps, HEADS, HEAD_DIM,
                                                HALF, BLOCK_H, BLOCK_HALF, BLOCK_PASS, NORM_SPAN, NORM_PRODUCT)
    heads = tl.arange(0, BLOCK_H)[:, None]
    q_out = q_out_ptr + t * stride_qo + heads * HEAD_DIM                   # [BH, 1]
    tl.store(q_out + dims, q1.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_out + HALF + dims, q2.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_out + pass_dims, qp.to(q_out_ptr.dtype.element_ty), mask=qp_mask)

    k1, k2, kp, kv_mask, kp_mask = _rotate_heads(k_ptr, stride_k, t, cos, sin, k_norm_ptr, norm_eps, KV_HEADS,
                                                 HEAD_DIM, HALF, BLOCK_KVH, BLOCK_HALF, BLOCK_PASS, NORM_SPAN,
                                                 NORM_PRODUCT)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    kv_mask, kp_mask = kv_mask & (slot >= 0), kp_mask & (slot >= 0)        # padding: no K/V write
    kv_heads = tl.arange(0, BLOCK_KVH)[:, None]
    at = (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_offset
    rows = at + kv_heads * stride_head                                     # [BKVH, 1]: each head's cache row
    k_dtype = k_ptr.dtype.element_ty                                       # the ref ropes k in its own dtype
    _store_rows(k_cache_ptr + rows, k1.to(k_dtype).to(tl.float32), k2.to(k_dtype).to(tl.float32), kp, kv_mask,
                kp_mask, dims, pass_dims, HALF, HEAD_DIM, KV_INT8)
    v_row = v_ptr + t * stride_v + kv_heads * HEAD_DIM                     # [BKVH, 1]
    v1 = tl.load(v_row + dims, mask=kv_mask, other=0.0).to(tl.float32)
    v2 = tl.load(v_row + HALF + dims, mask=kv_mask, other=0.0).to(tl.float32)
    vp = tl.load(v_row + pass_dims, mask=kp_mask, other=0.0).to(tl.float32)
    _store_rows(v_cache_ptr + rows, v1, v2, vp, kv_mask, kp_mask, dims, pass_dims, HALF, HEAD_DIM, KV_INT8)


@triton.jit
def round_half_even(y):
    """rint(y) for fp32 |y| < 2**22 from floor and exact comparisons (libdevice's rint has no
    interpreter version; floor(y + 0.5) rounds ties up and 0.49999997 to 1)."""
    r = tl.floor(y)
    frac = y - r                                                           # exact
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    return tl.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)


@triton.jit
def _codes(x, scale):
    """int8 codes of x [R, BHALF] at its rows' scales [R, 1]: rint(x / scale) clamped to +-127."""
    return tl.clamp(round_half_even(tl.math.div_rn(x, scale)), -127.0, 127.0).to(tl.int8)


@triton.jit
def _store_rows(row_ptrs, x1, x2, xp, mask, pass_mask, dims, pass_dims, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
                KV_INT8: tl.constexpr):
    """Store rows [R, D] given as the rotary halves x1, x2 [R, BHALF] at `dims` and `HALF + dims`
    and the rest xp [R, BPASS] at `pass_dims` (fp32) at `row_ptrs` [R, 1], masked.

    Float cache: cast to its dtype. int8 cache (kernels/quant.py `quantize_kv_rows`): scale =
    amax(|row|) / 127, codes rint(x / scale) clamped to +-127 (0 for a zero row), both divisions
    IEEE (div_rn; Triton's `/` is approximate on a GPU); the scale's fp32 bytes at byte D of the row.
    """
    if KV_INT8:
        amax = tl.maximum(tl.max(tl.where(mask, tl.abs(x1), 0.0), 1), tl.max(tl.where(mask, tl.abs(x2), 0.0), 1))
        amax = tl.maximum(amax, tl.max(tl.where(pass_mask, tl.abs(xp), 0.0), 1))
        scale = tl.math.div_rn(amax, 127.0)                                 # [R]
        safe = tl.where(scale > 0, scale, 1.0)[:, None]                    # [R, 1]
        tl.store(row_ptrs + dims, _codes(x1, safe), mask=mask)
        tl.store(row_ptrs + HALF + dims, _codes(x2, safe), mask=mask)
        tl.store(row_ptrs + pass_dims, _codes(xp, safe), mask=pass_mask)
        scale_ptrs = (row_ptrs + HEAD_DIM).to(tl.pointer_type(tl.float32))  # [R, 1], 4-byte aligned
        tl.store(scale_ptrs, scale[:, None], mask=tl.max(mask.to(tl.int32), 1)[:, None] > 0)
    else:
        tl.store(row_ptrs + dims, x1.to(row_ptrs.dtype.element_ty), mask=mask)
        tl.store(row_ptrs + HALF + dims, x2.to(row_ptrs.dtype.element_ty), mask=mask)
        tl.store(row_ptrs + pass_dims, xp.to(row_ptrs.dtype.element_ty), mask=pass_mask)


NORM_SPANS = {"": 0, "head": 1, "all": 2}


def rope_kv_write_triton(*tensors: torch.Tensor, layer: int, num_heads: int, num_kv_heads: int, head_dim: int,
                         inv_freq: torch.Tensor, q_out: torch.Tensor | None = None, attention_factor: float = 1.0,
                         qk_norm: str = "", norm_eps: float = 0.0, rotary_dim: int | None = None,
                         norm_rounding: str = "normed") -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: checks the contract (ValueError naming the bad value) from shapes, dtypes and
    devices only, then launches one program per token. `q_out` may be q itself; `rotary_dim`
    (even, at most head_dim; None: head_dim) the values of each head that turn; `norm_rounding`
    "normed" or "product" (compiler/ops/norms.py)."""
    rotary = head_dim if rotary_dim is None else rotary_dim
    norms = 2 if qk_norm else 0
    if qk_norm not in NORM_SPANS or len(tensors) not in (4 + norms, 6 + norms):
        raise ValueError(f"rope_kv_write_triton takes (qkv, positions, cache, slots) or (q, k, v, positions, "
                         f"cache, slots), then q_norm, k_norm with qk_norm 'head' or 'all'; got {len(tensors)} "
                         f"tensors and qk_norm={qk_norm!r}")
    if norm_rounding not in ("normed", "product"):
        raise ValueError(f"norm_rounding must be 'normed' or 'product'; got {norm_rounding!r}")
    q, k, v, positions, kv_cache, slot_mapping, *norm_weights = unpack_inputs(tensors, num_heads, num_kv_heads,
                                                                              head_dim, qk_norm)
    _check_inputs(q, k, v, positions, kv_cache, slot_mapping, layer, num_heads, num_kv_heads, head_dim, inv_freq,
                  rotary)
    _check_norms(norm_weights, qk_norm, q, num_heads, num_kv_heads, head_dim)
    q_norm, k_norm = norm_weights or (q, q)                                # unread without norms
    q_out = _checked_q_out(q_out, q)
    tokens = q.shape[0]
    if tokens == 0:
        return q_out, kv_cache
    k_cache, v_cache = kv_cache[layer, 0], kv_cache[layer, 1]             # [NB, KVH, BS, D] each
    _rope_kv_write_kernel[(tokens,)](
        q, k, v, positions, inv_freq, float(attention_factor), slot_mapping, q_out, k_cache, v_cache,
        q_norm, k_norm, float(norm_eps),
        q.stride(0), k.stride(0), v.stride(0), q_out.stride(0), *k_cache.stride()[:3], kv_cache.shape[4],
        HEADS=num_heads, KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=rotary // 2,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KVH=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(rotary // 2), BLOCK_PASS=triton.next_power_of_2(max(head_dim - rotary, 1)),
        KV_INT8=is_int8_cache(kv_cache),
        NORM_SPAN=NORM_SPANS[qk_norm], NORM_PRODUCT=norm_rounding == "product",
    )
    return q_out, kv_cache


def _check_inputs(q, k, v, positions, kv_cache, slot_mapping, layer, num_heads, num_kv_heads, head_dim,
                  inv_freq, rotary_dim) -> None:
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
    dtype_ok = kv_cache.dtype in FLOAT_DTYPES or (is_int8_cache(kv_cache) and head_dim % KV_SCALE_BYTES == 0)
    if not layout_ok or cache_head_dim(kv_cache) != head_dim or kv_cache.stride(5) != 1 or not dtype_ok:
        raise ValueError(f"kv_cache must be [L, 2, NB, {num_kv_heads}, BS, {head_dim}] of a float dtype, or int8 "
                         f"[.., {head_dim} + 4] with head_dim a multiple of 4, with contiguous rows; got "
                         f"{tuple(kv_cache.shape)} {kv_cache.dtype}")
    if not 0 <= layer < kv_cache.shape[0]:
        raise ValueError(f"layer {layer} is outside the cache's {kv_cache.shape[0]} layers")
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} is not even and within head_dim {head_dim}")
    if tuple(inv_freq.shape) != (rotary_dim // 2,) or inv_freq.dtype != torch.float32:
        raise ValueError(f"inv_freq must be [{rotary_dim // 2}] float32 (rope_inv_freq of the rotary dim); got "
                         f"{tuple(inv_freq.shape)} {inv_freq.dtype}")
    devices = {t.device for t in (q, k, v, positions, kv_cache, slot_mapping, inv_freq)}
    if len(devices) != 1:
        raise ValueError(f"every tensor must be on one device; got {sorted(map(str, devices))}")


def _check_norms(weights: list[torch.Tensor], qk_norm: str, q: torch.Tensor, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> None:
    if not qk_norm:
        return
    widths = (head_dim, head_dim) if qk_norm == "head" else (num_heads * head_dim, num_kv_heads * head_dim)
    for name, w, width in zip(("q_norm", "k_norm"), weights, widths):
        if tuple(w.shape) != (width,) or w.dtype != q.dtype or w.device != q.device or not w.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [{width}] {q.dtype} on {q.device} for qk_norm={qk_norm!r}; "
                             f"got {tuple(w.shape)} {w.dtype} on {w.device}")


def _checked_q_out(q_out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    if q_out is None:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    if q_out.shape != q.shape or q_out.dtype != q.dtype or q_out.device != q.device or q_out.stride(1) != 1:
        raise ValueError(f"q_out must be {list(q.shape)} {q.dtype} on {q.device} with contiguous rows; got "
                         f"{list(q_out.shape)} {q_out.dtype} on {q_out.device}")
    return q_out
