"""GEMM weights in column panels: the one layout the native CPU kernels keep for a linear's or a
qlinear's weight, read by one kernel per kind (kernels/cpu/panel_gemm.cpp for f32/bf16,
kernels/cpu/qpanel_gemm.cpp for int8/int4, dequantizing in registers) at every token count.

Layout (`column_panels`): a matrix [N, X] becomes P = ceil(N / 32) panels of 32 rows (rows past N
zero) with each column's 32 values together: panels[p, x, j] = m[32p + j, x]. Applied to
  f32 weight [N, K]          -> [P, K, 32]
  bf16 weight [N, K]         -> [P, K/2, 32, 2]   (inputs in pairs, K even: the pair is one column)
  int8 codes [N, K]          -> [P, K, 32]
  int4 codes [N, K/2]        -> [P, K/2, 32]      bytes re-paired first: input 2i in the low nibble,
                                                  2i + 1 in the high (`int4_pairs`; the artifact
                                                  keeps GGUF's block order, kernels/quant.py)
  scales, mins [N, K/G] f16  -> [P, K/G, 32]
With int8 activations (kernels/cpu/qdot_gemm.cpp) the codes are quads instead, each output's 4
consecutive inputs in one 32-bit lane, as vpdpbusd and AMX-INT8's B tiles read them (`quad_panels`):
  int8 codes [N, K]          -> uint8 [P, K/4, 32, 4]   code + 128 (the instruction's unsigned side)
  int4 codes [N, K/2]        -> uint8 [P, K/8, 32, 4]   byte r of lane (i, j): input 8i + r in the low
                                                        nibble, 8i + 4 + r in the high
A batch-1 decode then streams each thread's panels front to back, and a tile of tokens x 32
outputs accumulates with the outputs as vector lanes (no horizontal sums); oneDNN's blocked
layouts are the same idea, but opaque, so a second copy would have to be kept beside the weight.

The kernels' contract: x [T, K] (float panels: in their dtype; quantized: f32 or bf16) and bias
[N] in x's dtype or None give [T, N] in x's dtype, products accumulated in fp32, bias added in
fp32, rounded once. The meanings are the `_ref`s here: F.linear, and kernels/quant.py's
qlinear_ref, on the weight the panels hold; the launcher that checks a call is kernels/gemv.py's
`gemv_cpu`. `panel_rows` reads rows back (a tied embedding's lookup; the refs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .quant import pack_int4, qlinear_bf16_ref, qlinear_int8act_ref, qlinear_ref, unpack_int4

PANEL = 32                       # output rows per panel
PANEL_DTYPES = (torch.float32, torch.bfloat16)


def column_panels(m: torch.Tensor) -> torch.Tensor:
    """m [N, X] -> panels [P, X, 32] (a new tensor; rows past N zero)."""
    n, x = m.shape
    return F.pad(m, (0, 0, 0, -n % PANEL)).view(-1, PANEL, x).transpose(1, 2).contiguous()


def panel_rows(panels: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` (int, any shape) of the matrix the panels hold: [*rows.shape, X] (bf16 weight
    panels: [*rows.shape, K])."""
    flat = rows.reshape(-1)
    picked = panels[flat // PANEL, :, flat % PANEL]                      # [R, X] (bf16 pairs: [R, K/2, 2])
    return picked.reshape(*rows.shape, -1)


def panels_fit(weight: torch.Tensor) -> bool:
    """Whether `to_panels` takes this float weight: 2-D f32 or bf16 on the CPU (bf16 with an even K)."""
    return (weight.dim() == 2 and weight.dtype in PANEL_DTYPES and weight.device.type == "cpu"
            and weight.numel() > 0 and (weight.dtype == torch.float32 or weight.shape[1] % 2 == 0))


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """A float weight [N, K] -> its panels (a new tensor; the layout above)."""
    if not panels_fit(weight):
        raise ValueError(f"panels take a 2-D f32 or bf16 CPU weight (bf16 with an even K), not {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    if weight.dtype == torch.float32:
        return column_panels(weight)                                      # [P, K, 32]
    pairs = column_panels(weight.view(torch.int32))                       # [P, K/2, 32] pairs as int32
    return pairs.view(torch.bfloat16).view(*pairs.shape, 2)               # [P, K/2, 32, 2]


def from_panels(panels: torch.Tensor, n: int) -> torch.Tensor:
    """The float weight [N, K] back (a new tensor)."""
    return panel_rows(panels, torch.arange(n))


def int4_pairs(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes [N, K/2] in GGUF's block order -> the same codes with input 2i in byte i's low
    nibble and 2i + 1 in its high."""
    q = unpack_int4(codes)                                                # [N, K] in 0..15
    return q[:, 0::2] | (q[:, 1::2] << 4)


def gguf_order(pairs: torch.Tensor) -> torch.Tensor:
    """`int4_pairs` undone: paired codes [R, K/2] -> GGUF's block order."""
    q = torch.stack([pairs & 0xF, pairs >> 4], dim=-1).reshape(pairs.shape[0], -1)   # [R, K]
    return pack_int4(q)


def quantized_panels(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                     bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A quantized weight as the artifact stores it -> (codes, scales, mins) panels (new tensors)."""
    codes = column_panels(int4_pairs(codes) if bits == 4 else codes)
    return codes, column_panels(scales), None if mins is None else column_panels(mins)


def quad_panels(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Quantized codes as the artifact stores them -> quads (the layout above; a new tensor)."""
    if bits == 8:
        lanes = (codes.to(torch.int16) + 128).to(torch.uint8)                   # [N, K]
    else:
        q = unpack_int4(codes)                                                # [N, K] in 0..15
        octets = q.view(q.shape[0], -1, 2, 4)                                 # [N, K/8, low|high, 4]
        lanes = (octets[:, :, 0] | (octets[:, :, 1] << 4)).reshape(q.shape[0], -1)   # [N, K/2]
    quads = column_panels(lanes.contiguous().view(torch.int32))               # [P, K/4 or K/8, 32]
    return quads.view(torch.uint8).view(*quads.shape, 4)


def quad_rows(quads: torch.Tensor, rows: torch.Tensor, bits: int) -> torch.Tensor:
    """Rows `rows` [R] of the codes quads hold, in the artifact's layout (`quad_panels` undone)."""
    picked = quads[rows // PANEL, :, rows % PANEL]                            # [R, K/4 or K/8, 4]
    if bits == 8:
        return (picked.reshape(len(rows), -1).to(torch.int16) - 128).to(torch.int8)
    q = torch.stack([picked & 0xF, picked >> 4], dim=2)                      # [R, K/8, low|high, 4]
    return pack_int4(q.reshape(len(rows), -1))


def quantized_rows(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, rows: torch.Tensor,
                   bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows `rows` [R] of a quantized weight held as panels, in the artifact's layout."""
    picked = panel_rows(codes, rows)
    return ((gguf_order(picked) if bits == 4 else picked), panel_rows(scales, rows),
            None if mins is None else panel_rows(mins, rows))


def panel_linear_ref(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The meaning: F.linear on the unpacked weight."""
    return F.linear(x, from_panels(panels, n), bias)


def qpanel_linear_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, n: int,
                      bias: torch.Tensor | None = None, *, bits: int) -> torch.Tensor:
    """The meaning: qlinear_ref on the weight the panels hold."""
    return qlinear_ref(x, *quantized_rows(codes, scales, mins, torch.arange(n), bits), bias, bits=bits)


def qdot_bf16_linear_ref(x: torch.Tensor, quads: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                         n: int, bias: torch.Tensor | None = None, *, bits: int) -> torch.Tensor:
    """The meaning of a prompt's quads GEMM on AMX-BF16: qlinear_bf16_ref on the weight the quads hold."""
    rows = torch.arange(n)
    return qlinear_bf16_ref(x, quad_rows(quads, rows, bits), panel_rows(scales, rows),
                            None if mins is None else panel_rows(mins, rows), bias, bits=bits)


def qdot_f32_linear_ref(x: torch.Tensor, quads: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                        n: int, bias: torch.Tensor | None = None, *, bits: int) -> torch.Tensor:
    """The meaning of a prompt's quads GEMM with f32 prompts: qlinear_ref on the weight the quads hold."""
    rows = torch.arange(n)
    return qlinear_ref(x, quad_rows(quads, rows, bits), panel_rows(scales, rows),
                       None if mins is None else panel_rows(mins, rows), bias, bits=bits)


def qdot_linear_ref(x: torch.Tensor, quads: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, n: int,
                    bias: torch.Tensor | None = None, *, bits: int) -> torch.Tensor:
    """The meaning of the int8-activation kernel: qlinear_int8act_ref on the weight the quads hold."""
    rows = torch.arange(n)
    return qlinear_int8act_ref(x, quad_rows(quads, rows, bits), panel_rows(scales, rows),
                               None if mins is None else panel_rows(mins, rows), bias, bits=bits)

