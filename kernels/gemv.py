"""GEMV and GEMM for the CPU's decode and prefill, over weights prepared once when an executor is built.

Contract: x [T, K] f32 or bf16; a weight [N, K] in one of four formats (`GemvWeight`):
  f32 / bf16  the weight in column panels (kernels/panels.py), x's dtype   meaning: F.linear
  int8        codes i8 [N, K], scales f16 [N, K/G] (G % 16 == 0)          meaning: kernels/quant.py's qlinear_ref
  int4        codes u4x2 [N, K/2], scales and mins f16 [N, K/G]           meaning: qlinear_ref
              (G % 32 == 0)
bias [N] in x's dtype or None; returns [T, N] in x's dtype: products accumulated in fp32, bias added
in fp32, rounded once. `gemv_ref` is the meaning (and the fallback).

Layouts, decided once (`prepare_linear_weight`, `prepare_qlinear_weight`), one resident copy each:
  float       column panels of 32 outputs (kernels/panels.py), made from the artifact's weight when
              the executor is built, which then keeps only the panels. One kernel
              (kernels/cpu/panel_gemm.cpp) runs every token count: batch-1 decode streams the panels
              front to back, larger counts run as tiles of 12 tokens x 32 outputs in registers, as
              fast as oneDNN's GEMM on its own packed copy (`python -m llmc.tools.bench_gemv` prints
              the ratios), so no such copy is kept beside the weight.
  quantized   the codes as the artifact stores them, row-major: a few whole rows per pass, front to
              back (kernels/cpu/gemv.cpp: R rows x up to 4 tokens per pass, dequantized in
              registers, both cores streaming their own half of the rows; int4 in nibble order,
              gemv.cpp says how); above GEMV_MAX_TOKENS tokens the weight is dequantized to fp32 for
              the call (a transient copy) and oneDNN multiplies it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .panels import panel_linear_ref, panels_fit, to_panels
from .quant import dequantize_weight, qlinear_ref

GEMV_MAX_TOKENS = 128            # quantized weights: the native GEMV up to here, dequantized + oneDNN above
FLOAT_FORMATS = {torch.float32: "f32", torch.bfloat16: "bf16"}


@dataclass(frozen=True, eq=False)
class GemvWeight:
    """One GEMM weight as the native kernels take it. `weight` is a float weight's panels (holding
    `rows` outputs) or the int8 / int4 codes as the artifact stores them; scales (and int4 mins)
    f16 [N, K/G]. The facts a call checks (x dtypes it takes, N, K) are worked out here, once."""

    format: str                        # "f32", "bf16", "int8" or "int4"
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    group_size: int = 0                # quantized only
    rows: int = 0                      # float only: N, the outputs the panels hold
    bits: int = field(init=False)      # 8 or 4; 0 for float weights
    out_features: int = field(init=False)
    in_features: int = field(init=False)
    x_dtypes: tuple[torch.dtype, ...] = field(init=False)

    def __post_init__(self):
        bits = {"int8": 8, "int4": 4}.get(self.format, 0)
        if bits:
            n, k = self.weight.shape[0], self.weight.shape[1] * (2 if bits == 4 else 1)
        else:                          # panels: f32 [P, K, 32], bf16 [P, K/2, 32, 2]
            n, k = self.rows, self.weight.shape[1] * (2 if self.weight.dim() == 4 else 1)
        facts = dict(bits=bits, out_features=n, in_features=k,
                     x_dtypes=tuple(FLOAT_FORMATS) if bits else (self.weight.dtype,))
        for name, value in facts.items():
            object.__setattr__(self, name, value)

    @property
    def nbytes(self) -> int:
        """Bytes one pass over the weight reads (panels, or codes, scales and mins)."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales, self.mins) if t is not None)


def gemv_ref(x: torch.Tensor, w: GemvWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The meaning: F.linear for a float weight, qlinear_ref (fp32 dequantization) for a quantized one."""
    if w.bits:
        return qlinear_ref(x, w.weight, w.scales, w.mins, bias, bits=w.bits)
    return panel_linear_ref(x, w.weight, w.rows, bias)


def _native_layout(t: torch.Tensor | None) -> bool:
    return t is None or (t.device.type == "cpu" and t.is_contiguous())


def prepare_linear_weight(weight: torch.Tensor) -> GemvWeight | None:
    """A float [N, K] weight as panels for the native kernels (a new tensor, to be kept instead of
    `weight`), or None where they do not take it."""
    if not panels_fit(weight):
        return None
    return GemvWeight(FLOAT_FORMATS[weight.dtype], to_panels(weight), rows=weight.shape[0])


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
    """Launcher: gemv_ref's meaning through kernels/cpu/panel_gemm.cpp (float) or gemv.cpp
    (quantized; oneDNN on the dequantized weight above GEMV_MAX_TOKENS tokens)."""
    if not gemv_fits(x, w, bias):
        got = f"x {x.dtype} {tuple(x.shape)} on {x.device}" + ("" if bias is None else f", bias {bias.dtype} "
                                                                f"{tuple(bias.shape)}")
        raise ValueError(f"the native GEMV over a {w.format} [{w.out_features}, {w.in_features}] weight takes x "
                         f"[T, {w.in_features}] ({'f32 or bf16' if w.bits else w.format}) on the CPU and a "
                         f"contiguous bias [{w.out_features}] in x's dtype; got {got}")
    return run_gemv(x, w, bias)


def run_gemv(x: torch.Tensor, w: GemvWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`gemv_cpu` for inputs that `gemv_fits` has passed (the op table checks once, then runs this)."""
    if not w.bits:
        return torch.ops.llmc.panel_gemm(x.contiguous(), w.weight, w.rows, bias)
    if x.shape[0] <= GEMV_MAX_TOKENS:
        return torch.ops.llmc.qgemv(x, w.weight, w.scales, w.mins, bias, w.bits, w.group_size)
    weight = dequantize_weight(w.weight, w.scales, w.mins, w.bits)     # fp32: qlinear_ref's rounding
    return onednn_linear(x.float(), weight, None if bias is None else bias.float()).to(x.dtype)


def onednn_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's GEMM on `w` reordered for this call (the reorder is a transient copy); F.linear
    where this torch build has no oneDNN."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return F.linear(x, w, bias)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, x.shape[0])
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
