"""GEMV and small-batch GEMM for decode on the CPU, over weights prepared once when an executor is built.

Contract: x [T, K] f32 or bf16; a weight [N, K] in one of four formats (`GemvWeight`):
  f32 / bf16  the weight itself, in x's dtype                     meaning: F.linear
  int8        codes i8 [N, K], scales f16 [N, K/G] (G % 16 == 0)  meaning: kernels/quant.py's qlinear_ref
  int4        codes u4x2 [N, K/2], scales and mins f16 [N, K/G]   meaning: qlinear_ref
              (G % 32 == 0)
bias [N] in x's dtype or None; returns [T, N] in x's dtype: products accumulated in fp32, bias added
in fp32, rounded once. `gemv_ref` is the meaning (and the fallback).

Layout: a weight stays as the artifact stores it, row-major [N, K]. Read a few whole rows per pass,
a row-major matrix streams front to back, which is all that batch-1 decode needs to run at the
memory bandwidth, so preparing a weight copies nothing: one resident copy per weight, shared with
anything else that reads it (a tied embedding). What preparing decides, once, is the format, the
group size and that the native kernel takes the weight at all.

A float weight may also carry a second copy packed once in oneDNN's blocked layout (`packed`,
made by `prepare_linear_weight(..., pack=True)`): oneDNN's GEMM on it beats the native kernel
from about 16 tokens on (0.66x its time at 64 tokens on the 2-core EPYC), which is what batched
decode and prefill run at. It doubles a float weight's resident bytes; quantized weights never
carry one.

Paths by the token count T (`python -m llmc.tools.bench_gemv` measures the crossovers: on the
2-core EPYC the native kernel beats a packed copy up to about 8 tokens, and oneDNN with a
per-call reorder up to about 128 tokens, f32 and bf16):
  T <= PACKED_MIN_TOKENS - 1, or T <= GEMV_MAX_TOKENS without a packed copy:
                        kernels/cpu/gemv.cpp: R rows x up to 4 tokens per pass, dequantized in
                        registers (above 4 tokens each R-row block is dequantized once into an
                        L1 buffer), both cores streaming their own half of the rows; bf16 by
                        AVX512-BF16 pair products where the CPU has them, int4 in nibble order
                        (gemv.cpp says how)
  larger T              oneDNN's GEMM on the packed copy, or on the weight reordered for that call, a quantized weight
                        first dequantized to fp32 (transient copies, freed after the call; the
                        resident weight stays the only one)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .linear import PackedLinear, packable
from .quant import dequantize_weight, qlinear_ref

GEMV_MAX_TOKENS = 128
PACKED_MIN_TOKENS = 9            # from here on a packed copy (where there is one) beats the native kernel
FLOAT_FORMATS = {torch.float32: "f32", torch.bfloat16: "bf16"}


@dataclass(frozen=True, eq=False)
class GemvWeight:
    """One GEMM weight as the native kernels take it. `weight` is the f32/bf16 [N, K] weight or the
    int8 / int4 codes; scales (and int4 mins) f16 [N, K/G]. The tensors are the artifact's own.
    The facts a call checks (x dtypes it takes, N, K) are worked out here, once."""

    format: str                        # "f32", "bf16", "int8" or "int4"
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    group_size: int = 0                # quantized only
    packed: PackedLinear | None = None  # float only: the same weight in oneDNN's layout, for larger T
    bits: int = field(init=False)      # 8 or 4; 0 for float weights
    out_features: int = field(init=False)
    in_features: int = field(init=False)
    x_dtypes: tuple[torch.dtype, ...] = field(init=False)

    def __post_init__(self):
        bits = {"int8": 8, "int4": 4}.get(self.format, 0)
        x_dtypes = tuple(FLOAT_FORMATS) if bits else (self.weight.dtype,)
        facts = dict(bits=bits, out_features=self.weight.shape[0], x_dtypes=x_dtypes,
                     in_features=self.weight.shape[1] * (2 if bits == 4 else 1))
        for name, value in facts.items():
            object.__setattr__(self, name, value)

    @property
    def nbytes(self) -> int:
        """Bytes one pass over the weight reads (codes, scales and mins)."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales, self.mins) if t is not None)


