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


def pick_config(M: int, N: int, K: int, *, gated: bool = False) -> GemmConfig:
    """Block sizes from the problem shape. N is the output width (N_w // 2 when gated).

    Decode (M <= 16): one 16-row tile, narrow 64-column tiles so that many programs stream
    the weight; M up to 64: one M tile of M rounded up; prefill: the Triton tutorial's
    128 x 128 x 32 tile. A gated GEMM keeps two accumulators, so its N tile is halved. Stages
    are sized so that fp32 operands fit in 164 KB of shared memory (A100) as well as H100/H200's.
    Not tuned on a GPU yet: the numbers are the tutorial's and gemlite's starting points.
    """
    if M <= 16:
        block_m, block_n, block_k, warps, stages = 16, 64, 128, 4, 3
    elif M <= 64:
        block_m, block_n, block_k, warps, stages = next_power_of_2(M), 64, 64, 4, 3
    else:
        block_m, block_n, block_k, warps, stages = 128, 128, 32, 4, 4
    if gated:
        block_n //= 2
    return GemmConfig(block_m=_clamp_block(block_m, M), block_n=_clamp_block(block_n, N),
                      block_k=_clamp_block(block_k, K), group_m=8, num_warps=warps, num_stages=stages)


def k_tile_fits_group(block_k: int, K: int, bits: int, group_size: int) -> bool:
    """Whether a K tile of `block_k` inputs stays inside one group (int4: whole 32-code blocks)."""
    if bits == 4 and block_k % INT4_BLOCK:
        return False
    return group_size % block_k == 0 or (bits == 8 and group_size == K)


def pick_qconfig(M: int, N: int, K: int, *, bits: int, group_size: int, gated: bool = False) -> GemmConfig:
    """The float GEMM's config for this shape (`pick_config`: 16-row tiles and 64-column tiles for
    decode, so many programs stream the weight; larger tiles for prefill), with BLOCK_K the largest
    power of two no larger than its choice that keeps each K tile inside one group (int4: at least
    one 32-code block)."""
    config = pick_config(M, N, K, gated=gated)
    block_k = max(config.block_k, INT4_BLOCK if bits == 4 else 16)
    while not k_tile_fits_group(block_k, K, bits, group_size):
        block_k //= 2
        if block_k < 16:
            raise ValueError(f"no K tile fits {bits}-bit groups of {group_size} over K = {K}")
    return dataclasses.replace(config, block_k=block_k)
