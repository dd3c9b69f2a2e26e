"""Dequantizing GEMM with a fused epilogue: y = epilogue(x @ dequant(w).T + bias), one Triton template.

Contract (the `qlinear` op; compiler/quant_format.py states the weight formats):
  x        [M, K]  fp32, fp16 or bf16 (any strides)
  codes    int8:  i8 [N_w, K];   int4: uint8 [N_w, K/2], blocks of 32 codes in GGUF order
           (byte b of a block: code b in the low nibble, code b + 16 in the high one)
  scales   f16 [N_w, K/G]; mins f16 [N_w, K/G] (int4 only: w = scale * code + min)
  group G  int8: K (one scale per output channel) or any divisor of K (32: GGUF Q8_0);
           int4: a multiple of 32 dividing K (32, 64, 128)
  bias, residual, out, activation, gated, softcap: as kernels/triton/gemm.py (the same epilogue code)
  codes, scales and mins are contiguous (the artifact stores them so).
The meaning is `qlinear_epilogue_ref`: the weight dequantized in fp32, x @ w.T accumulated in
fp32, the epilogue on the fp32 accumulator, one rounding to x's dtype.

How the weight is applied: a K tile never crosses a group (BLOCK_K divides G, or G = K), so the
tile's product is taken on the raw codes and scaled once per tile and column:
  x @ w.T over the tile = scale * (x @ codes.T) [+ min * sum(x over the tile)]
The codes (|code| <= 127) are exact in fp16 and bf16, and an fp16/bf16 x times a code is exact
in the fp32 accumulator, so the dot runs in x's dtype on tensor cores and loses nothing against
dequantizing to fp32 first (a dequantized fp16 weight would round: scale * code needs 18 bits);
only the fp32 summation order differs from the ref. fp32 x takes
an IEEE fp32 dot; bf16 x is upcast to fp32 for the dot on CPU tensors (the interpreter's bf16
dot is wrong), as in gemm.py. int4 tiles of BLOCK_K codes are BLOCK_K / 2 bytes: the low
nibbles hold inputs k0 + 32b + (0..15) of each 32-block b, the high nibbles 16 further on, so the
tile is two dots of K = BLOCK_K / 2 against the matching two gathers of x; no shuffle of codes.
Block sizes come from `pick_qconfig` (compiler/codegen/gemm_configs.py: the float GEMM's buckets,
BLOCK_K fitted to the group); M and N edges are masked, and K where G = K is not a multiple of
BLOCK_K.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmc.compiler.codegen.gemm_configs import GemmConfig, k_tile_fits_group, pick_qconfig
from llmc.compiler.dtypes import from_torch
from llmc.compiler.quant_format import INT4_BLOCK, dequantize_weight

from .gemm import ACTIVATIONS, DTYPES, check_softcap, dot_acc, grouped_tile, linear_epilogue_ref, store_epilogue

__all__ = ["pick_qconfig", "qlinear_epilogue_ref", "qlinear_triton"]


def qlinear_epilogue_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                         bias: torch.Tensor | None = None, residual: torch.Tensor | None = None, *, bits: int,
                         activation: str = "none", gated: bool = False, softcap: float = 0.0) -> torch.Tensor:
    """The contract in torch: dequantize in fp32, then gemm.py's fp32 GEMM and epilogue."""
    w = dequantize_weight(codes, scales, mins, bits)                                # [N_w, K] fp32
    return linear_epilogue_ref(x, w, bias, residual, activation=activation, gated=gated, softcap=softcap)


@triton.jit
def _exact(codes, a, DOT_FP32: tl.constexpr):
    """Integer codes as the dot's operand type (exact: |code| <= 127): fp32 for an fp32 dot, else x's
    dtype (never int -> bf16 on CPU tensors: the interpreter's bf16 is wrong there too)."""
    if DOT_FP32:
        return codes.to(tl.float32)
    return codes.to(a.dtype)


