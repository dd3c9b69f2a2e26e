"""Greedy picks (kernels/argmax.py): the native kernel equals torch.argmax (the ref) index for index,
ties (the first index), NaNs (the first NaN), infinities, bf16 and vocabularies that do not fill the
last 16 lanes included; bad logits are refused."""

import pytest
import torch

from llmc.kernels.argmax import argmax_rows, argmax_rows_ref
from llmc.kernels.native import load_native_kernels

NAN, INF = float("nan"), float("inf")


def native(logits: torch.Tensor) -> torch.Tensor:
    load_native_kernels()
    return torch.ops.llmc.argmax_rows(logits.contiguous())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, vocab", [(1, 49152), (20, 300), (3, 1), (4, 15), (2, 16), (5, 33)])
def test_native_equals_torch_argmax(rows, vocab, dtype):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    assert torch.equal(native(logits), argmax_rows_ref(logits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_nans_and_infinities_pick_what_torch_picks(dtype):
    vocab = 40                                      # two whole vectors and a tail of 8
    cases = {"tie in one vector": {11: 9.0, 6: 9.0}, "tie in the body": {5: 9.0, 21: 9.0},
             "tie body and tail": {37: 9.0, 3: 9.0}, "tie in the tail": {33: 9.0, 38: 9.0},
             "max in the tail": {35: 9.0},
             "NaN after the max": {2: 9.0, 30: NAN}, "NaN in the tail": {1: 9.0, 36: NAN, 39: NAN},
             "two NaNs": {20: NAN, 4: NAN}, "+inf twice": {17: INF, 9: INF}, "NaN beside +inf": {0: INF, 12: NAN}}
    logits = torch.randn(len(cases) + 2, vocab, generator=torch.Generator().manual_seed(0))
    for row, values in enumerate(cases.values()):
        for col, value in values.items():
            logits[row, col] = value
    logits[-2] = -INF                               # nothing but -inf: index 0
    logits[-1] = NAN                                # nothing but NaN: index 0
    logits = logits.to(dtype)
    got, want = native(logits), argmax_rows_ref(logits)
    assert got.tolist() == want.tolist(), dict(zip([*cases, "all -inf", "all NaN"], got.tolist()))


def test_launcher_takes_views_and_refuses_bad_logits():
    wide = torch.randn(6, 100)
    assert torch.equal(argmax_rows(wide[:, 10:70]), argmax_rows_ref(wide[:, 10:70]))
    for bad in (torch.randn(100), torch.zeros(2, 0), torch.randint(0, 9, (2, 5))):
        with pytest.raises(ValueError, match="argmax_rows takes f32 or bf16 logits"):
            argmax_rows(bad)
