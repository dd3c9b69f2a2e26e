"""tools/bench_gemv.py's row rescale: when the run's second floor sample is the higher one, every row's
fraction of the bandwidth is scaled to it, and a row saying why a path did not run (it has no fraction)
is printed as it is rather than crashing the benchmark (it did on a CPU without AVX512-BW). The quantized
crossover's weights run the paths its columns name; --tokens refuses what is not a list of counts."""

from __future__ import annotations

import argparse

import pytest
import torch

from llmc.kernels.gemv import F32_PROMPT_MIN_TOKENS, gemv_cpu
from llmc.kernels.quant import qlinear_int8act_ref, qlinear_ref, quantize_int4, quantize_int8
from llmc.tools.bench_gemv import _rescale, _row, quantized_layer, token_counts
from tolerances import tolerance


def test_a_measured_row_has_its_fraction_rescaled():
    row = _row("gate_up", "f32", "panels", 1e-4, 4_000_000, 50e9)
    assert row.endswith("80%")
    assert _rescale(row, 0.5).endswith("40%")
    assert _rescale(row, 0.5)[:-8] == row[:-8]


def test_a_row_without_a_fraction_is_kept_as_it_is():
    row = "lm_head  bf16         oneDNN packed: not on this CPU (bf16 needs AVX512-BW)"
    assert _rescale(row, 0.9) == row


@pytest.mark.usefixtures("native_kernels_built")
def test_the_quantized_crossover_times_each_path_it_names():
    """Its 'f32 prompts' weights give qlinear_ref's numbers from F32_PROMPT_MIN_TOKENS tokens (the weight
    dequantized to fp32), its 'a8' ones the int8 activations' (qlinear_int8act_ref), which miss those by far."""
    torch.manual_seed(0)
    w = torch.randn(64, 96) * 0.05
    formats = quantized_layer([w])
    x = torch.randn(F32_PROMPT_MIN_TOKENS, 96)
    for bits, quantize in ((8, lambda: quantize_int8(w, 32)), (4, lambda: quantize_int4(w, 32))):
        codes, scales, mins = (*quantize(), None)[:3]
        exact = qlinear_ref(x.double(), codes, scales, mins, bits=bits)
        near = tolerance(torch.float32, 96, scale=exact.abs().max().item())
        f32_prompts, a8 = formats[f"int{bits} f32 prompts"][0], formats[f"int{bits} a8"][0]
        torch.testing.assert_close(gemv_cpu(x, f32_prompts).double(), exact, **near)
        torch.testing.assert_close(gemv_cpu(x, a8).double(), qlinear_int8act_ref(x.double(), codes, scales, mins,
                                                                                bits=bits), **near)
        assert not torch.allclose(gemv_cpu(x, a8).double(), exact, **near)


def test_tokens_takes_positive_counts_and_says_what_else_is_wrong():
    assert token_counts("1,16,64") == [1, 16, 64]
    for bad in ("1,x", "0", "", "4,-2"):
        with pytest.raises(argparse.ArgumentTypeError, match="give positive integers such as 1,16,64"):
            token_counts(bad)
