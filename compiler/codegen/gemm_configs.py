"""Launch configs of the GEMM templates (kernels/triton/gemm.py, qgemm.py), chosen from the shape.

The code generator picks them at compile time, per bucket of M (templates.py writes them into the
kernel module); a launcher called without one picks the same. Pure arithmetic on the shape: no
Triton, no tensors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from llmc.compiler.quant_format import INT4_BLOCK


@dataclass(frozen=True)
class GemmConfig:
    """Launch parameters of one GEMM instance, chosen at compile time and recorded."""
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), as triton.next_power_of_2."""
    return 1 << max(n - 1, 0).bit_length()


def _clamp_block(block: int, dim: int) -> int:
    """A block no larger than the dimension needs, and at least 16 (the GPU's smallest dot)."""
    return max(16, min(block, next_power_of_2(max(dim, 1))))


# (block_m, block_n, block_k, num_warps, num_stages) per M bucket (decode M <= 16, M <= 64,
# prefill), per kind of operands: x's dtype ("16": fp16/bf16, "32": fp32) and the weight's bits
# (16 or 32: a float weight of x's dtype; 8, 4: int8/int4 codes). block_m None: M rounded up to a
# power of two. Each tile compiles for sm_90 without a register spill with the heaviest epilogue
# (tests/test_triton_spills.py; `python -m llmc.kernels.triton.aot_compile --tiles` prints each
# kernel's registers). Registers a thread: the fp32 accumulator tile / threads (two tiles when gated,
# which is why a gated GEMM halves block_n) plus the operands it holds, at most 255.
TILES = {
    # fp16/bf16 x, float weight: tensor-core dots (wgmma) read both operands from shared memory.
    # Prefill 128 x 128 over 8 warps: 64 accumulator registers a thread (two 128 x 64 when gated:
    # 128 in all); over 4 warps the gated epilogue with bias and residual spilled (255 + 40-64 B).
    # M <= 64: K 32, as with K 64 the add + RMSNorm prologue's gated GEMM spilled 8 B at M 24.
    ("16", "16"): ((16, 64, 128, 4, 3), (None, 64, 32, 4, 3), (128, 128, 32, 8, 4)),
    # fp32 x and weight: IEEE fp32 dots are FMAs, whose operands a thread holds in registers over
    # the whole K tile, so K tiles are short and M tiles small. M > 16: 64 x 64 x 32 over 8 warps,
    # 16 accumulator registers a thread (32 gated), 80-148 in all, the add + RMSNorm prologue's
    # too; over 4 warps that prologue's gated GEMM spilled 20 B (at 168 registers), a 64 x 64 x 64
    # tile 4 B at M 37, and the tutorial's 128 x 128 x 32 took 255 and spilled 280-328 B. Decode:
    # K 64, as K 128 spilled 8 B gated.
    ("32", "32"): ((16, 64, 64, 4, 3), (None, 64, 32, 8, 3), (64, 64, 32, 8, 3)),
    # fp16/bf16 x, int8 codes: the codes widen to x's dtype in registers before the dot, one
    # [block_k, block_n] tile more a thread holds (two when gated). Prefill 128 x 64 x 32 over 4
    # warps takes 198 registers (216 gated, 128 x 32); 128 x 128 spilled 144-288 B. M <= 64 over
    # 8 warps: over 4, M 24 in 32-row tiles spilled 4 B (Q8_0, bias + silu + residual).
    ("16", "8"): ((16, 64, 128, 4, 3), (None, 64, 64, 8, 3), (128, 64, 32, 4, 4)),
    # fp16/bf16 x, int4 codes: two nibble tiles widen (low, high), beside their two x gathers.
    # Prefill 64 x 64 x 32 over 4 warps takes 204 registers (196 gated); 128 x 64 spilled 48 B,
    # 128 x 128 264 B.
    ("16", "4"): ((16, 64, 128, 4, 3), (None, 64, 64, 8, 3), (64, 64, 32, 4, 4)),
    # fp32 x, int8 or int4 codes: FMA dots on widened codes, both costs at once: K tiles of 32
    # (int4's least: one 32-code block), 8 warps from M 17 on: 145-255 registers, none spilled. K
    # 64 or more, or 4 warps at 64 x 64, spilled 184-8072 B (ptxas falling back to 32 registers
    # and a stack of kilobytes).
    ("32", "8"): ((16, 64, 32, 4, 3), (None, 64, 32, 8, 3), (64, 64, 32, 8, 3)),
}
TILES[("32", "4")] = TILES[("32", "8")]
# A float GEMM whose K is not a multiple of 16 (the rows of x and w 16-byte misaligned: tiny test
# models' 72) loads element by element, a 64-bit address each, so every M takes one small tile;
# the tiles above spilled 4-428 B there, and 32 x 64 (32 x 32 twice, gated) 4 B in fp32. Integer
# codes always come in whole 32-input groups.
UNALIGNED_K_TILE = (32, 32, 32, 4, 3)
FLOAT_BITS = {"f32": "32", "fp32": "32", "f16": "16", "fp16": "16", "bf16": "16"}


