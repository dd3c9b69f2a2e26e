"""The dequantizing GEMM template (kernels/triton/qgemm.py) against the quantized weights'
meaning: kernels/quant.py's `qlinear_ref` (no epilogue) and the dequantized weight through the
float GEMM's fp32 epilogue, in Triton's interpreter on a CPU (conftest sets TRITON_INTERPRET=1)
or on a GPU. Outputs are poisoned with NaN before each launch, so a tile never written fails.
"""

from __future__ import annotations

import pytest
import torch

from llmc.kernels.quant import dequantize_weight, qlinear_ref, quantize_int4, quantize_int8
from llmc.kernels.triton.gemm import GemmConfig, linear_epilogue_ref, pick_config
from llmc.kernels.triton.qgemm import pick_qconfig, qlinear_triton
from tolerances import EPS, tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]          # bf16: one test below (interpreter: fp32 dots)
# (bits, group_size, K): int8 per output channel over a K that no tile divides, GGUF Q8_0's 32;
# int4 groups of 32, 64 and 128
FORMATS = [(8, 72, 72), (8, 32, 96), (4, 32, 96), (4, 64, 128), (4, 128, 256)]
# (bias, residual, activation, gated)
EPILOGUES = [(False, False, "none", False), (True, True, "none", False), (False, False, "silu", False),
             (True, True, "none", True), (True, True, "gelu_tanh", True)]
N, SCALE = 40, 4.0                               # N not a power of two; |y| and partial sums, about


def qgemm_tolerance(dtype: torch.dtype, K: int) -> dict[str, float]:
    """Kernel and ref sum the same fp32 products in another order (the kernel scales per tile),
    plus the one rounding to `dtype` at the store."""
    acc = tolerance(torch.float32, K, SCALE)
    return {"atol": acc["atol"] + EPS[dtype] * SCALE, "rtol": acc["rtol"] + EPS[dtype]}


def quantized_weight(n_w: int, K: int, bits: int, group: int, seed: int):
    """(codes, scales, mins) of a random [n_w, K] weight scaled so that |y| ~ 1."""
    w = torch.randn(n_w, K, generator=torch.Generator().manual_seed(seed)) / K ** 0.5
    if bits == 8:
        return (*quantize_int8(w, group), None)
    return quantize_int4(w, group)


