"""GEMM with a fused epilogue: y = epilogue(x @ w.T + bias), one Triton template.

Contract:
  x        [M, K]   fp32, fp16 or bf16 (any strides)
  w        [N_w, K] x's dtype, row-major as torch.nn.Linear stores it (any strides)
  bias     [N_w]    x's dtype, optional, added to the fp32 accumulator
  residual [M, N]   x's dtype, optional, added last
  out      [M, N]   x's dtype, optional preallocated output (may be `residual` itself)
The product accumulates in fp32 and the whole epilogue runs on the fp32 accumulator; the result
is rounded to x's dtype once, at the store. Epilogue, in order:
  gated=False: N = N_w;      y = act(x @ w.T + bias)       act: "none", "silu" or "gelu_tanh"
  gated=True:  N = N_w // 2; y = act(g) * u, g = columns [0, N), u = columns [N, 2N) of
               x @ w.T + bias (a merged gate/up GEMM followed by the gated activation: each
               program keeps two accumulators, for columns j and j + N, so the [M, 2N] product is
               never stored). act is SiLU (SwiGLU) with `activation` "none", the gate's SiLU
               implied, or GELU's tanh approximation (GeGLU) with "gelu_tanh".
  then y += residual;
  then, with softcap > 0, y = softcap * tanh(y / softcap) (Gemma 2's final-logit soft-capping).
RMSNorm prologue (`norm_linear_triton`): x replaced by rmsnorm(x, norm_weight) or, with
norm_residual r, by rmsnorm(h) where h = x + r (rounded to x's dtype, as add_rmsnorm's sum is)
is also returned: the norm before a GEMM (a layer's attention or MLP input, the final norm before
the LM head) costs no launch and no pass of its own. Per row, rmsnorm(x) @ w.T =
((x * norm_weight) @ w.T) * rsqrt(mean(x^2) + eps), so the sum of squares accumulates in the K
loop that streams x and the row's scale multiplies the fp32 accumulator before the epilogue; the
dot's operand x * norm_weight is rounded to x's dtype (a tensor-core operand). The unfused path
rounds at another point (the normed row, then its product with the weight, `rmsnorm_ref`), so in
fp16/bf16 the two differ by about one rounding of the operand per term: the same size as the
unfused path's own error against exact arithmetic, which is what the tests bound. The programs of
the first column tile (pid_n == 0) write h; K is the norm's width.
Decode attention's merge prologue (`merge_linear_triton`: the O projection after split decode
attention, kernels/triton/paged_decode_attention.py): A[m, h * D + d] = sum_j w_j acc_j[d] /
sum_j w_j sum_j, w_j = exp2(max_j - max_j' max_j') over the splits j of row m's head h, stage 2's
arithmetic (an empty sequence: divide by 1, zeros), formed per K tile in fp32 from a [BLOCK_M,
SPLITS, BLOCK_K] tile of the workspace reduced over the splits, then rounded to w's dtype as the
unfused path rounds the attention output: one launch less a layer. The K tile lies in one head
(BLOCK_K divides D: the config's K tile, capped at the largest power of two dividing D and at
MERGE_TILE values in the 3-D tile, 8 warps where a K tile of 16 holds more: `merge_config`).
Every column-tile program merges its rows again: for SmolLM2-135M's O projection (576 x 576, 9
heads of 64, N / BLOCK_N = 9 column tiles) at S = 1 (16 splits) a program re-reads 1 x 9 x 16 x 64
x 4 B = 36 KiB of acc, half the 72 KiB fp16 weight tile (64 x 576) it streams; at S = 16 (6
splits) 216 KiB, three times the tile, read from L2 (stage 1 wrote it just before) where the
weight comes from HBM. From 88 sequences on one split covers the context: stage 1 writes the
output and the GEMM has no prologue.
Each option is a `tl.constexpr` flag of one kernel, so the codegen instantiates one kernel per
fused group. Block sizes come from `pick_config(M, N, K)` (compiler/codegen/gemm_configs.py; the
code generator calls it at compile time): BLOCK_M 16 for decode-sized M, larger tiles for
prefill; M, N and K edges are masked (no divisibility is required). fp32 inputs use
IEEE fp32 dots (torch's default; no TF32). bf16 operands are upcast to fp32 for the dot on CPU
tensors, because Triton's interpreter computes bf16 dots wrongly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llmc.compiler.codegen.gemm_configs import GemmConfig, pick_config
from llmc.compiler.dtypes import from_torch
from llmc.compiler.ops.norms import add_rmsnorm_ref, rmsnorm_ref
from llmc.kernels.triton.paged_decode_attention import DecodeParts, decode_merge_ref

ACTIVATIONS = ("none", "silu", "gelu_tanh")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MERGE_TILE = 2048         # fp32 values of the merge prologue's [BLOCK_M, SPLITS, BLOCK_K] tile per 4 warps: 16 a thread


def linear_epilogue_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                        residual: torch.Tensor | None = None, *, activation: str = "none",
                        gated: bool = False, softcap: float = 0.0) -> torch.Tensor:
    """The contract in torch, every step in fp32, rounded to x's dtype at the end."""
    y = F.linear(x.float(), w.float(), None if bias is None else bias.float())   # [M, N_w]
    if gated:
        gate, up = y.chunk(2, dim=-1)                                           # [M, N] each
        y = (F.gelu(gate, approximate="tanh") if activation == "gelu_tanh" else F.silu(gate)) * up
    elif activation == "silu":
        y = F.silu(y)
    elif activation == "gelu_tanh":
        y = F.gelu(y, approximate="tanh")
    if residual is not None:
        y = y + residual.float()
    if softcap:
        y = softcap * torch.tanh(y / softcap)
    return y.to(x.dtype)


