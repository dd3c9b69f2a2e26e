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


def assert_as_close_as_ref(got: torch.Tensor, want: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype,
                           norm: str = "max") -> None:
    """`got` is as close to `exact` as the torch ref `want` is, where the two round at different
    points (tests/test_native_kernels.py's rule): its error is at most twice the ref's plus one
    rounding of `dtype` (EPS / 2) of the exact values' size. `exact` is the same math on the same
    inputs in float64 (or, for a whole model, fp32: its error is ~2^16 times below bf16's). The
    ref's error already grows with the reduction length, so the bound does too. `norm`: "max" (the
    largest element error against the largest value: elementwise claims, for one op) or "rms" (for
    a whole model's logits, where the largest of hundreds of errors is one outlier of the ref's)."""
    exact = exact.double()
    size = {"max": lambda x: x.abs().max().item(), "rms": lambda x: x.square().mean().sqrt().item()}[norm]
    err_got, err_ref = (size(x.double() - exact) for x in (got, want))
    bound = 2 * err_ref + EPS[dtype] / 2 * size(exact)
    assert err_got <= bound, f"{norm} error {err_got:.3g} > {bound:.3g}: twice the ref's {err_ref:.3g} and a rounding"
