"""What the paged attention kernels share: reading K/V tiles through a block table, one online
softmax step, and the launchers' contract checks.

Contract (both kernels; kernels/attention.py states the layouts):
  q            [T, H * D]  fp32, fp16 or bf16; the last dim contiguous (a row stride is allowed)
  kv_cache     [L, 2, NB, KVH, BS, D], q's dtype and device; BS a power of two; D any value; or
               int8 [L, 2, NB, KVH, BS, D + 4] (kernels/quant.py: D codes, then the fp32 scale), D a
               multiple of 4; its K/V tiles are dequantized in registers and rounded to q's dtype
               for the dots, as the refs round `dequantize_kv_rows` to q's dtype
  block_tables [S, MB] int32/int64; entries past a sequence's ceil(seq_len / BS) blocks are never read
  seq_lens     [S] int32/int64, each <= MB * BS (not checked: that would need a host sync)
  out          [T, H * D] in q's dtype on q's device (optional; a fresh tensor otherwise)
Cache offsets are int64 (block id * block stride overflows int32 for large NB); `layer` is
applied on the host by viewing kv_cache[layer, 0] and kv_cache[layer, 1].

Tiles: a K/V tile is TILE consecutive key positions, each looked up through the block table on
its own (block_tables[s, pos // BS], slot pos % BS), so TILE is independent of BS and stays
>= 16, the smallest K dim of tl.dot on a GPU. D is padded to D_PAD = max(16, next_pow2(D)) with
masks. Scores live in the log2 domain (scaled by scale * log2(e)) and are softmaxed in fp32.
Both tl.dots take input_precision="ieee": exact for an fp32 cache (no tf32 rounding; on a GPU that
means FMA rather than tensor cores), no effect on fp16/bf16.
Window and softcap (the refs' meaning, compiler/ops/attention.py): `window` 0 or a query at
position p sees keys p - window < j <= p only (the launchers skip the tiles before it);
`softcap` 0 or the scores become softcap * tanh(score / softcap) before the mask, computed in the
log2 domain as C * tanh(s / C) with C = softcap * log2(e) (`softcap_log2`). head_dim up to 256
(any D; D_PAD a power of two).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmc.kernels.quant import KV_SCALE_BYTES, cache_head_dim, is_int8_cache

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PagedShape:
    """Sizes read off the launchers' inputs, all from shapes (no device values)."""

    num_seqs: int
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    max_blocks: int

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.kv_heads

    @property
    def head_dim_padded(self) -> int:
        return max(16, triton.next_power_of_2(self.head_dim))


