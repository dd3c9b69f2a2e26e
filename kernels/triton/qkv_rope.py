"""The merged QKV GEMM with RoPE and the paged K/V cache write as its epilogue, one Triton template.

Contract (the unfused meaning is `qkv_rope_ref`: gemm.py's linear, or norm_linear with its RMSNorm
prologue, then rope_kv_write.py's rope_kv_write on the packed qkv):
  x             [M, K] fp32, fp16 or bf16 (any strides); with `norm_weight` the RMSNorm prologue of
                gemm.py (and with `norm_residual` add_rmsnorm's, whose sum h is returned)
  w             [(H + 2 KVH) * D, K] x's dtype: q rows, then k rows, then v rows; bias optional
  positions     [M] int32/int64; slot_mapping [M] int32/int64, negative = padding (no K/V write)
  kv_cache      [L, 2, NB, KVH, BS, D], any float dtype, dim stride 1 (an int8 cache is not taken:
                its per-row scale needs a whole head in one program; codegen launches those apart)
  inv_freq      [D / 2] fp32 (kernels/rope.py `rope_inv_freq`); attention_factor as rope_kv_write
Returns (rotated q [M, H * D] in x's dtype, kv_cache[, h]): what linear_triton and then
rope_kv_write_triton return, with the rotated k and v of every token at its slot of `layer`.

Tiling: the output is cut into column pairs (c, c + D/2) of one head each (rotate-half's halves),
PAIRS = (H + 2 KVH) * D / 2 of them; pair p is head p // (D/2), column head * D + p % (D/2). A
program owns BLOCK_N pairs and keeps two accumulators, the first halves' and the second halves'
(as gemm.py's gated GEMM keeps gate and up), so the rotation y1 = x1 cos - x2 sin, y2 = x2 cos +
x1 sin is elementwise on the tiles. The product (+ bias) is rounded to x's dtype first, as the
unfused GEMM stores qkv; then cos and sin of positions * inv_freq (times attention_factor) in fp32
as rope_kv_write_triton computes them, q rounded to x's dtype into q_out, k rounded to x's dtype
then stored in the cache's dtype, v stored as the GEMM rounded it. So the fused template is the
unfused pair's arithmetic, with the GEMM's fp32 summation order the only difference. Partial
rotary and q/k norms are not taken (codegen launches those apart). The launcher never reads a
tensor's values (no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmc.compiler.codegen.gemm_configs import GemmConfig, pick_config
from llmc.compiler.dtypes import from_torch

from ..rope_kv_write import rope_kv_write_ref
from .gemm import DTYPES, dot_acc, grouped_tile, linear_epilogue_ref, norm_linear_ref, norm_prologue, row_norm

__all__ = ["qkv_rope_ref", "qkv_rope_triton"]


def qkv_rope_ref(x, w, bias, positions, kv_cache, slot_mapping, *, layer: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, theta: float, scaling=None, norm_weight=None, eps: float = 0.0, norm_residual=None):
    """The unfused path in torch: the GEMM (with its norm), then rope_kv_write_ref on the packed qkv;
    (q_rot, kv_cache[, h]) as qkv_rope_triton returns."""
    if norm_weight is None:
        qkv, h = linear_epilogue_ref(x, w, bias), None
    else:
        qkv, h = norm_linear_ref(x, norm_weight, w, bias, eps=eps, norm_residual=norm_residual)
    q, cache = rope_kv_write_ref(qkv, positions, kv_cache, slot_mapping, layer=layer, num_heads=num_heads,
                                 num_kv_heads=num_kv_heads, head_dim=head_dim, theta=theta, scaling=scaling)
    return (q, cache) if norm_residual is None else (q, cache, h)


@triton.jit
def _rotate_and_store(x1, x2, offs_m, head, half_col, mask_m, mask_p, positions_ptr, inv_freq_ptr, slots_ptr,
                      q_out_ptr, k_cache_ptr, v_cache_ptr, stride_qo, stride_block, stride_head, stride_offset,
                      BLOCK_SIZE, attention_factor, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                      HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
    """The epilogue on the rounded halves x1, x2 [BM, BN] (fp32) of heads `head` [BN] at column
    half_col [BN] within their head: rotate q and k heads, store q to q_out, k and v to the cache."""
    pos = tl.load(positions_ptr + offs_m, mask=mask_m, other=0).to(tl.float32)              # [BM]
    inv_freq = tl.load(inv_freq_ptr + half_col, mask=mask_p, other=0.0)                     # [BN]
    freqs = pos[:, None] * inv_freq[None, :]
    cos, sin = tl.cos(freqs) * attention_factor, tl.sin(freqs) * attention_factor
    turns = (head < HEADS + KV_HEADS)[None, :]                                              # v heads do not
    y1 = tl.where(turns, x1 * cos - x2 * sin, x1)
    y2 = tl.where(turns, x2 * cos + x1 * sin, x2)
    mask = mask_m[:, None] & mask_p[None, :]
    is_q, is_k = (head < HEADS)[None, :], ((head >= HEADS) & (head < HEADS + KV_HEADS))[None, :]
    q_ptrs = q_out_ptr + offs_m[:, None] * stride_qo + (head * HEAD_DIM + half_col)[None, :]
    tl.store(q_ptrs, y1.to(q_out_ptr.dtype.element_ty), mask=mask & is_q)
    tl.store(q_ptrs + HALF, y2.to(q_out_ptr.dtype.element_ty), mask=mask & is_q)
    slot = tl.load(slots_ptr + offs_m, mask=mask_m, other=-1).to(tl.int64)                 # [BM]
    kv_head = tl.where(head < HEADS + KV_HEADS, head - HEADS, head - HEADS - KV_HEADS)      # [BN]
    rows = (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_offset       # [BM]
    at = rows[:, None] + (kv_head * stride_head + half_col)[None, :]                         # [BM, BN]
    written = mask & (slot >= 0)[:, None]
    y1 = y1.to(q_out_ptr.dtype.element_ty).to(k_cache_ptr.dtype.element_ty)              # k rounds to x's dtype
    y2 = y2.to(q_out_ptr.dtype.element_ty).to(k_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + at, y1, mask=written & is_k)
    tl.store(k_cache_ptr + at + HALF, y2, mask=written & is_k)
    is_v = (head >= HEADS + KV_HEADS)[None, :]
    tl.store(v_cache_ptr + at, y1, mask=written & is_v)
    tl.store(v_cache_ptr + at + HALF, y2, mask=written & is_v)


@triton.jit
def _qkv_rope_kernel(
    x_ptr,          # x [M, K]
    w_ptr,          # w [(H + 2 KVH) * D, K]: q, k, v rows
    bias_ptr,       # bias [(H + 2 KVH) * D]; read only if HAS_BIAS
    norm_w_ptr, add_ptr, sum_ptr,   # the norm prologue's (gemm.py norm_prologue); read only if NORM
    positions_ptr,  # positions [M] int
    inv_freq_ptr,   # inv_freq [D / 2] fp32
    slots_ptr,      # slot_mapping [M] int, negative = padding
    q_out_ptr,      # q_out [M, H * D] (row stride stride_qo): the rotated q
    k_cache_ptr,    # kv_cache[layer, 0] [NB, KVH, BS, D]: rotated k written at each valid slot
    v_cache_ptr,    # kv_cache[layer, 1] [NB, KVH, BS, D]: v written at each valid slot
    M, PAIRS, K,    # PAIRS = (H + 2 KVH) * D / 2 column pairs
    stride_xm, stride_xk, stride_wn, stride_wk, stride_am, stride_sm, stride_qo,
    stride_block, stride_head, stride_offset, BLOCK_SIZE,    # the cache's strides (dim stride 1), tokens a block
    eps, attention_factor,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, PAIRS, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)       # [BM]
    offs_p = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)       # [BN] pairs
    offs_k = tl.arange(0, BLOCK_K)                                        # [BK]
    mask_m, mask_p = offs_m < M, offs_p < PAIRS
    head, half_col = offs_p // HALF, offs_p % HALF                        # [BN]
    col = head * HEAD_DIM + half_col                                      # [BN]: the first half's column
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk     # [BM, BK]
    w_ptrs = w_ptr + col[None, :] * stride_wn + offs_k[:, None] * stride_wk        # [BK, BN]: w.T
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a_mask = mask_m[:, None] & (offs_k[None, :] < k_left)
        a = tl.load(x_ptrs, mask=a_mask, other=0.0)
        if NORM != 0:
            a, sq = norm_prologue(a, offs_m, k * BLOCK_K + offs_k, K, a_mask, norm_w_ptr, add_ptr, sum_ptr, stride_am,
                                  stride_sm, pid_n == 0, sq, NORM)
        w_mask = (offs_k[:, None] < k_left) & mask_p[None, :]
        acc1 = dot_acc(a, tl.load(w_ptrs, mask=w_mask, other=0.0), acc1, DOT_FP32, INPUT_PRECISION)
        acc2 = dot_acc(a, tl.load(w_ptrs + HALF * stride_wn, mask=w_mask, other=0.0), acc2, DOT_FP32,
                       INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if NORM != 0:
        scale = tl.rsqrt(sq / K + eps)[:, None]
        acc1, acc2 = acc1 * scale, acc2 * scale
    if HAS_BIAS:
        acc1 += tl.load(bias_ptr + col, mask=mask_p, other=0.0).to(tl.float32)[None, :]
        acc2 += tl.load(bias_ptr + col + HALF, mask=mask_p, other=0.0).to(tl.float32)[None, :]
    dtype = q_out_ptr.dtype.element_ty                                    # the qkv the unfused GEMM stores
    _rotate_and_store(acc1.to(dtype).to(tl.float32), acc2.to(dtype).to(tl.float32), offs_m, head, half_col,
                      mask_m, mask_p, positions_ptr, inv_freq_ptr, slots_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                      stride_qo, stride_block, stride_head, stride_offset, BLOCK_SIZE, attention_factor,
                      HEADS, KV_HEADS, HEAD_DIM, HALF)


def qkv_rope_triton(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
                    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *, layer: int, num_heads: int,
                    num_kv_heads: int, head_dim: int, inv_freq: torch.Tensor, attention_factor: float = 1.0,
                    norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                    norm_residual: torch.Tensor | None = None, config: GemmConfig | None = None) -> tuple:
    """Launcher: checks the contract (ValueError naming the bad value) from shapes, dtypes and
    devices only, launches one program per tile of column pairs; (q_rot, kv_cache[, h])."""
    _check_qkv_rope(x, w, bias, positions, kv_cache, slot_mapping, layer, num_heads, num_kv_heads, head_dim,
                    inv_freq)
    if norm_weight is None and norm_residual is not None:
        raise ValueError("norm_residual needs norm_weight (add_rmsnorm's weight); got none")
    norm = None if norm_weight is None else row_norm(x, norm_weight, eps, norm_residual)
    M, K = x.shape
    q_out = torch.empty(M, num_heads * head_dim, dtype=x.dtype, device=x.device)
    pairs = w.shape[0] // 2
    if M:
        cfg = config or pick_config(M, pairs, K, gated=True, dtype=from_torch(x.dtype))   # two accumulators, as gated
        dot_fp32 = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and x.device.type == "cpu")
        add, h = (norm.residual, norm.sum_out) if norm is not None and norm.kind == 2 else (x, x)   # x: unread
        k_cache, v_cache = kv_cache[layer, 0], kv_cache[layer, 1]             # [NB, KVH, BS, D] each
        _qkv_rope_kernel[(triton.cdiv(M, cfg.block_m) * triton.cdiv(pairs, cfg.block_n),)](
            x, w, bias if bias is not None else x, norm.weight if norm is not None else x, add, h,
            positions, inv_freq, slot_mapping, q_out, k_cache, v_cache,
            M, pairs, K, *x.stride(), *w.stride(), add.stride(0), h.stride(0), q_out.stride(0),
            *k_cache.stride()[:3], kv_cache.shape[4], float(eps), float(attention_factor),
            HEADS=num_heads, KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2,
            HAS_BIAS=bias is not None, NORM=norm.kind if norm is not None else 0, DOT_FP32=dot_fp32,
            INPUT_PRECISION="ieee" if dot_fp32 else "tf32",
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if norm is not None and norm.kind == 2:
        return q_out, kv_cache, norm.sum_out
    return q_out, kv_cache


def _check_qkv_rope(x, w, bias, positions, kv_cache, slot_mapping, layer, num_heads, num_kv_heads, head_dim,
                    inv_freq) -> None:
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if x.dim() != 2 or x.dtype not in DTYPES or head_dim % 2 or num_heads % num_kv_heads:
        raise ValueError(f"qkv_rope_triton takes x [M, K] fp32/fp16/bf16, an even head_dim and num_heads a multiple "
                         f"of num_kv_heads; got x {x.dtype} {tuple(x.shape)}, head_dim {head_dim}, heads "
                         f"{num_heads}/{num_kv_heads}")
    if tuple(w.shape) != (width, x.shape[1]) or w.dtype != x.dtype:
        raise ValueError(f"w must be [{width}, {x.shape[1]}] {x.dtype} (q, k, v rows); got {tuple(w.shape)} {w.dtype}")
    if bias is not None and (tuple(bias.shape) != (width,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{width}] {x.dtype}; got {tuple(bias.shape)} {bias.dtype}")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if tuple(t.shape) != (x.shape[0],) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be [{x.shape[0]}] int32/int64; got {tuple(t.shape)} {t.dtype}")
    layout = (kv_cache.dim() == 6 and kv_cache.shape[1] == 2 and kv_cache.shape[3] == num_kv_heads
              and kv_cache.shape[5] == head_dim and kv_cache.stride(5) == 1 and kv_cache.dtype in DTYPES)
    if not layout or not 0 <= layer < kv_cache.shape[0]:
        raise ValueError(f"kv_cache must be a float [L, 2, NB, {num_kv_heads}, BS, {head_dim}] with contiguous rows "
                         f"and layer {layer} inside it (an int8 cache: rope_kv_write_triton); got "
                         f"{tuple(kv_cache.shape)} {kv_cache.dtype}")
    if tuple(inv_freq.shape) != (head_dim // 2,) or inv_freq.dtype != torch.float32:
        raise ValueError(f"inv_freq must be [{head_dim // 2}] float32; got {tuple(inv_freq.shape)} {inv_freq.dtype}")
    if len({t.device for t in (x, w, positions, kv_cache, slot_mapping, inv_freq)}) != 1:
        raise ValueError("every tensor must be on one device")
