"""The float panel GEMM's batch-1 path (kernels/cpu/panel_gemm.h run_gemv: one token times up to
kGemvPanels = 4 panels at once) against F.linear, and its claim that a token's outputs do not depend
on its batch.

N spans 1, 7 and 11 panels (the last one partial), run on 1 and 2 threads, so every size of group
a thread's share of panels is cut into (4, 3, 2, 1) is met; f32 and bf16, with and without bias.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmc.kernels.gemv import gemv_cpu, gemv_ref, prepare_linear_weight
from llmc.kernels.native import load_native_kernels
from tolerances import assert_as_close_as_ref, tolerance

K = 96                      # pairs of inputs for bf16; not a multiple of 64


@pytest.fixture(scope="module", autouse=True)
def native():
    load_native_kernels()


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def weight_and_inputs(n: int, dtype: torch.dtype, tokens: int, with_bias: bool):
    g = torch.Generator().manual_seed(n)
    weight = (torch.randn(n, K, generator=g) * 0.05).to(dtype)
    x = torch.randn(tokens, K, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    return prepare_linear_weight(weight), weight, x, bias


@pytest.mark.parametrize("n", [29, 32 * 7 - 5, 32 * 11 - 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_batch_1_gemv_over_panel_groups_matches_linear(threads, n, dtype, with_bias):
    w, weight, x, bias = weight_and_inputs(n, dtype, 1, with_bias)
    got, want = gemv_cpu(x, w, bias), gemv_ref(x, w, bias)
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **tolerance(dtype, K, exact.abs().max().item()))
    else:
        assert_as_close_as_ref(got, want, exact, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_alone_gets_the_bits_it_gets_in_a_batch(threads, dtype):
    """Each output is summed input by input on either path, so a decode token's logits do not
    depend on whether it ran alone (run_gemv) or in a tile of several tokens."""
    w, _, x, bias = weight_and_inputs(32 * 11 - 1, dtype, 5, True)
    batched = gemv_cpu(x, w, bias)
    for t in range(x.shape[0]):
        assert torch.equal(gemv_cpu(x[t:t + 1], w, bias)[0], batched[t])