def norm_linear_ref(x: torch.Tensor, norm_weight: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                    residual: torch.Tensor | None = None, *, eps: float, rounding: str = "normed",
                    norm_residual: torch.Tensor | None = None, **epilogue) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The unfused path in torch: (add_)rmsnorm_ref rounded to x's dtype, then linear_epilogue_ref;
    returns (y, h) with h = x + norm_residual (None without one)."""
    if norm_residual is None:
        normed, h = rmsnorm_ref(x, norm_weight, eps, rounding), None
    else:
        normed, h = add_rmsnorm_ref(x, norm_residual, norm_weight, eps, rounding)
    return linear_epilogue_ref(normed, w, bias, residual, **epilogue), h


def merge_linear_ref(attn: torch.Tensor | DecodeParts, w: torch.Tensor, bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None, **epilogue) -> torch.Tensor:
    """The unfused path in torch: decode_merge_ref (stage 2's arithmetic, rounded to the dtype) where
    `attn` is the split workspace, then linear_epilogue_ref."""
    x = decode_merge_ref(attn) if isinstance(attn, DecodeParts) else attn
    return linear_epilogue_ref(x, w, bias, residual, **epilogue)


@dataclass(frozen=True)
class RowNorm:
    """The RMSNorm prologue's tensors (module docstring): weight [K]; residual [M, K] and sum_out
    [M, K] (h = x + residual written there) for add_rmsnorm, both None for rmsnorm."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    sum_out: torch.Tensor | None = None

    @property
    def kind(self) -> int:
        """The kernel's NORM flag: 1 rmsnorm, 2 add_rmsnorm."""
        return 1 if self.residual is None else 2


@triton.jit
def norm_prologue(a, offs_m, offs_k, K, mask, norm_w_ptr, add_ptr, sum_ptr, stride_am, stride_sm, write_sum, sq,
                  NORM: tl.constexpr):
    """The RMSNorm prologue on the x tile a [BM, BK] at rows offs_m, columns offs_k (absolute, of
    K), `mask` its valid elements: with NORM 2, h = a + add rounded to a's dtype (stored to sum if
    write_sum); then sq [BM] += the rows' squares of h and the tile becomes h * norm_w, rounded."""
    if NORM == 2:
        add = tl.load(add_ptr + offs_m[:, None] * stride_am + offs_k[None, :], mask=mask, other=0.0)
        a = (a.to(tl.float32) + add.to(tl.float32)).to(a.dtype)
        tl.store(sum_ptr + offs_m[:, None] * stride_sm + offs_k[None, :], a, mask=mask & write_sum)
    h = a.to(tl.float32)
    norm_w = tl.load(norm_w_ptr + offs_k, mask=offs_k < K, other=0.0)
    return (h * norm_w.to(tl.float32)[None, :]).to(a.dtype), sq + tl.sum(h * h, 1)


@triton.jit
def merge_prologue(acc_ptr, max_ptr, sum_ptr, offs_m, mask_m, k_start, num_splits, num_heads, dtype,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_K: tl.constexpr):
    """The A tile [BM, BK] at rows offs_m, columns [k_start, k_start + BK) (inside one head):
    stage 2's merge of the rows' splits in fp32 (module docstring), rounded to `dtype`."""
    head, offs_d = k_start // HEAD_DIM, k_start % HEAD_DIM + tl.arange(0, BLOCK_K)          # [BK]
    splits = tl.arange(0, SPLITS_PAD)
    mask = mask_m[:, None] & (splits < num_splits)[None, :]                                 # [BM, SP]
    part = (offs_m[:, None] * num_heads + head) * num_splits + splits[None, :]             # [BM, SP]
    m = tl.load(max_ptr + part, mask=mask, other=float("-inf"))
    l = tl.load(sum_ptr + part, mask=mask, other=0.0)
    acc = tl.load(acc_ptr + part[:, :, None] * D_PAD + offs_d[None, None, :], mask=mask[:, :, None], other=0.0)
    m_max = tl.max(m, 1)                                                                    # [BM]
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max)[:, None])            # empty split -> 0
    total = tl.sum(weight * l, 1)
    o = tl.sum(weight[:, :, None] * acc, 1) / tl.where(total == 0.0, 1.0, total)[:, None]  # [BM, BK]
    return o.to(dtype)


