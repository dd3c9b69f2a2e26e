"""The float panel GEMM's batch-1 path (kernels/cpu/panel_gemm.h run_gemv: one token times up to
kGemvPanels = 4 panels at once) against F.linear, and its claim that a token's outputs do not depend
on its batch.

N spans 1, 7 and 11 panels (the last one partial), run on 1 and 2 threads, so every size of group
a thread's share of panels is cut into (4, 3, 2, 1) is met; f32 and bf16, with and without bias.
bf16 takes vdpbf16ps where the build has AVX512_BF16, else widens the pairs to fp32: the widening
path is also built here on purpose (the same header with -mno-avx512bf16, a plain shared library
loaded with ctypes) and checked on every x86 CPU.
"""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess

import pytest
import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import include_paths

from llmc.kernels.gemv import gemv_cpu, gemv_ref, prepare_linear_weight
from llmc.kernels.native import SOURCE_DIR, load_native_kernels
from tolerances import assert_as_close_as_ref, tolerance

K = 96                      # pairs of inputs for bf16; not a multiple of 64


@pytest.fixture(scope="module", autouse=True)
def native():
    load_native_kernels()


ON_THREADS = pytest.mark.parametrize("threads", [1, 2], indirect=True, ids=["1-thread", "2-threads"])


def weight_and_inputs(n: int, dtype: torch.dtype, tokens: int, with_bias: bool):
    g = torch.Generator().manual_seed(n)
    weight = (torch.randn(n, K, generator=g) * 0.05).to(dtype)
    x = torch.randn(tokens, K, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    return prepare_linear_weight(weight), weight, x, bias


@pytest.mark.parametrize("n", [29, 32 * 7 - 5, 32 * 11 - 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
@ON_THREADS
def test_batch_1_gemv_over_panel_groups_matches_linear(threads, n, dtype, with_bias):
    w, weight, x, bias = weight_and_inputs(n, dtype, 1, with_bias)
    got, want = gemv_cpu(x, w, bias), gemv_ref(x, w, bias)
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **tolerance(dtype, K, exact.abs().max().item()))
    else:
        assert_as_close_as_ref(got, want, exact, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@ON_THREADS
def test_a_token_alone_gets_the_bits_it_gets_in_a_batch(threads, dtype):
    """Each output is summed input by input on either path, so a decode token's logits do not
    depend on whether it ran alone (run_gemv) or in a tile of several tokens."""
    w, _, x, bias = weight_and_inputs(32 * 11 - 1, dtype, 5, True)
    batched = gemv_cpu(x, w, bias)
    for t in range(x.shape[0]):
        assert torch.equal(gemv_cpu(x[t:t + 1], w, bias)[0], batched[t])


WIDENED_SOURCE = """
#include "panel_gemm.h"
#if defined(__AVX512BF16__)
#error "built with -mno-avx512bf16 to run the widening path"
#endif
using llmc_panels::panel_gemm_range;
extern "C" void widened_gemm(const c10::BFloat16* x, const c10::BFloat16* panels, int64_t tokens, int64_t k,
                             const c10::BFloat16* bias, c10::BFloat16* out, int64_t n, int64_t num_panels) {
  panel_gemm_range(x, panels, tokens, k, bias, out, n, 0, num_panels);
}
"""


@pytest.fixture(scope="module")
def widened_gemm(tmp_path_factory):
    """panel_gemm.h's panel_gemm_range for bf16 (one thread, every panel), built without AVX512_BF16
    as a plain shared library (a few seconds: no torch extension)."""
    if platform.machine() != "x86_64":
        pytest.skip("-mno-avx512bf16 is an x86 flag; elsewhere the native build already widens")
    folder = tmp_path_factory.mktemp("widened")
    (folder / "widened.cpp").write_text(WIDENED_SOURCE)
    includes = [f"-I{path}" for path in [SOURCE_DIR, *include_paths()]]
    subprocess.run([os.environ.get("CXX", "c++"), "-O2", "-march=native", "-mno-avx512bf16", "-std=c++17", "-shared",
                    "-fPIC", *includes, str(folder / "widened.cpp"), "-o", str(folder / "widened.so")], check=True)
    library = ctypes.CDLL(str(folder / "widened.so"))

    def gemm(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], n, dtype=x.dtype)
        pointers = [ctypes.c_void_p(t.data_ptr()) for t in (x, panels)]
        library.widened_gemm(*pointers, ctypes.c_int64(x.shape[0]), ctypes.c_int64(x.shape[1]),
                             ctypes.c_void_p(bias.data_ptr()), ctypes.c_void_p(out.data_ptr()), ctypes.c_int64(n),
                             ctypes.c_int64(panels.shape[0]))
        return out

    return gemm


@pytest.mark.parametrize("tokens", [1, 3])
def test_the_widening_bf16_path_matches_linear(widened_gemm, tokens):
    n = 32 * 11 - 1
    w, weight, x, bias = weight_and_inputs(n, torch.bfloat16, tokens, True)
    got, want = widened_gemm(x, w.weight, n, bias), gemv_ref(x, w, bias)
    assert_as_close_as_ref(got, want, F.linear(x.double(), weight.double(), bias.double()), torch.bfloat16)
