"""The GEMM template's RMSNorm prologue (kernels/triton/gemm.py `norm_linear_triton`) against the
unfused path in torch (`norm_linear_ref`: the norm rounded to the dtype, then the GEMM) and exact
float64 arithmetic.

The fused kernel rounds the dot's operand at another point than the unfused path (x * weight, not
the normed row and then its product), so in fp16 the claim is tolerances.assert_as_close_as_ref's:
as close to exact as the unfused path is (twice its error plus a rounding). In fp32 both are
within fp32's reduction tolerance of each other. The sum h = x + r must be exactly x + r in the
dtype. Runs in Triton's interpreter here (fp32 and fp16: its bf16 dot and casts are wrong), on
CUDA tensors where there is a GPU; outputs are poisoned with NaN (deterministic mode's empty).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmc.kernels.triton.gemm import norm_linear_ref, norm_linear_triton
from tolerances import assert_as_close_as_ref, tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5
# (M, N, K): decode M = 1; odd M; M = 17 over two decode tiles; K 72 (not a power of two, not a
# multiple of BLOCK_K: the last K step is masked), K 48 (one step)
SHAPES = [(1, 40, 72), (5, 24, 48), (17, 40, 72)]
EPILOGUES = {"plain": {}, "gated": dict(gated=True), "bias+residual+silu": dict(bias=True, residual=True,
                                                                                  activation="silu")}


def make_inputs(M, N, K, dtype, add: bool, epilogue: dict, seed=0, rms=3.0):
    """x, the norm's weight and residual (add_rmsnorm), w, bias, the epilogue's residual; x and r
    of about `rms` (3: the norm matters)."""
    g = torch.Generator().manual_seed(seed)
    n_w = 2 * N if epilogue.get("gated") else N
    x = torch.randn(M, K, generator=g) * rms
    norm_w = 1 + 0.5 * torch.randn(K, generator=g)
    r = torch.randn(M, K, generator=g) * rms if add else None
    w = torch.randn(n_w, K, generator=g) / K ** 0.5                            # |y| ~ 1
    b = torch.randn(n_w, generator=g) if epilogue.get("bias") else None
    res = torch.randn(M, N, generator=g) if epilogue.get("residual") else None
    return [None if t is None else t.to(dtype=dtype, device=DEVICE) for t in (x, norm_w, r, w, b, res)]


def exact(x, norm_w, r, w, b, res, *, gated=False, activation="none", **_):
    """The op's meaning in float64 from the same rounded inputs (h = x + r rounded, as the op rounds it)."""
    h = (x if r is None else x + r).double()
    normed = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + EPS) * norm_w.double()
    y = F.linear(normed, w.double(), None if b is None else b.double())
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    elif activation == "silu":
        y = F.silu(y)
    return y if res is None else y + res.double()


def options(epilogue: dict) -> dict:
    return {k: v for k, v in epilogue.items() if k in ("gated", "activation")}


@pytest.fixture
def poisoned_empty():
    """torch.empty fills NaN: an element the kernel never writes fails."""
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("add", [False, True], ids=["rmsnorm", "add_rmsnorm"])
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
def test_norm_prologue_matches_the_unfused_path(dtype, M, N, K, add, epilogue, poisoned_empty):
    x, norm_w, r, w, b, res = make_inputs(M, N, K, dtype, add, EPILOGUES[epilogue])
    opts = options(EPILOGUES[epilogue])
    got, h = norm_linear_triton(x, norm_w, w, b, res, eps=EPS, norm_residual=r, **opts)
    want, h_want = norm_linear_ref(x, norm_w, w, b, res, eps=EPS, norm_residual=r, **opts)
    assert not got.isnan().any()
    if add:
        assert torch.equal(h, h_want)                                   # the sum, exactly as add_rmsnorm's
    else:
        assert h is None
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **tolerance(torch.float32, K, scale=4.0))
    else:
        assert_as_close_as_ref(got, want, exact(x, norm_w, r, w, b, res, **EPILOGUES[epilogue]), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_eps_counts_where_the_rows_are_small(dtype, poisoned_empty):
    """Rows of rms 1e-3: mean(x^2) ~ 1e-6 against eps 1e-5, so the eps sets the scale."""
    x, norm_w, r, w, _, _ = make_inputs(3, 24, 48, dtype, True, {}, rms=1e-3)
    got, _ = norm_linear_triton(x, norm_w, w, eps=EPS, norm_residual=r)
    want, _ = norm_linear_ref(x, norm_w, w, eps=EPS, norm_residual=r)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **tolerance(torch.float32, 48))
    else:
        assert_as_close_as_ref(got, want, exact(x, norm_w, r, w, None, None), dtype)


def test_the_ref_is_the_unfused_ops():
    """norm_linear_ref is (add_)rmsnorm then the GEMM: checked against the float64 meaning in fp32."""
    x, norm_w, r, w, b, res = make_inputs(5, 24, 48, torch.float32, True, EPILOGUES["bias+residual+silu"])
    want, h = norm_linear_ref(x, norm_w, w, b, res, eps=EPS, norm_residual=r, activation="silu")
    torch.testing.assert_close(want.double(), exact(x, norm_w, r, w, b, res, activation="silu"),
                               **tolerance(torch.float32, 48, scale=4.0))
    assert torch.equal(h, x + r)


@pytest.mark.parametrize("bad,words", [
    (dict(norm_w=torch.zeros(7)), "norm_weight must be \\[8\\]"),
    (dict(norm_w=torch.zeros(16)[::2]), "norm_weight must be contiguous"),
    (dict(r=torch.zeros(3, 9)), "norm_residual must be \\[3, 8\\]"),
    (dict(r=torch.zeros(8, 3).t()), "norm_residual must have contiguous rows"),
])
def test_launcher_refuses_a_bad_prologue_operand(bad, words):
    kw = dict(x=torch.zeros(3, 8), norm_w=torch.ones(8), w=torch.zeros(6, 8), r=None) | bad
    with pytest.raises(ValueError, match=words):
        norm_linear_triton(kw["x"], kw["norm_w"], kw["w"], eps=EPS, norm_residual=kw["r"])