@triton.jit
def _linear_kernel(
    x_ptr,         # x [M, K]: the activations
    w_ptr,         # w [N_w, K]: the weight, rows are output columns (gate rows, then up rows if GATED)
    bias_ptr,      # bias [N_w]; not read unless HAS_BIAS
    residual_ptr,  # residual [M, N]; not read unless HAS_RESIDUAL
    out_ptr,       # out [M, N]: the result, written once, in out's dtype
    norm_w_ptr,    # the prologue's norm weight [K]; read only if NORM
    add_ptr,       # add_rmsnorm's residual [M, K] (row stride stride_am, unit column stride); only if NORM == 2
    sum_ptr,       # h = x + add [M, K] (row stride stride_sm), written by the pid_n == 0 programs if NORM == 2
    M, N, K,       # N is the output width (N_w // 2 when GATED)
    stride_xm, stride_xk, stride_wn, stride_wk, stride_rm, stride_rn, stride_om, stride_on, stride_am, stride_sm,
    softcap,       # fp32: the soft-cap, read only if SOFTCAP
    eps,           # fp32: the norm's eps, read only if NORM
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SILU: tl.constexpr, GELU: tl.constexpr,
    GATED: tl.constexpr, SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    NORM: tl.constexpr,  # the prologue: 0 none, 1 rmsnorm, 2 add_rmsnorm
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    # the merge prologue, last and with defaults (off) so a launch without it need not name it:
    part_acc_ptr=None,  # decode attention's split acc [M, K / HEAD_DIM, splits, D_PAD] fp32, read instead of x
    part_max_ptr=None,  # its max scores [M, K / HEAD_DIM, splits] fp32
    part_sum_ptr=None,  # its exp-sums, likewise
    num_splits=1,       # splits of the workspace
    MERGE: tl.constexpr = False, HEAD_DIM: tl.constexpr = 1, D_PAD: tl.constexpr = 1, SPLITS_PAD: tl.constexpr = 1,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)       # [BM]
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)       # [BN]
    offs_k = tl.arange(0, BLOCK_K)                                        # [BK]
    mask_m, mask_n = offs_m < M, offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk     # [BM, BK]
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk     # [BK, BN]: w.T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)               # used only if GATED
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)                           # used only if NORM: sum of h^2
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a_mask = mask_m[:, None] & (offs_k[None, :] < k_left)
        if MERGE:
            a = merge_prologue(part_acc_ptr, part_max_ptr, part_sum_ptr, offs_m, mask_m, k * BLOCK_K, num_splits,
                               K // HEAD_DIM, w_ptr.dtype.element_ty, HEAD_DIM, D_PAD, SPLITS_PAD, BLOCK_K)
        else:
            a = tl.load(x_ptrs, mask=a_mask, other=0.0)
        if NORM != 0:
            a, sq = norm_prologue(a, offs_m, k * BLOCK_K + offs_k, K, a_mask, norm_w_ptr, add_ptr, sum_ptr, stride_am,
                                  stride_sm, pid_n == 0, sq, NORM)
        w_mask = (offs_k[:, None] < k_left) & mask_n[None, :]
        b = tl.load(w_ptrs, mask=w_mask, other=0.0)
        acc = dot_acc(a, b, acc, DOT_FP32, INPUT_PRECISION)
        if GATED:
            b_up = tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0)
            acc_up = dot_acc(a, b_up, acc_up, DOT_FP32, INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    if NORM != 0:                                                         # the rows' 1 / rms, after the sum
        scale = tl.rsqrt(sq / K + eps)[:, None]
        acc, acc_up = acc * scale, acc_up * scale
    store_epilogue(acc, acc_up, offs_m, offs_n, M, N, bias_ptr, residual_ptr, out_ptr,
                   stride_rm, stride_rn, stride_om, stride_on, softcap, HAS_BIAS, HAS_RESIDUAL, SILU, GELU, GATED,
                   SOFTCAP)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program `pid` in the tutorial's grouped order: GROUP_M row
    tiles share each column tile in L2."""
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * tiles_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % group_size) % rows_in_group, (pid % group_size) // rows_in_group


@triton.jit
def store_epilogue(acc, acc_up, offs_m, offs_n, M, N, bias_ptr, residual_ptr, out_ptr,
                   stride_rm, stride_rn, stride_om, stride_on, softcap, HAS_BIAS: tl.constexpr,
                   HAS_RESIDUAL: tl.constexpr, SILU: tl.constexpr, GELU: tl.constexpr, GATED: tl.constexpr,
                   SOFTCAP: tl.constexpr):
    """The contract's epilogue on the fp32 accumulators [BM, BN] (acc_up: the up columns j + N,
    read only if GATED; the gate's activation GELU if GELU, else SiLU), then one rounding to out's
    dtype at the masked store."""
    mask_m, mask_n = offs_m < M, offs_n < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_ptr + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if GATED:
        if GELU:
            acc = gelu_tanh(acc) * acc_up
        else:
            acc = acc * tl.sigmoid(acc) * acc_up
    elif SILU:
        acc = acc * tl.sigmoid(acc)
    elif GELU:
        acc = gelu_tanh(acc)
    mask = mask_m[:, None] & mask_n[None, :]
    if HAS_RESIDUAL:
        r_ptrs = residual_ptr + offs_m[:, None] * stride_rm + offs_n[None, :] * stride_rn
        acc += tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
    if SOFTCAP:                                      # cap * tanh(acc / cap), tanh(z) = 2 sigmoid(2z) - 1
        acc = softcap * (2.0 * tl.sigmoid(2.0 * (acc / softcap)) - 1.0)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gelu_tanh(a):
    """0.5 a (1 + tanh(z)), z = sqrt(2/pi) (a + 0.044715 a^3), as a * sigmoid(2z): the same value,
    without 1 + tanh's cancellation for very negative a."""
    return a * tl.sigmoid(1.5957691216057308 * (a + 0.044715 * a * a * a))


@triton.jit
def dot_acc(a, b, acc, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """acc + a @ b, the operands upcast to fp32 first when DOT_FP32."""
    if DOT_FP32:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


def linear_triton(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, *, activation: str = "none", gated: bool = False,
                  softcap: float = 0.0, out: torch.Tensor | None = None, config: GemmConfig | None = None,
                  norm: RowNorm | None = None, merge: DecodeParts | None = None) -> torch.Tensor:
    """Launcher: checks the contract (ValueError naming the bad value), picks a config unless
    given one, launches one program per output tile, returns `out`. `norm`: the RMSNorm prologue
    (norm_linear_triton's, which checks it); `merge`: the merge prologue, x an unread stand-in
    (merge_linear_triton's, which checks it and fits the config's K tile)."""
    n_out = _check_linear_inputs(x, w, bias, residual, activation, gated)
    check_softcap(softcap)
    M, K = x.shape
    out = _checked_out(out, x, (M, n_out))
    if M == 0 or n_out == 0:
        return out
    cfg = config or pick_config(M, n_out, K, gated=gated, dtype=from_torch(x.dtype))
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(n_out, cfg.block_n),)
    res_strides = residual.stride() if residual is not None else (0, 0)
    dot_fp32 = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and x.device.type == "cpu")
    add, h = (norm.residual, norm.sum_out) if norm is not None and norm.kind == 2 else (x, x)   # x: unread
    merging = {} if merge is None else dict(
        part_acc_ptr=merge.acc, part_max_ptr=merge.max, part_sum_ptr=merge.sum, num_splits=merge.acc.shape[2],
        MERGE=True, HEAD_DIM=merge.head_dim, D_PAD=merge.acc.shape[3],
        SPLITS_PAD=triton.next_power_of_2(merge.acc.shape[2]))
    _linear_kernel[grid](
        x, w, bias if bias is not None else x, residual if residual is not None else x, out,
        norm.weight if norm is not None else x, add, h,
        M, n_out, K, *x.stride(), *w.stride(), *res_strides, *out.stride(), add.stride(0), h.stride(0),
        float(softcap), float(norm.eps) if norm is not None else 0.0,
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, SILU=activation == "silu",
        GELU=activation == "gelu_tanh", GATED=gated, SOFTCAP=softcap > 0,
        DOT_FP32=dot_fp32, INPUT_PRECISION="ieee" if dot_fp32 else "tf32", NORM=norm.kind if norm is not None else 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **merging,
    )
    return out


