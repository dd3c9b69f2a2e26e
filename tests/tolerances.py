"""Per-dtype tolerances in one place, scaled by the reduction length (llm.c's rule).

A dot product of length K accumulates about sqrt(K) roundings of relative size eps, and a
Llama block chains a handful of them; `atol` allows for that with a fixed safety factor.
"""

from __future__ import annotations

import math

import torch

EPS = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
SAFETY = 64.0


def tolerance(dtype: torch.dtype, reduction: int, scale: float = 1.0) -> dict[str, float]:
    """Keyword arguments for torch.testing.assert_close for values of magnitude ~`scale`."""
    tol = EPS[dtype] * math.sqrt(reduction) * SAFETY * scale
    return {"atol": tol, "rtol": tol}