@triton.jit
def _int8_tile(a, codes_ptr, scales_ptr, rows, mask_n, offs_k, k_mask, group, stride_c, stride_s,
               DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """scale * (a @ codes.T) [BM, BN] fp32 for weight rows `rows` [BN] over the K tile offs_k [BK]."""
    c = tl.load(codes_ptr + rows[None, :] * stride_c + offs_k[:, None],
                mask=k_mask[:, None] & mask_n[None, :], other=0)                     # [BK, BN] i8
    s = tl.load(scales_ptr + rows * stride_s + group, mask=mask_n, other=0.0).to(tl.float32)   # [BN]
    part = dot_acc(a, _exact(c, a, DOT_FP32), tl.zeros((a.shape[0], c.shape[1]), tl.float32),
                   DOT_FP32, INPUT_PRECISION)
    return part * s[None, :]


@triton.jit
def _int4_tile(a_lo, a_hi, x_sum, codes_ptr, scales_ptr, mins_ptr, rows, mask_n, offs_byte, group,
               stride_c, stride_s, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """scale * (a @ codes.T) + min * sum(a) [BM, BN] fp32 for weight rows `rows` [BN] over the K
    tile whose bytes are offs_byte [BK/2]; a_lo / a_hi are x at the low / high nibbles' inputs."""
    packed = tl.load(codes_ptr + rows[None, :] * stride_c + offs_byte[:, None],
                     mask=mask_n[None, :], other=0)                                  # [BK/2, BN] u8
    lo, hi = _exact(packed & 0xF, a_lo, DOT_FP32), _exact(packed >> 4, a_lo, DOT_FP32)
    zero = tl.zeros((a_lo.shape[0], packed.shape[1]), tl.float32)
    part = dot_acc(a_hi, hi, dot_acc(a_lo, lo, zero, DOT_FP32, INPUT_PRECISION), DOT_FP32, INPUT_PRECISION)
    s = tl.load(scales_ptr + rows * stride_s + group, mask=mask_n, other=0.0).to(tl.float32)   # [BN]
    m = tl.load(mins_ptr + rows * stride_s + group, mask=mask_n, other=0.0).to(tl.float32)
    return part * s[None, :] + x_sum[:, None] * m[None, :]


@triton.jit
def _qlinear_kernel(
    x_ptr,         # x [M, K]: the activations
    codes_ptr,     # codes [N_w, K] i8 or [N_w, K/2] u8 (row stride stride_c): gate rows, then up rows if GATED
    scales_ptr,    # scales [N_w, K/G] f16 (row stride stride_s)
    mins_ptr,      # mins [N_w, K/G] f16; read only for BITS == 4
    bias_ptr,      # bias [N_w]; read only if HAS_BIAS
    residual_ptr,  # residual [M, N]; read only if HAS_RESIDUAL
    out_ptr,       # out [M, N]: written once, in out's dtype
    M, N, K, GROUP,  # N is the output width (N_w // 2 when GATED); GROUP: inputs per scale
    stride_xm, stride_xk, stride_c, stride_s, stride_rm, stride_rn, stride_om, stride_on,
    softcap,         # fp32: the soft-cap, read only if SOFTCAP
    BITS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SILU: tl.constexpr,
    GELU: tl.constexpr, GATED: tl.constexpr, SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)       # [BM]
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)       # [BN]
    mask_m, mask_n = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm                          # [BM, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)               # used only if GATED
    for k0 in range(0, K, BLOCK_K):
        group = k0 // GROUP                                               # the tile's one group
        if BITS == 8:
            offs_k = k0 + tl.arange(0, BLOCK_K)                           # [BK]
            k_mask = offs_k < K
            a = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=mask_m[:, None] & k_mask[None, :], other=0.0)
            acc += _int8_tile(a, codes_ptr, scales_ptr, offs_n, mask_n, offs_k, k_mask, group, stride_c,
                              stride_s, DOT_FP32, INPUT_PRECISION)
            if GATED:
                acc_up += _int8_tile(a, codes_ptr, scales_ptr, offs_n + N, mask_n, offs_k, k_mask, group,
                                     stride_c, stride_s, DOT_FP32, INPUT_PRECISION)
        else:
            byte = tl.arange(0, BLOCK_K // 2)                             # [BK/2] bytes of the tile
            k_lo = k0 + (byte // 16) * 32 + byte % 16                     # the low nibbles' inputs
            a_lo = tl.load(x_rows + k_lo[None, :] * stride_xk, mask=mask_m[:, None], other=0.0)  # [BM, BK/2]
            a_hi = tl.load(x_rows + (k_lo + 16)[None, :] * stride_xk, mask=mask_m[:, None], other=0.0)
            x_sum = tl.sum(a_lo.to(tl.float32), 1) + tl.sum(a_hi.to(tl.float32), 1)  # [BM]
            offs_byte = k0 // 2 + byte
            acc += _int4_tile(a_lo, a_hi, x_sum, codes_ptr, scales_ptr, mins_ptr, offs_n, mask_n, offs_byte,
                              group, stride_c, stride_s, DOT_FP32, INPUT_PRECISION)
            if GATED:
                acc_up += _int4_tile(a_lo, a_hi, x_sum, codes_ptr, scales_ptr, mins_ptr, offs_n + N, mask_n,
                                     offs_byte, group, stride_c, stride_s, DOT_FP32, INPUT_PRECISION)

    store_epilogue(acc, acc_up, offs_m, offs_n, M, N, bias_ptr, residual_ptr, out_ptr,
                   stride_rm, stride_rn, stride_om, stride_on, softcap, HAS_BIAS, HAS_RESIDUAL, SILU, GELU, GATED,
                   SOFTCAP)


def qlinear_triton(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, residual: torch.Tensor | None = None, *, bits: int,
                   group_size: int, activation: str = "none", gated: bool = False, softcap: float = 0.0,
                   out: torch.Tensor | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """Launcher: checks the contract (ValueError naming the bad value), picks a config unless
    given one, launches one program per output tile, returns `out`."""
    n_out = _check_qlinear_inputs(x, codes, scales, mins, bias, residual, bits, group_size, activation, gated)
    check_softcap(softcap)
    M, K = x.shape
    out = _checked(out, "out", (M, n_out), x) if out is not None else torch.empty(M, n_out, dtype=x.dtype,
                                                                                 device=x.device)
    if M == 0 or n_out == 0:
        return out
    cfg = config or pick_qconfig(M, n_out, K, bits=bits, group_size=group_size, gated=gated,
                                 dtype=from_torch(x.dtype))
    if not k_tile_fits_group(cfg.block_k, K, bits, group_size):
        raise ValueError(f"block_k {cfg.block_k} does not fit {bits}-bit groups of {group_size} over K = {K}")
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(n_out, cfg.block_n),)
    res_strides = residual.stride() if residual is not None else (0, 0)
    dot_fp32 = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and x.device.type == "cpu")
    _qlinear_kernel[grid](
        x, codes, scales, mins if mins is not None else scales, bias if bias is not None else x,
        residual if residual is not None else x, out,
        M, n_out, K, group_size, *x.stride(), codes.stride(0), scales.stride(0), *res_strides, *out.stride(),
        float(softcap), BITS=bits, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        SILU=activation == "silu", GELU=activation == "gelu_tanh", GATED=gated, SOFTCAP=softcap > 0, DOT_FP32=dot_fp32,
        INPUT_PRECISION="ieee" if dot_fp32 else "tf32",
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _check_qlinear_inputs(x, codes, scales, mins, bias, residual, bits, group_size, activation, gated) -> int:
    """The output width N, after checking every input against the contract."""
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"qlinear_triton takes x [M, K] fp32/fp16/bf16; got {x.dtype} {tuple(x.shape)}")
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4; got {bits!r}")
    code_dtype, per_byte = (torch.int8, 1) if bits == 8 else (torch.uint8, 2)
    if codes.dim() != 2 or codes.dtype != code_dtype or codes.shape[1] * per_byte != x.shape[1]:
        raise ValueError(f"{bits}-bit codes must be {code_dtype} [N, {x.shape[1] // per_byte}] for x "
                         f"{tuple(x.shape)}; got {codes.dtype} {tuple(codes.shape)}")
    K, n_w = x.shape[1], codes.shape[0]
    if group_size <= 0 or K % group_size or (bits == 4 and group_size % INT4_BLOCK):
        raise ValueError(f"group_size {group_size} must divide K = {K}" + (" and be a multiple of 32" * (bits == 4)))
    groups = (n_w, K // group_size)
    for name, t in (("scales", scales), ("mins", mins if bits == 4 else scales)):
        if t is None or tuple(t.shape) != groups or t.dtype != torch.float16:
            raise ValueError(f"{name} must be float16 {list(groups)}; got "
                             f"{'None' if t is None else f'{t.dtype} {list(t.shape)}'}")
    if bits == 8 and mins is not None:
        raise ValueError("int8 weights have no mins (w = scale * code)")
    for name, t in (("codes", codes), ("scales", scales), ("mins", mins)):
        if t is not None and (not t.is_contiguous() or t.device != x.device):
            raise ValueError(f"{name} must be contiguous on {x.device}; got strides {t.stride()} on {t.device}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {ACTIVATIONS}")
    if gated and (activation not in ("none", "gelu_tanh") or n_w % 2):
        raise ValueError(f"gated takes {n_w} weight rows, an even number, and activation 'none' (silu) or "
                         f"'gelu_tanh'; got {activation!r}")
    n_out = n_w // 2 if gated else n_w
    if bias is not None:
        _checked(bias, "bias", (n_w,), x)
    if residual is not None:
        _checked(residual, "residual", (x.shape[0], n_out), x)
    return n_out


def _checked(t: torch.Tensor, name: str, shape: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
    if tuple(t.shape) != shape or t.dtype != x.dtype or t.device != x.device:
        raise ValueError(f"{name} must be {list(shape)} {x.dtype} on {x.device}; got {list(t.shape)} {t.dtype} "
                         f"on {t.device}")
    return t