def gemv_ref(x: torch.Tensor, w: GemvWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The meaning: F.linear for a float weight, qlinear_ref (fp32 dequantization) for a quantized one."""
    if w.bits:
        return qlinear_ref(x, w.weight, w.scales, w.mins, bias, bits=w.bits)
    return F.linear(x, w.weight, bias)


def _native_layout(t: torch.Tensor | None) -> bool:
    return t is None or (t.device.type == "cpu" and t.is_contiguous())


def prepare_linear_weight(weight: torch.Tensor, pack: bool = False) -> GemvWeight | None:
    """A float [N, K] weight for the native kernels (with a oneDNN-packed copy for larger T if
    `pack`), or None where they do not take it."""
    if weight.dim() != 2 or weight.dtype not in FLOAT_FORMATS or not _native_layout(weight) or not weight.numel():
        return None
    return GemvWeight(FLOAT_FORMATS[weight.dtype], weight, packed=PackedLinear(weight) if pack and packable(weight)
                      else None)


def prepare_qlinear_weight(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, *, bits: int,
                           group_size: int) -> GemvWeight | None:
    """A quantized weight (kernels/quant.py's layout) for the native kernels, or None where they do not take it."""
    step = 16 if bits == 8 else 32
    if group_size % step or scales.dtype != torch.float16 or not all(map(_native_layout, (codes, scales, mins))):
        return None
    if bits == 4 and (mins is None or mins.dtype != torch.float16):
        return None
    return GemvWeight("int8" if bits == 8 else "int4", codes, scales, mins, group_size)


def gemv_fits(x: torch.Tensor, w: GemvWeight, bias: torch.Tensor | None = None) -> bool:
    """Whether `gemv_cpu` takes x (and bias) for this weight (else run gemv_ref). Cheap: it runs per call."""
    return (x.dtype in w.x_dtypes and x.is_cpu and x.dim() == 2 and x.shape[1] == w.in_features
            and (bias is None or (bias.dtype == x.dtype and bias.is_cpu and bias.is_contiguous()
                                  and bias.shape == (w.out_features,))))


def gemv_cpu(x: torch.Tensor, w: GemvWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Launcher: gemv_ref's meaning through kernels/cpu/gemv.cpp, or oneDNN above GEMV_MAX_TOKENS tokens."""
    if not gemv_fits(x, w, bias):
        got = f"x {x.dtype} {tuple(x.shape)} on {x.device}" + ("" if bias is None else f", bias {bias.dtype} "
                                                                f"{tuple(bias.shape)}")
        raise ValueError(f"the native GEMV over a {w.format} [{w.out_features}, {w.in_features}] weight takes x "
                         f"[T, {w.in_features}] ({'f32 or bf16' if w.bits else w.format}) on the CPU and a "
                         f"contiguous bias [{w.out_features}] in x's dtype; got {got}")
    return run_gemv(x, w, bias)


def run_gemv(x: torch.Tensor, w: GemvWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`gemv_cpu` for inputs that `gemv_fits` has passed (the op table checks once, then runs this)."""
    if w.packed is not None and x.shape[0] >= PACKED_MIN_TOKENS:
        return w.packed(x, bias)
    if x.shape[0] <= GEMV_MAX_TOKENS:
        if w.bits:
            return torch.ops.llmc.qgemv(x, w.weight, w.scales, w.mins, bias, w.bits, w.group_size)
        return torch.ops.llmc.gemv(x, w.weight, bias)
    if w.bits:                           # fp32 dequantization, fp32 GEMM: qlinear_ref's rounding
        weight = dequantize_weight(w.weight, w.scales, w.mins, w.bits)
        return onednn_linear(x.float(), weight, None if bias is None else bias.float()).to(x.dtype)
    return onednn_linear(x, w.weight, bias)


def onednn_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's GEMM on `w` reordered for this call (the reorder is a transient copy); F.linear
    where this torch build has no oneDNN."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return F.linear(x, w, bias)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, x.shape[0])
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
