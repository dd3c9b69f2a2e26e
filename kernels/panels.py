"""Float GEMM weights in column panels: the one layout the native CPU kernels keep for a linear's
weight, read by one kernel (kernels/cpu/panel_gemm.cpp) at every token count.

Layout (`to_panels`): a weight w [N, K] becomes P = ceil(N / 32) panels of 32 output rows (rows
past N zero); within a panel, input k's 32 weights sit together:
  f32   [P, K, 32]        panels[p, k, j] = w[32p + j, k]
  bf16  [P, K/2, 32, 2]   panels[p, i, j, h] = w[32p + j, 2i + h]   (inputs in pairs, K even)
A batch-1 decode then streams each thread's panels front to back, and a tile of tokens x 32
outputs accumulates with the outputs as vector lanes (no horizontal sums); oneDNN's blocked
layouts are the same idea, but opaque, so a second copy would have to be kept beside the weight.

Contract of `panel_linear` (the meaning is `panel_linear_ref`: F.linear on the weight the panels
hold): x [T, K] in the panels' dtype, bias [N] in that dtype or None; returns [T, N] in x's dtype,
products accumulated in fp32, bias added in fp32, rounded once. `panel_rows` reads weight rows
back (a tied embedding's lookup).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PANEL = 32                       # output rows per panel
PANEL_DTYPES = (torch.float32, torch.bfloat16)


def panels_fit(weight: torch.Tensor) -> bool:
    """Whether `to_panels` takes this weight: 2-D f32 or bf16 on the CPU (bf16 with an even K)."""
    return (weight.dim() == 2 and weight.dtype in PANEL_DTYPES and weight.device.type == "cpu"
            and weight.numel() > 0 and (weight.dtype == torch.float32 or weight.shape[1] % 2 == 0))


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> its panels (a new tensor; the layout above)."""
    if not panels_fit(weight):
        raise ValueError(f"panels take a 2-D f32 or bf16 CPU weight (bf16 with an even K), not {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    n, k = weight.shape
    padded = F.pad(weight, (0, 0, 0, -n % PANEL))                        # [P*32, K]
    if weight.dtype == torch.float32:
        return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()    # [P, K, 32]
    return padded.view(-1, PANEL, k // 2, 2).transpose(1, 2).contiguous()  # [P, K/2, 32, 2]


def panel_rows(panels: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` (int, any shape) of the weight the panels hold: [*rows.shape, K]."""
    flat = rows.reshape(-1)
    picked = panels[flat // PANEL, :, flat % PANEL]                      # f32 [R, K]; bf16 [R, K/2, 2]
    return picked.reshape(*rows.shape, -1)


def from_panels(panels: torch.Tensor, n: int) -> torch.Tensor:
    """The weight [N, K] back (a new tensor)."""
    return panel_rows(panels, torch.arange(n))


def panel_linear_ref(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The meaning: F.linear on the unpacked weight."""
    return F.linear(x, from_panels(panels, n), bias)


def panel_linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Launcher of kernels/cpu/panel_gemm.cpp (load_native_kernels() must have run)."""
    k = x.shape[-1] if x.dim() == 2 else -1
    want = (-(-n // PANEL), k, PANEL) if panels.dtype == torch.float32 else (-(-n // PANEL), k // 2, PANEL, 2)
    if x.dim() != 2 or x.dtype != panels.dtype or not x.is_cpu or tuple(panels.shape) != want:
        raise ValueError(f"panel_linear takes x [T, K] in the panels' dtype {panels.dtype} for panels of "
                         f"{tuple(panels.shape)} and n={n}; got x {x.dtype} {tuple(x.shape)} on {x.device}")
    if bias is not None and (bias.dtype != x.dtype or bias.shape != (n,)):
        raise ValueError(f"bias must be [{n}] in {x.dtype}, not {bias.dtype} {tuple(bias.shape)}")
    return torch.ops.llmc.panel_gemm(x.contiguous(), panels, n, bias)
