"""The Triton GEMM template (kernels/triton/gemm.py) against F.linear and the epilogue in fp32.

Without a GPU the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1), so
shapes stay small; with one, the same tests run on CUDA tensors. Outputs are poisoned with NaN
before each launch, so a tile the kernel never writes fails the comparison.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmc.compiler.ops.elementwise import gelu_tanh_mul_ref
from llmc.kernels.activation import silu_mul_ref
from llmc.kernels.triton.gemm import GemmConfig, linear_epilogue_ref, linear_triton, pick_config
from tolerances import EPS, tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]          # the interpreter's bf16 dot is wrong: bf16 below, upcast
# (M, N, K): decode M = 1, odd M, one M tile of M <= 64, prefill over two M tiles; N and K are
# not multiples of any block, K = 200 takes two K steps of 128, K = 72 three of 32 at prefill.
SHAPES = [(1, 120, 72), (13, 96, 200), (40, 120, 72), (130, 136, 72)]
# (bias, residual, activation, gated): every epilogue the codegen can fuse.
EPILOGUES = [
    (False, False, "none", False), (True, False, "none", False), (False, True, "none", False),
    (True, True, "none", False), (False, False, "silu", False), (True, True, "silu", False),
    (False, False, "none", True), (False, True, "none", True), (True, True, "none", True),
    (False, False, "gelu_tanh", False), (True, True, "gelu_tanh", False),            # GELU, tanh approximation
    (False, False, "gelu_tanh", True), (True, True, "gelu_tanh", True),              # GeGLU (Gemma's MLP)
]
SCALE = 4.0                                      # largest |value| of y and of its partial sums, about


def gemm_tolerance(dtype: torch.dtype, K: int) -> dict[str, float]:
    """Kernel and ref both accumulate the same inputs in fp32: an fp32 reduction error over K,
    plus the single rounding to `dtype` at the store (one ulp where the two land either side)."""
    acc = tolerance(torch.float32, K, SCALE)
    return {"atol": acc["atol"] + EPS[dtype] * SCALE, "rtol": acc["rtol"] + EPS[dtype]}


def want(x, w, bias, residual, activation, gated):
    """F.linear and the epilogue, all in fp32 from the same (rounded) inputs."""
    y = F.linear(x.float(), w.float(), None if bias is None else bias.float())   # [M, N_w]
    if gated and activation == "gelu_tanh":
        y = gelu_tanh_mul_ref(y)                                                # [M, N_w / 2]
    elif gated:
        y = silu_mul_ref(y)                                                     # [M, N_w / 2]
    elif activation == "silu":
        y = F.silu(y)
    elif activation == "gelu_tanh":
        y = F.gelu(y, approximate="tanh")
    return y if residual is None else y + residual.float()


def make_inputs(M, N, K, dtype, bias, residual, gated, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_w = 2 * N if gated else N
    x = torch.randn(M, K, generator=g)
    w = torch.randn(n_w, K, generator=g) / K ** 0.5                             # keeps |y| ~ 1
    b = torch.randn(n_w, generator=g) if bias else None
    r = torch.randn(M, N, generator=g) if residual else None
    return [None if t is None else t.to(dtype=dtype, device=DEVICE) for t in (x, w, b, r)]


def poisoned(M, N, dtype):
    return torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("bias,residual,activation,gated", EPILOGUES)
def test_linear_matches_f_linear_and_epilogue(dtype, M, N, K, bias, residual, activation, gated):
    x, w, b, r = make_inputs(M, N, K, dtype, bias, residual, gated)
    out = poisoned(M, N, dtype)
    got = linear_triton(x, w, b, r, activation=activation, gated=gated, out=out)
    assert got is out
    torch.testing.assert_close(got.float(), want(x, w, b, r, activation, gated).to(dtype).float(),
                               **gemm_tolerance(dtype, K))


def test_module_ref_is_f_linear_and_epilogue():
    """linear_epilogue_ref (the codegen's CPU fallback) means what the tests check against."""
    for bias, residual, activation, gated in EPILOGUES:
        x, w, b, r = make_inputs(5, 24, 40, torch.float32, bias, residual, gated)
        torch.testing.assert_close(linear_epilogue_ref(x, w, b, r, activation=activation, gated=gated),
                                   want(x, w, b, r, activation, gated))


def test_bf16_gated_epilogue():
    """bf16 takes an fp32 dot on CPU tensors (the interpreter's bf16 dot is wrong), a bf16 one on a GPU."""
    x, w, b, r = make_inputs(9, 120, 72, torch.bfloat16, True, True, True)
    got = linear_triton(x, w, b, r, gated=True, out=poisoned(9, 120, torch.bfloat16))
    torch.testing.assert_close(got.float(), want(x, w, b, r, "none", True).to(torch.bfloat16).float(),
                               **gemm_tolerance(torch.bfloat16, 72))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", SHAPES[:2])
def test_softcap_epilogue_caps_the_logits(dtype, M, N, K):
    """Gemma 2's final logits: cap * tanh(y / cap) after the product (and a residual), |y| past the cap."""
    x, w, b, r = make_inputs(M, N, K, dtype, True, True, False)
    w = w * 8                                                                     # |y| ~ 8, cap 3: it bites
    got = linear_triton(x, w, b, r, softcap=3.0, out=poisoned(M, N, dtype))
    expected = 3.0 * torch.tanh(want(x, w, b, r, "none", False) / 3.0)
    torch.testing.assert_close(got.float(), expected.to(dtype).float(), **gemm_tolerance(dtype, K))
    torch.testing.assert_close(linear_epilogue_ref(x, w, b, r, softcap=3.0), expected.to(dtype))


def test_grouped_tile_order_writes_every_tile_once():
    """Small blocks and GROUP_M 2 over 5 x 3 tiles: the last group holds one row of tiles."""
    config = GemmConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=2)
    x, w, b, r = make_inputs(70, 40, 24, torch.float32, True, True, True)
    got = linear_triton(x, w, b, r, gated=True, out=poisoned(70, 40, torch.float32), config=config)
    torch.testing.assert_close(got, want(x, w, b, r, "none", True), **gemm_tolerance(torch.float32, 24))


