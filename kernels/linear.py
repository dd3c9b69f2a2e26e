"""GEMM with epilogues.

Contract: x [T, K], w [N, K], optional bias [N], residual [T, N], all of one float dtype;
returns x @ w.T + bias + residual [T, N]. The reference adds the residual after the GEMM, in the
same order as `linear` followed by `add`, so the fusion is exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_add_ref(x: torch.Tensor, weight: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    """`rest` is (residual,) or (bias, residual)."""
    *bias, residual = rest
    return F.linear(x, weight, *bias) + residual
