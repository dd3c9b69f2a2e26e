"""The int8-activation GEMMs' quantization of x (kernels/cpu/qdot_gemm.h quantize_blocks: per block of
32 inputs d = max|x| / 127, codes round(x / d) ties to even, and the codes' sum) against
kernels/quant.py's quantize_activations, bit for bit: the codes, the fp32 scales and the sums.

The header has three builds of it, AVX-512 and AVX2 (vcvtps2dq's rounding) and portable (std::nearbyint);
each is built here as a plain shared library (the same header, -march=native, then without AVX-512,
then without AVX2 too: on a CPU without AVX-512 the first two are the same build) and checked on every
x86 CPU, over ranges of blocks that cut a token in two (a step plan's team
splits one token's blocks at batch 1), for fp32 and bf16 x, with a block of zeros (d = 0: codes 0) and
blocks whose x / d lands on halves (ties)."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess

import pytest
import torch
from torch.utils.cpp_extension import include_paths

from llmc.kernels.native import SOURCE_DIR
from llmc.kernels.quant import quantize_activations

SOURCE = """
#include "qdot_gemm.h"
template <typename X>
static void run(const X* x, char* scratch, int64_t rows, int64_t k, int64_t first, int64_t last) {
  llmc_qdot::quantize_blocks(x, llmc_qdot::qacts_in(scratch, rows, k), first, last);
}
extern "C" void quantize_f32(const float* x, char* s, int64_t rows, int64_t k, int64_t first, int64_t last) {
  run(x, s, rows, k, first, last);
}
extern "C" void quantize_bf16(const c10::BFloat16* x, char* s, int64_t rows, int64_t k, int64_t first,
                              int64_t last) {
  run(x, s, rows, k, first, last);
}
"""

BUILDS = {"native": [], "avx2": ["-mno-avx512f"], "portable": ["-mno-avx512f", "-mno-avx2"]}


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    """build name -> qdot_gemm.h's quantize_blocks built that way (a few seconds each: no torch extension)."""
    if platform.machine() != "x86_64":
        pytest.skip("-mno-avx512f is an x86 flag; elsewhere the native build is the portable one already")
    folder = tmp_path_factory.mktemp("quantize")
    (folder / "quantize.cpp").write_text(SOURCE)
    includes = [f"-I{path}" for path in [SOURCE_DIR, *include_paths()]]
    built = {}
    for name, flags in BUILDS.items():
        library = folder / f"{name}.so"
        subprocess.run([os.environ.get("CXX", "c++"), "-O2", "-march=native", *flags, "-std=c++17", "-shared", "-fPIC",
                        *includes, str(folder / "quantize.cpp"), "-o", str(library)], check=True)
        built[name] = ctypes.CDLL(str(library))
    return built


def quantize(library, x: torch.Tensor, cuts: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [T, K/32, 32], scales [T, K/32], sums [T, K/32]) from quantize_blocks, called once per range
    of blocks between `cuts`."""
    rows, k = x.shape
    blocks = rows * k // 32
    scratch = torch.zeros(rows * k + blocks * 8, dtype=torch.uint8)          # qacts_bytes_per_row(K) x T
    fn = library.quantize_f32 if x.dtype == torch.float32 else library.quantize_bf16
    for first, last in zip([0, *cuts], [*cuts, blocks]):
        fn(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(scratch.data_ptr()), ctypes.c_int64(rows),
           ctypes.c_int64(k), ctypes.c_int64(first), ctypes.c_int64(last))
    scales = scratch[:blocks * 4].view(torch.float32).view(rows, -1)
    sums = scratch[blocks * 4:blocks * 8].view(torch.int32).view(rows, -1)
    codes = scratch[blocks * 8:].view(torch.int8).view(rows, -1, 32)
    return codes, scales, sums


def activations(dtype: torch.dtype) -> torch.Tensor:
    """[3, 96] (9 blocks): random rows, a block of zeros, one block of a single nonzero value and one
    whose values x / d are k + 1/2 exactly (d = 127 / 127 = 1: ties to even)."""
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(0)) * 4
    x[1, 32:64] = 0
    x[2, 0:32] = 0
    x[2, 5] = -2.5
    x[2, 32:64] = torch.arange(32) - 15.5                                     # halves, ties
    x[2, 63] = 127.0                                                           # so d = 1
    return x.to(dtype)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("cuts", [[], [4], [1, 5, 8]], ids=["whole", "token-cut", "three-cuts"])
def test_quantized_blocks_equal_the_ref(libraries, build, dtype, cuts):
    x = activations(dtype)
    codes, scales, sums = quantize(libraries[build], x, cuts)
    want_codes, want_scales = quantize_activations(x)
    assert torch.equal(codes, want_codes)
    assert torch.equal(scales, want_scales)
    assert torch.equal(sums, want_codes.sum(-1, dtype=torch.int32))
    assert bool((codes[1, 1] == 0).all()) and codes[2, 0, 5] == -127