def norm_linear_triton(x: torch.Tensor, norm_weight: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                       residual: torch.Tensor | None = None, *, eps: float, norm_residual: torch.Tensor | None = None,
                       **options) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launcher of the GEMM with the RMSNorm prologue (module docstring): (y, h), h = x +
    norm_residual in x's dtype, or None without norm_residual. `options`: linear_triton's."""
    norm = row_norm(x, norm_weight, eps, norm_residual)
    return linear_triton(x, w, bias, residual, norm=norm, **options), norm.sum_out


def merge_linear_triton(attn: torch.Tensor | DecodeParts, w: torch.Tensor, bias: torch.Tensor | None = None,
                        residual: torch.Tensor | None = None, *, config: GemmConfig | None = None,
                        **options) -> torch.Tensor:
    """Launcher of the O projection after decode attention's stage 1 (paged_decode_attention_parts):
    with its output (one split) the plain GEMM; with its workspace the GEMM whose prologue is the
    merge (module docstring). `options`: linear_triton's."""
    if not isinstance(attn, DecodeParts):
        return linear_triton(attn, w, bias, residual, config=config, **options)
    num_seqs, heads, _, _ = attn.acc.shape
    if attn.dtype != w.dtype or heads * attn.head_dim != w.shape[-1]:
        raise ValueError(f"the merge prologue takes w [N, {heads} heads x {attn.head_dim}] {attn.dtype}; got w "
                         f"{tuple(w.shape)} {w.dtype}")
    x = w.new_empty(()).expand(num_seqs, heads * attn.head_dim)          # [M, K]: shape and dtype only, unread
    n_out = w.shape[0] // 2 if options.get("gated") else w.shape[0]
    gated = options.get("gated", False)
    cfg = config or pick_config(num_seqs, n_out, x.shape[1], gated=gated, dtype=from_torch(w.dtype))
    return linear_triton(x, w, bias, residual, config=merge_config(cfg, attn), merge=attn, **options)


