"""GEMM on weights packed once for oneDNN: the peer that benchmarks measure llmc's GEMV against
(tools/bench_gemv.py, tools/bench_kernels.py) and a candidate for the matmul peak of `llmc profile`.
The native op table keeps no packed copy (it would be a second resident copy of every weight):
its float GEMMs run on column panels (kernels/panels.py), which replace the weight and match
this at every token count (`python -m llmc.tools.bench_gemv` prints both).

Contract: x [T, K], w [N, K], optional bias [N], one float dtype (f32 or bf16); returns
x @ w.T + bias [T, N], as `linear` (F.linear) computes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class PackedLinear:
    """A weight [N, K] reordered once into oneDNN's blocked GEMM layout (what inductor's CPU
    "freezing" does), so each call skips the per-call reorder: faster than F.linear most at
    decode batch sizes (`python -m llmc.tools.bench_kernels` prints the ratio). f32 and bf16 only.
    Meaning: F.linear(x, weight, bias), accumulated in fp32 as oneDNN does. `packable` says where."""

    def __init__(self, weight: torch.Tensor):
        if not packable(weight):
            raise ValueError(f"only contiguous 2-D f32/bf16 CPU weights are packed, not {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        self.weight = weight
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2 or x.dtype != self.weight.dtype or x.shape[1] != self.weight.shape[1]:
            raise ValueError(f"x {x.dtype} {tuple(x.shape)} does not fit packed weight {self.weight.dtype} "
                             f"{tuple(self.weight.shape)}")
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, bias, "none", [], "")


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU can reorder a `dtype` weight for oneDNN's GEMM: f32 wherever
    oneDNN is built in, bf16 only on CPUs with AVX512-BW/VL/DQ or AVX-NE-CONVERT (an AVX2-only CPU
    raises in the reorder)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packable(weight: torch.Tensor) -> bool:
    """Whether this torch build can pack `weight` for the CPU GEMM on this CPU (else use F.linear)."""
    return (weight.device.type == "cpu" and weight.dim() == 2 and weight.is_contiguous()
            and onednn_packs(weight.dtype))


def onednn_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's GEMM on `w` reordered for this call (the reorder is a transient copy): the peer a
    weight kept only in its plain layout would get; F.linear where oneDNN cannot pack w's dtype here."""
    if not onednn_packs(w.dtype):
        return F.linear(x, w, bias)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, x.shape[0])
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
