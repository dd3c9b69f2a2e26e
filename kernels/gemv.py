"""GEMV and GEMM for the CPU's decode and prefill, over weights prepared once when an executor is built.

Contract: x [T, K] f32 or bf16; a weight [N, K] in one of four formats (`GemvWeight`), held as
column panels of 32 outputs (kernels/panels.py):
  f32 / bf16  the weight, in x's dtype                               meaning: F.linear
  int8        codes i8, scales f16 per group of G (G % 16 == 0)      meaning: kernels/quant.py's qlinear_ref
  int4        codes u4 in pairs, scales and mins f16 (G % 32 == 0)   meaning: qlinear_ref
A quantized weight prepared for int8 activations (`activations="int8"`, G % 32 == 0) holds its codes
as quads instead (layout "quads": kernels/cpu/qdot_gemm.cpp, integer dot products, AVX512-VNNI where
the CPU has it); its meaning is kernels/quant.py's qlinear_int8act_ref. With `activations="bf16"`
the quads' GEMMs of a prompt (PROMPT_MIN_TOKENS or more tokens, where AMX-BF16 is usable) multiply x
rounded to bf16 by the weight dequantized to bf16 instead (kernels/cpu/amx_dequant_gemm.h; meaning
qlinear_bf16_ref), fewer tokens stay int8; with `activations="f32"` those of F32_PROMPT_MIN_TOKENS or
more tokens multiply x by the weight dequantized to fp32 (kernels/cpu/f32_dequant_gemm.h; meaning
qlinear_ref). The layout is decided once, so one copy stays resident.
bias [N] in x's dtype or None; returns [T, N] in x's dtype: products accumulated in fp32, bias added
in fp32, rounded once. `gemv_ref` is the meaning (and the fallback).

The panels are made from the artifact's tensors when the executor is built (`prepare_linear_weight`,
`prepare_qlinear_weight`) and the executor keeps only them: one resident copy per weight. One
kernel per kind runs every token count: batch-1 decode streams the panels front to back, larger
counts run as tiles of tokens x 32 outputs in registers (kernels/cpu/panel_gemm.cpp: 12 tokens,
float; kernels/cpu/qpanel_gemm.cpp: 4 tokens, codes widened in registers into per-group partial
sums, scaled once per group). Float panels run within a few percent of oneDNN's GEMM on its own
packed copy at large token counts and faster below (`python -m llmc.tools.bench_gemv` prints the
ratios), so no such copy is kept beside the weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .panels import (column_panels, panel_linear_ref, panel_rows, panels_fit, qdot_bf16_linear_ref, qdot_f32_linear_ref,
                     qdot_linear_ref, qpanel_linear_ref, quad_panels, quad_rows, quantized_panels, quantized_rows,
                     to_panels)
from .quant import ACT_BLOCK

FLOAT_FORMATS = {torch.float32: "f32", torch.bfloat16: "bf16"}
# what a quantized weight's GEMM multiplies: x as given, int8 per block, or int8 but bf16 (fp32) for a prompt
ACTIVATIONS = ("float", "int8", "bf16", "f32")
PROMPT_MIN_TOKENS = 32              # llmc_amx_dq::kMinTokens
F32_PROMPT_MIN_TOKENS = 16          # llmc_f32_dq::kMinTokens
PROMPT_CODES = {"int8": 0, "bf16": 1, "f32": 2}     # qdot_gemm's `prompts`, and the step plan's qlinear's


@dataclass(frozen=True, eq=False)
class GemvWeight:
    """One GEMM weight as the native kernels take it, in panels (kernels/panels.py): `weight` is a
    float weight's or the int8 / int4 codes'; scales (and int4 mins) f16 [P, K/G, 32]; `rows` the
    N outputs they hold. The facts a call checks (x dtypes it takes, N, K) are worked out here, once."""

    format: str                        # "f32", "bf16", "int8" or "int4"
    weight: torch.Tensor
    rows: int                          # N
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    group_size: int = 0                # quantized only
    layout: str = "panels"             # or "quads" (a quantized weight for int8 activations)
    prompts: str = "int8"              # quads: "bf16" where a prompt's GEMMs take bf16 on AMX, or "f32"
    bits: int = field(init=False)      # 8 or 4; 0 for float weights
    out_features: int = field(init=False)
    in_features: int = field(init=False)
    x_dtypes: tuple[torch.dtype, ...] = field(init=False)

    def __post_init__(self):
        bits = {"int8": 8, "int4": 4}.get(self.format, 0)
        pairs = self.format in ("bf16", "int4")       # [P, K/2, 32(, 2)]: inputs in pairs
        per_row = (4 if bits == 8 else 8) if self.layout == "quads" else (2 if pairs else 1)
        facts = dict(bits=bits, out_features=self.rows, in_features=self.weight.shape[1] * per_row,
                     x_dtypes=tuple(FLOAT_FORMATS) if bits else (self.weight.dtype,))
        for name, value in facts.items():
            object.__setattr__(self, name, value)

    @property
    def nbytes(self) -> int:
        """Bytes one pass over the weight reads (panels, or codes, scales and mins)."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales, self.mins) if t is not None)


