"""The quantized row gather (kernels/triton/qembedding.py) against `qembedding_ref`, bit for bit:
each element is code * scale (+ min) in fp32, exact for these formats, rounded once. Outputs are
poisoned with NaN, so an element never written fails."""

from __future__ import annotations

import pytest
import torch

from llmc.kernels.quant import qembedding_ref, quantize_int4, quantize_int8
from llmc.kernels.triton.qembedding import qembedding_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (bits, group_size, D): int8 per row over a width no block divides, Q8_0 groups; int4 groups of 32, 64, 128
FORMATS = [(8, 72, 72), (8, 32, 96), (4, 32, 96), (4, 64, 128), (4, 128, 256)]
IDS = {"one": [41], "repeats": [3, 49, 0, 3, 17]}                 # T = 1; odd T with a repeated row


def quantized_table(V: int, D: int, bits: int, group: int):
    w = torch.randn(V, D, generator=torch.Generator().manual_seed(D + bits))
    q = quantize_int8(w, group) if bits == 8 else quantize_int4(w, group)
    return [t.to(DEVICE) for t in q] + ([None] if bits == 8 else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits,group,D", FORMATS)
@pytest.mark.parametrize("ids_name", list(IDS))
def test_qembedding_matches_ref(dtype, bits, group, D, ids_name):
    codes, scales, mins = quantized_table(50, D, bits, group)
    ids = torch.tensor(IDS[ids_name], device=DEVICE, dtype=torch.int32 if bits == 8 else torch.int64)
    out = torch.full((len(IDS[ids_name]), D), float("nan"), dtype=dtype, device=DEVICE)
    got = qembedding_triton(codes, scales, mins, ids, bits=bits, group_size=group, dtype=dtype, out=out)
    assert got is out
    exact = qembedding_ref(codes, scales, mins, ids, bits=bits, dtype=torch.float32)
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        # the interpreter rounds fp32 -> bf16 toward zero (a GPU rounds to nearest): within one ulp
        torch.testing.assert_close(got.float(), exact, atol=0, rtol=2.0**-7)
    else:
        assert torch.equal(got, exact.to(dtype))


def test_a_row_wider_than_one_column_block():
    """D = 2048 takes two column blocks of 1024."""
    codes, scales, mins = quantized_table(3, 2048, 4, 128)
    ids = torch.tensor([2, 0], device=DEVICE)
    got = qembedding_triton(codes, scales, mins, ids, bits=4, group_size=128, dtype=torch.float32)
    assert torch.equal(got, qembedding_ref(codes, scales, mins, ids, bits=4, dtype=torch.float32))


@pytest.mark.parametrize("change,words", [
    (dict(bits=3), "bits must be 8 or 4"),
    (dict(group_size=48), "group_size 48"),
    (dict(mins=None), "mins must be float16"),
    (dict(ids=torch.zeros(2, 2, dtype=torch.int64)), "ids must be 1-D"),
    (dict(dtype=torch.int32), "dtype must be"),
    (dict(codes=torch.zeros(4, 64, dtype=torch.int8)), "4-bit codes must be torch.uint8"),
])
def test_launcher_refuses_what_the_kernel_does_not_take(change, words):
    codes, scales, mins = quantize_int4(torch.randn(4, 128), 32)
    kw = dict(codes=codes, scales=scales, mins=mins, ids=torch.tensor([1]), bits=4, group_size=32,
              dtype=torch.float32) | change
    with pytest.raises(ValueError, match=words):
        qembedding_triton(kw.pop("codes"), kw.pop("scales"), kw.pop("mins"), kw.pop("ids"), **kw)