def test_strided_inputs_and_residual_added_in_place():
    """x a column slice of a wider tensor, w a transposed view; out aliases the residual."""
    x_wide, w, _, r = make_inputs(7, 120, 100, torch.float16, False, True, False)
    x = x_wide[:, 10:82]                                                          # [7, 72], row stride 100
    w_t = w[:, :72].t().contiguous()                                              # [72, 120]
    expected = want(x, w_t.t(), None, r, "silu", False).to(torch.float16)
    got = linear_triton(x, w_t.t(), None, r, activation="silu", out=r)
    assert got is r
    torch.testing.assert_close(got.float(), expected.float(), **gemm_tolerance(torch.float16, 72))


@pytest.mark.parametrize("M", [1, 7, 16, 17, 64, 65, 1000])
@pytest.mark.parametrize("gated", [False, True])
def test_pick_config_sizes_tiles_from_m(M, gated):
    N, K = 120, 80                   # K a multiple of 16: one not (72) takes one small tile at every M
    cfg = pick_config(M, N, K, gated=gated)
    blocks = (cfg.block_m, cfg.block_n, cfg.block_k)
    assert all(b >= 16 and b & (b - 1) == 0 for b in blocks), cfg                # a GPU dot, a power of two
    assert cfg.block_m == 16 if M <= 16 else cfg.block_m >= min(M, 64), cfg
    assert cfg.block_n <= 128 and cfg.block_k <= 128, cfg                        # clamped to next_pow2(N, K)
    assert pick_config(M, 4096, 4096, gated=True).block_n * 2 == pick_config(M, 4096, 4096).block_n


def _inputs(**overrides):
    kw = dict(x=torch.zeros(3, 8), w=torch.zeros(6, 8), bias=None, residual=None)
    kw.update(overrides)
    return kw


@pytest.mark.parametrize("overrides,options,words", [
    (dict(x=torch.zeros(2, 3, 8)), {}, "x \\[M, K\\]"),
    (dict(x=torch.zeros(3, 8, dtype=torch.int32), w=torch.zeros(6, 8, dtype=torch.int32)), {}, "torch.int32"),
    (dict(w=torch.zeros(6, 8, dtype=torch.float16)), {}, "w must match"),
    (dict(w=torch.zeros(6, 9)), {}, "K must match"),
    ({}, dict(activation="gelu"), "'gelu'"),
    ({}, dict(gated=True, activation="gelu"), "'gelu'"),
    ({}, dict(softcap=-1.0), "softcap must be 0"),
    (dict(w=torch.zeros(5, 8)), dict(gated=True), "w \\(5, 8\\)"),
    ({}, dict(gated=True, activation="silu"), "activation 'silu'"),
    (dict(bias=torch.zeros(3)), {}, "bias must be \\[6\\]"),
    (dict(residual=torch.zeros(3, 6)), dict(gated=True), "residual must be \\[3, 3\\]"),
    ({}, dict(out=torch.zeros(3, 6, dtype=torch.float16)), "out must be \\[3, 6\\] torch.float32"),
])
def test_launcher_refuses_what_the_kernel_does_not_take(overrides, options, words):
    kw = _inputs(**overrides)
    with pytest.raises(ValueError, match=words):
        linear_triton(kw["x"], kw["w"], kw["bias"], kw["residual"], **options)