def pick_config(M: int, N: int, K: int, *, gated: bool = False, dtype: str = "bf16", weight_bits: int | None = None
                ) -> GemmConfig:
    """Block sizes from the problem shape, x's `dtype` (IR names f32/f16/bf16, or fp32/fp16) and
    the weight's bits (None: a float weight of x's dtype; 8 or 4: int8/int4 codes). N is the
    output width (N_w // 2 when gated).

    Decode (M <= 16): one 16-row tile, narrow 64-column tiles so that many programs stream the
    weight; M up to 64: one M tile of M rounded up; prefill: the largest tile of TILES that does
    not spill for these operands (128 x 128 for fp16/bf16). A gated GEMM keeps two accumulators,
    so its N tile is halved; a float GEMM whose K is not a multiple of 16 takes UNALIGNED_K_TILE.
    Every tile's shared memory (stages x operand tiles) fits 164 KB
    (A100) as well as H100/H200's 227 KB. Not tuned for speed on a GPU yet: the starting points
    are the Triton tutorial's and gemlite's, cut down until sm_90's registers hold them.
    """
    if dtype not in FLOAT_BITS:
        raise ValueError(f"dtype {dtype!r} is not a GEMM dtype; use one of {sorted(FLOAT_BITS)}")
    if weight_bits not in (None, 8, 4):
        raise ValueError(f"weight_bits {weight_bits!r} is not a weight format; use None (float), 8 or 4")
    bits = FLOAT_BITS[dtype]
    decode, middle, prefill = TILES[(bits, bits if weight_bits is None else str(weight_bits))]
    block_m, block_n, block_k, warps, stages = decode if M <= 16 else middle if M <= 64 else prefill
    if weight_bits is None and K % 16:
        block_m, block_n, block_k, warps, stages = UNALIGNED_K_TILE
    if gated:
        block_n //= 2
    return GemmConfig(block_m=_clamp_block(block_m or next_power_of_2(M), M), block_n=_clamp_block(block_n, N),
                      block_k=_clamp_block(block_k, K), group_m=8, num_warps=warps, num_stages=stages)


def k_tile_fits_group(block_k: int, K: int, bits: int, group_size: int) -> bool:
    """Whether a K tile of `block_k` inputs stays inside one group (int4: whole 32-code blocks)."""
    if bits == 4 and block_k % INT4_BLOCK:
        return False
    return group_size % block_k == 0 or (bits == 8 and group_size == K)


def pick_qconfig(M: int, N: int, K: int, *, bits: int, group_size: int, gated: bool = False,
                 dtype: str = "bf16") -> GemmConfig:
    """`pick_config`'s tile for x's `dtype` and `bits`-bit codes (16-row tiles and 64-column tiles
    for decode, so many programs stream the weight; larger tiles for prefill), with BLOCK_K the
    largest power of two no larger than its choice that keeps each K tile inside one group (int4:
    at least one 32-code block)."""
    config = pick_config(M, N, K, gated=gated, dtype=dtype, weight_bits=bits)
    block_k = max(config.block_k, INT4_BLOCK if bits == 4 else 16)
    while not k_tile_fits_group(block_k, K, bits, group_size):
        block_k //= 2
        if block_k < 16:
            raise ValueError(f"no K tile fits {bits}-bit groups of {group_size} over K = {K}")
    return dataclasses.replace(config, block_k=block_k)