@triton.jit
def kv_row_offsets(table_row, keys, key_mask, stride_block, stride_offset, BLOCK_SIZE: tl.constexpr):
    """Element offsets [TILE] of the cache rows of key positions `keys` [TILE] within one KV head.

    table_row: pointer to the sequence's block table row; only entries of masked-in keys are read.
    """
    block = tl.load(table_row + keys // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)  # [TILE]
    return block * stride_block + (keys % BLOCK_SIZE).to(tl.int64) * stride_offset


@triton.jit
def load_kv_tile(table_row, k_head, v_head, keys, key_mask, offs_d, d_mask, stride_block, stride_offset,
                 BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, KV_INT8: tl.constexpr):
    """K and V [TILE, D_PAD] of key positions `keys` [TILE] of one KV head; masked keys and padded
    dims read as 0. A float cache's tiles come in its dtype; an int8 cache's rows are dequantized
    in registers, code * scale in fp32 (the fp32 scale read from byte HEAD_DIM of each row)."""
    rows = kv_row_offsets(table_row, keys, key_mask, stride_block, stride_offset, BLOCK_SIZE)  # [TILE]
    offs, kv_mask = rows[:, None] + offs_d[None, :], key_mask[:, None] & d_mask[None, :]
    k, v = tl.load(k_head + offs, mask=kv_mask, other=0.0), tl.load(v_head + offs, mask=kv_mask, other=0.0)
    if KV_INT8:
        k_scale = tl.load((k_head + rows + HEAD_DIM).to(tl.pointer_type(tl.float32)), mask=key_mask, other=0.0)
        v_scale = tl.load((v_head + rows + HEAD_DIM).to(tl.pointer_type(tl.float32)), mask=key_mask, other=0.0)
        k, v = k.to(tl.float32) * k_scale[:, None], v.to(tl.float32) * v_scale[:, None]
    return k, v


@triton.jit
def tanh(x):
    """tanh in fp32, relative error ~3e-7 everywhere (Eigen's rational approximation; tl has no
    tanh in every Triton version, and 2 * sigmoid(2x) - 1 loses all relative accuracy near 0)."""
    x = tl.minimum(tl.maximum(x, -7.90531110763549805), 7.90531110763549805)
    x2 = x * x
    p = x2 * -2.76076847742355e-16 + 2.00018790482477e-13
    p = p * x2 + -8.60467152213735e-11
    p = p * x2 + 5.12229709037114e-08
    p = p * x2 + 1.48572235717979e-05
    p = p * x2 + 6.37261928875436e-04
    p = p * x2 + 4.89352455891786e-03
    q = x2 * 1.19825839466702e-06 + 1.18534705686654e-04
    q = q * x2 + 2.26843463243900e-03
    q = q * x2 + 4.89352518554385e-03
    return p * x / q


@triton.jit
def window_start(position, window):
    """The first key a query at `position` sees: position - window + 1 (not below 0), or 0 where
    window is 0 (off)."""
    return tl.where(window > 0, tl.maximum(position - window + 1, 0), 0)


@triton.jit
def online_softmax_step(q, k, v, visible, m, l, acc, qk_scale, softcap_log2, SOFTCAP: tl.constexpr):
    """Fold one K/V tile into the running max `m` [M], sum `l` [M] and output `acc` [M, D_PAD].

    q [M, D_PAD], k/v [TILE, D_PAD] in the cache dtype; visible [M, TILE] (False = masked out);
    SOFTCAP: the scores (log2 domain) become softcap_log2 * tanh(scores / softcap_log2) first.
    A row that has seen no visible key keeps m = -inf, l = 0, acc = 0 (no NaN).
    """
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale    # [M, TILE] fp32, log2 domain
    if SOFTCAP:
        scores = softcap_log2 * tanh(scores / softcap_log2)
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(scores - m_safe[:, None])                                  # [M, TILE]
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l, acc


def check_paged_inputs(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, layer: int, out: torch.Tensor | None) -> PagedShape:
    """The contract above, from shapes, dtypes and devices only; ValueError names the bad value."""
    if q.dim() != 2 or q.dtype not in DTYPES or (q.shape[1] > 1 and q.stride(1) != 1):
        raise ValueError(f"q must be [T, H * D] fp32/fp16/bf16 with a contiguous last dim; got {q.dtype} "
                         f"{tuple(q.shape)} strides {q.stride()}")
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2 or kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache must be [L, 2, NB, KVH, BS, D] with a contiguous last dim; got "
                         f"{tuple(kv_cache.shape)} strides {kv_cache.stride()}")
    if kv_cache.dtype not in (q.dtype, torch.int8) or kv_cache.device != q.device:
        raise ValueError(f"kv_cache must match q's dtype and device ({q.dtype}, {q.device}), or be int8; got "
                         f"{kv_cache.dtype} on {kv_cache.device}")
    layers, _, _, kv_heads, block_size, _ = kv_cache.shape
    head_dim = cache_head_dim(kv_cache)
    if is_int8_cache(kv_cache) and (head_dim <= 0 or head_dim % KV_SCALE_BYTES):
        raise ValueError(f"an int8 cache's rows are D codes + a 4-byte scale with D a multiple of 4; got rows of "
                         f"{kv_cache.shape[-1]} bytes")
    if block_size & (block_size - 1) or block_size == 0:
        raise ValueError(f"the cache's block size must be a power of two; got {block_size}")
    if not 0 <= layer < layers:
        raise ValueError(f"layer {layer} is outside the cache's {layers} layers")
    if q.shape[1] % head_dim or (q.shape[1] // head_dim) % kv_heads:
        raise ValueError(f"q's width {q.shape[1]} must be H * {head_dim} with H a multiple of the cache's "
                         f"{kv_heads} KV heads")
    if block_tables.dim() != 2 or block_tables.dtype not in INDEX_DTYPES:
        raise ValueError(f"block_tables must be [S, MB] int32/int64; got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}")
    if seq_lens.shape != block_tables.shape[:1] or seq_lens.dtype not in INDEX_DTYPES:
        raise ValueError(f"seq_lens must be [{block_tables.shape[0]}] int32/int64 (one per block table row); "
                         f"got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        check_index_tensor(name, t, q.device)
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device
                            or (out.shape[1] > 1 and out.stride(1) != 1)):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device} with a contiguous last dim; got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device} strides {out.stride()}")
    return PagedShape(block_tables.shape[0], q.shape[1] // head_dim, kv_heads, head_dim, block_size,
                      block_tables.shape[1])


def check_index_tensor(name: str, t: torch.Tensor, device: torch.device) -> None:
    """An index tensor is read with unit stride along its last dim, on q's device."""
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, q on {device}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along its last dim; got strides {t.stride()}")


def qk_scale(scale: float) -> float:
    """Softmax scale in the log2 domain the kernels use (exp2 instead of exp)."""
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number; got {scale}")
    return float(scale) * LOG2E


def check_options(window: int, softcap: float) -> tuple[int, float]:
    """(window, softcap in the log2 domain) for a launch; ValueError names a bad one."""
    if isinstance(window, bool) or not isinstance(window, int) or not 0 <= window < 2**31:
        raise ValueError(f"window must be an int >= 0 (0 = off); got {window!r}")
    if not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be a finite number >= 0 (0 = off); got {softcap!r}")
    return window, float(softcap) * LOG2E