def gemv_ref(x: torch.Tensor, w: GemvWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The meaning: F.linear for a float weight, qlinear_ref (fp32 dequantization) for a quantized one;
    quads qlinear_int8act_ref, or for a prompt with bf16 prompts where AMX-BF16 is usable qlinear_bf16_ref,
    with f32 prompts qlinear_ref."""
    if w.layout == "quads" and w.prompts == "bf16" and x.shape[0] >= PROMPT_MIN_TOKENS and bf16_prompts_run():
        return qdot_bf16_linear_ref(x, w.weight, w.scales, w.mins, w.rows, bias, bits=w.bits)
    if w.layout == "quads" and w.prompts == "f32" and x.shape[0] >= F32_PROMPT_MIN_TOKENS:
        return qdot_f32_linear_ref(x, w.weight, w.scales, w.mins, w.rows, bias, bits=w.bits)
    if w.layout == "quads":
        return qdot_linear_ref(x, w.weight, w.scales, w.mins, w.rows, bias, bits=w.bits)
    if w.bits:
        return qpanel_linear_ref(x, w.weight, w.scales, w.mins, w.rows, bias, bits=w.bits)
    return panel_linear_ref(x, w.weight, w.rows, bias)


def bf16_prompts_run() -> bool:
    """Whether a prompt's quads GEMM with bf16 prompts takes bf16 here now (AMX-BF16 usable, not overridden)."""
    return torch.ops.llmc.cpu_prompt_qgemm_path()[0] == "amx-bf16"


def _native_layout(t: torch.Tensor | None) -> bool:
    return t is None or (t.device.type == "cpu" and t.is_contiguous())


def prepare_linear_weight(weight: torch.Tensor) -> GemvWeight | None:
    """A float [N, K] weight as panels for the native kernels (a new tensor, to be kept instead of
    `weight`), or None where they do not take it."""
    if not panels_fit(weight):
        return None
    return GemvWeight(FLOAT_FORMATS[weight.dtype], to_panels(weight), weight.shape[0])


def int8_activations_fit(in_features: int, group_size: int) -> bool:
    """Whether the int8-activation kernel takes a quantized weight: its groups whole blocks of 32 inputs."""
    return group_size % ACT_BLOCK == 0 and in_features % group_size == 0


def prepare_qlinear_weight(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, *, bits: int,
                           group_size: int, activations: str = "float") -> GemvWeight | None:
    """A quantized weight (kernels/quant.py's layout) as panels for the native kernels (new tensors,
    to be kept instead of the artifact's), or None where they do not take it. activations "int8":
    as quads for the int8-activation kernel (the caller checks `int8_activations_fit` first); "bf16":
    the same quads, a prompt's GEMMs in bf16 on AMX where usable; "f32": a prompt's GEMMs in fp32."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations {activations!r} is not one of {ACTIVATIONS}")
    step = 16 if bits == 8 else 32
    if group_size % step or scales.dtype != torch.float16 or not all(map(_native_layout, (codes, scales, mins))):
        return None
    if bits == 4 and (mins is None or mins.dtype != torch.float16):
        return None
    fmt = "int8" if bits == 8 else "int4"
    if activations != "float":
        return GemvWeight(fmt, quad_panels(codes, bits), codes.shape[0], column_panels(scales),
                          None if mins is None else column_panels(mins), group_size, "quads", activations)
    panels, scale_panels, min_panels = quantized_panels(codes, scales, mins, bits)
    return GemvWeight(fmt, panels, codes.shape[0], scale_panels, min_panels, group_size)


def quantized_weight_rows(w: GemvWeight, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows `rows` [R] of a prepared quantized weight as (codes, scales, mins) in the artifact's layout
    (a tied embedding's lookup)."""
    if w.layout == "panels":
        return quantized_rows(w.weight, w.scales, w.mins, rows, w.bits)
    return (quad_rows(w.weight, rows, w.bits), panel_rows(w.scales, rows),
            None if w.mins is None else panel_rows(w.mins, rows))


def gemv_fits(x: torch.Tensor, w: GemvWeight, bias: torch.Tensor | None = None) -> bool:
    """Whether `gemv_cpu` takes x (and bias) for this weight (else run gemv_ref). Cheap: it runs per call."""
    return (x.dtype in w.x_dtypes and x.is_cpu and x.dim() == 2 and x.shape[1] == w.in_features
            and (bias is None or (bias.dtype == x.dtype and bias.is_cpu and bias.is_contiguous()
                                  and bias.shape == (w.out_features,))))


def gemv_cpu(x: torch.Tensor, w: GemvWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Launcher: gemv_ref's meaning through kernels/cpu/panel_gemm.cpp (float), qpanel_gemm.cpp (quantized)
    or qdot_gemm.cpp (quantized, int8 activations)."""
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
    if w.layout == "quads":
        return torch.ops.llmc.qdot_gemm(x, w.weight, w.scales, w.mins, w.rows, bias, w.bits, w.group_size, True,
                                        PROMPT_CODES[w.prompts])
    return torch.ops.llmc.qpanel_gemm(x, w.weight, w.scales, w.mins, w.rows, bias, w.bits, w.group_size)