def merge_config(cfg: GemmConfig, attn: DecodeParts) -> GemmConfig:
    """cfg with a K tile inside one head (the largest power of two <= cfg's dividing head_dim) and a
    merge tile [BLOCK_M, SPLITS, BLOCK_K] of at most MERGE_TILE values, or, where a K tile of 16
    holds more, 8 warps; ValueError where head_dim has no K tile of 16 (the GPU's smallest dot). On
    sm_90 (aot_compile) tiles of 4096 values over 4 warps spilled 20-104 B at M 24-37 in fp16/bf16
    (255 registers), and fp32's 32 x 4 x 32 over 8 warps 4 B."""
    if attn.head_dim % 16:
        raise ValueError(f"the merge prologue takes a head_dim that is a multiple of 16; got {attn.head_dim}: "
                         "run the merge stage on its own (paged_decode_attention_triton)")
    rows_splits = cfg.block_m * triton.next_power_of_2(attn.acc.shape[2])
    block_k = min(cfg.block_k, attn.head_dim & -attn.head_dim, max(16, MERGE_TILE // rows_splits))
    warps = cfg.num_warps if rows_splits * block_k <= MERGE_TILE else max(cfg.num_warps, 8)
    return dataclasses.replace(cfg, block_k=block_k, num_warps=warps)


def row_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None) -> RowNorm:
    """The prologue's RowNorm for x [M, K] after checking its operands (ValueError naming the bad
    one), with a fresh sum_out [M, K] where there is a residual (add_rmsnorm)."""
    if x.dim() != 2:
        raise ValueError(f"the norm prologue takes x [M, K]; got {tuple(x.shape)}")
    _check_operand("norm_weight", weight, (x.shape[1],), x)
    if weight.stride(0) != 1:
        raise ValueError(f"norm_weight must be contiguous; got stride {weight.stride()}")
    if residual is None:
        return RowNorm(weight, eps)
    _check_operand("norm_residual", residual, tuple(x.shape), x)
    if residual.stride(1) != 1:
        raise ValueError(f"norm_residual must have contiguous rows; got strides {residual.stride()}")
    return RowNorm(weight, eps, residual, torch.empty(x.shape, dtype=x.dtype, device=x.device))


def check_softcap(softcap: float) -> None:
    if not softcap >= 0:
        raise ValueError(f"softcap must be 0 (off) or a positive cap; got {softcap!r}")


def _check_linear_inputs(x, w, bias, residual, activation, gated) -> int:
    """The output width N, after checking every input against the contract."""
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"linear_triton takes x [M, K] and w [N, K]; got x {tuple(x.shape)}, w {tuple(w.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"linear_triton takes fp32, fp16 or bf16; got x {x.dtype}")
    if w.dtype != x.dtype or w.device != x.device:
        raise ValueError(f"w must match x's dtype and device ({x.dtype}, {x.device}); got {w.dtype} on {w.device}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"w {tuple(w.shape)} does not take x {tuple(x.shape)}: K must match")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {ACTIVATIONS}")
    if gated and (activation not in ("none", "gelu_tanh") or w.shape[0] % 2):
        raise ValueError(f"gated takes w [2N, K] and activation 'none' (the gate's silu implied) or 'gelu_tanh'; "
                         f"got w {tuple(w.shape)}, activation {activation!r}")
    n_out = w.shape[0] // 2 if gated else w.shape[0]
    _check_operand("bias", bias, (w.shape[0],), x)
    _check_operand("residual", residual, (x.shape[0], n_out), x)
    return n_out


def _check_operand(name: str, t: torch.Tensor | None, shape: tuple[int, ...], x: torch.Tensor) -> None:
    if t is None:
        return
    if tuple(t.shape) != shape or t.dtype != x.dtype or t.device != x.device:
        raise ValueError(f"{name} must be {list(shape)} {x.dtype} on {x.device}; got {list(t.shape)} {t.dtype} "
                         f"on {t.device}")


def _checked_out(out: torch.Tensor | None, x: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=x.dtype, device=x.device)
    _check_operand("out", out, shape, x)
    return out