def make_case(M, K, bits, group, dtype, bias, residual, gated, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    n_w = 2 * N if gated else N
    codes, scales, mins = quantized_weight(n_w, K, bits, group, seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    b = torch.randn(n_w, generator=g).to(dtype) if bias else None
    r = torch.randn(M, N, generator=g).to(dtype) if residual else None
    return [None if t is None else t.to(DEVICE) for t in (x, codes, scales, mins, b, r)]


def expected(x, codes, scales, mins, b, r, bits, activation, gated):
    """The fp32 weight dequant(codes) through the float GEMM's fp32 epilogue (an independent path)."""
    w = dequantize_weight(codes.cpu(), scales.cpu(), None if mins is None else mins.cpu(), bits)
    cpu = [None if t is None else t.cpu() for t in (x, b, r)]
    return linear_epilogue_ref(cpu[0], w, cpu[1], cpu[2], activation=activation, gated=gated)


def poisoned(M, dtype):
    return torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,group,K", FORMATS)
@pytest.mark.parametrize("M", [1, 13])
@pytest.mark.parametrize("bias,residual,activation,gated", EPILOGUES)
def test_qlinear_matches_the_dequantized_gemm(dtype, bits, group, K, M, bias, residual, activation, gated):
    x, codes, scales, mins, b, r = make_case(M, K, bits, group, dtype, bias, residual, gated, seed=K + M)
    out = poisoned(M, dtype)
    got = qlinear_triton(x, codes, scales, mins, b, r, bits=bits, group_size=group, activation=activation,
                         gated=gated, out=out)
    assert got is out
    want = expected(x, codes, scales, mins, b, r, bits, activation, gated)
    torch.testing.assert_close(got.cpu().float(), want.float(), **qgemm_tolerance(dtype, K))


@pytest.mark.parametrize("bits,group,K", FORMATS)
def test_prefill_tiles_match_qlinear_ref(bits, group, K):
    """M = 70 (one 128-row prefill tile, rows past 70 masked), no epilogue: against kernels/quant.py's own ref."""
    x, codes, scales, mins, _, _ = make_case(70, K, bits, group, torch.float16, False, False, False, seed=K)
    got = qlinear_triton(x, codes, scales, mins, bits=bits, group_size=group, out=poisoned(70, torch.float16))
    torch.testing.assert_close(got, qlinear_ref(x, codes, scales, mins, bits=bits),
                               **qgemm_tolerance(torch.float16, K))


@pytest.mark.parametrize("bits,group,K,block_k", [(8, 72, 72, 16), (4, 128, 256, 32), (8, 32, 96, 16)])
def test_several_k_tiles_per_group(bits, group, K, block_k):
    """Small tiles: a masked K tail of a per-channel group, four tiles per int4 group of 128, two
    per Q8_0 group; odd M over two row tiles of 16."""
    config = GemmConfig(block_m=16, block_n=16, block_k=block_k, group_m=2, num_warps=4, num_stages=2)
    x, codes, scales, mins, b, r = make_case(19, K, bits, group, torch.float32, True, True, True, seed=3)
    got = qlinear_triton(x, codes, scales, mins, b, r, bits=bits, group_size=group, gated=True,
                         out=poisoned(19, torch.float32), config=config)
    want = expected(x, codes, scales, mins, b, r, bits, "none", True)
    torch.testing.assert_close(got.cpu(), want, **qgemm_tolerance(torch.float32, K))


def test_softcap_epilogue():
    """A quantized LM head with Gemma 2's final soft-cap: the same epilogue code as the float GEMM."""
    x, codes, scales, mins, b, r = make_case(13, 96, 4, 32, torch.float32, True, False, False, seed=7)
    got = qlinear_triton(x, codes, scales, mins, b, bits=4, group_size=32, softcap=0.5, out=poisoned(13, torch.float32))
    want = expected(x, codes, scales, mins, b, None, 4, "none", False)
    torch.testing.assert_close(got.cpu(), 0.5 * torch.tanh(want / 0.5), **qgemm_tolerance(torch.float32, 96))


def test_bf16_int4_gated():
    """bf16 takes fp32 dots on CPU tensors (the interpreter's bf16 dot and int -> bf16 casts are wrong)."""
    x, codes, scales, mins, b, r = make_case(9, 128, 4, 64, torch.bfloat16, True, True, True, seed=5)
    got = qlinear_triton(x, codes, scales, mins, b, r, bits=4, group_size=64, gated=True,
                         out=poisoned(9, torch.bfloat16))
    want = expected(x, codes, scales, mins, b, r, 4, "none", True)
    torch.testing.assert_close(got.cpu().float(), want.float(), **qgemm_tolerance(torch.bfloat16, 128))


@pytest.mark.parametrize("M", [1, 16, 17, 64, 65, 1000])
@pytest.mark.parametrize("bits,group,K", FORMATS + [(4, 32, 4096), (8, 4096, 4096), (8, 72, 72)])
def test_pick_qconfig_keeps_each_k_tile_in_one_group(M, bits, group, K):
    cfg = pick_qconfig(M, 4096, K, bits=bits, group_size=group)
    assert cfg.block_k >= (32 if bits == 4 else 16) and cfg.block_k & (cfg.block_k - 1) == 0
    assert group % cfg.block_k == 0 or group == K
    tile = pick_config(M, 4096, K, weight_bits=bits)                # the tile for these codes, BLOCK_K refitted
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) == \
        (tile.block_m, tile.block_n, tile.num_warps, tile.num_stages)


def _valid(**overrides):
    codes, scales, mins = quantized_weight(6, 64, 4, 32, seed=0)
    kw = dict(x=torch.zeros(3, 64), codes=codes, scales=scales, mins=mins, bits=4, group_size=32)
    return kw | overrides


@pytest.mark.parametrize("overrides,words", [
    (dict(x=torch.zeros(3, 64, dtype=torch.int32)), "torch.int32"),
    (dict(bits=3), "bits must be 8 or 4"),
    (dict(x=torch.zeros(3, 96)), r"codes must be torch.uint8 \[N, 48\]"),
    (dict(group_size=48), "group_size 48"),
    (dict(mins=None), "mins must be float16"),
    (dict(scales=torch.zeros(6, 2)), "scales must be float16"),
    (dict(codes=torch.zeros(6, 64, dtype=torch.uint8)[:, ::2]), "codes must be contiguous"),
    (dict(bits=8, codes=torch.zeros(6, 64, dtype=torch.int8), scales=torch.zeros(6, 2, dtype=torch.float16)),
     "int8 weights have no mins"),
])
def test_launcher_refuses_what_the_kernel_does_not_take(overrides, words):
    kw = _valid(**overrides)
    with pytest.raises(ValueError, match=words):
        qlinear_triton(kw.pop("x"), kw.pop("codes"), kw.pop("scales"), kw.pop("mins"), **kw)


def test_launcher_refuses_a_k_tile_that_crosses_a_group():
    kw = _valid()
    config = GemmConfig(block_m=16, block_n=16, block_k=64, group_m=1, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="block_k 64"):
        qlinear_triton(kw.pop("x"), kw.pop("codes"), kw.pop("scales"), kw.pop("mins"), **kw, config=config)
