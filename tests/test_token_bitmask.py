"""The grammar-mask kernel (kernels/token_bitmask.py): the native kernel equals the torch ref bit for
bit, and the ref equals the definition read one token at a time."""

import pytest
import torch

from llmc.kernels.native import load_native_kernels
from llmc.kernels.token_bitmask import apply_token_bitmask, apply_token_bitmask_ref, token_bitmask_bools


def random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Random words, with whole words all set and all clear as a grammar's masks mostly are."""
    gen = torch.Generator().manual_seed(seed)
    words = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), generator=gen, dtype=torch.int64)
    kind = torch.randint(0, 3, words.shape, generator=gen)
    words = torch.where(kind == 0, -1, torch.where(kind == 1, 0, words))
    return words.to(torch.int32)


def by_definition(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for i, r in enumerate(rows):
        for t in range(logits.shape[1]):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


def test_ref_is_the_definition():
    logits = torch.randn(5, 77)
    bitmask, rows = random_bitmask(3, 77, seed=1), [4, 0, 2]
    want = by_definition(logits, bitmask, rows)
    assert torch.equal(apply_token_bitmask_ref(logits.clone(), bitmask, torch.tensor(rows)), want)
    assert token_bitmask_bools(bitmask, 77).sum() == (want[rows] != float("-inf")).sum()


@pytest.mark.parametrize("vocab", [1, 31, 32, 300, 49152])
def test_native_equals_ref(vocab):
    load_native_kernels()
    logits = torch.randn(9, vocab)
    bitmask, rows = random_bitmask(4, vocab, seed=vocab), torch.tensor([8, 3, 0, 5])
    want = apply_token_bitmask_ref(logits.clone(), bitmask, rows)
    got = logits.clone()
    assert hasattr(torch.ops.llmc, "apply_token_bitmask")      # the native kernel, not the ref, runs here
    apply_token_bitmask(got, bitmask, rows)
    assert torch.equal(got, want)
    untouched = [r for r in range(9) if r not in rows.tolist()]
    assert torch.equal(got[untouched], logits[untouched])


def test_launcher_refuses_what_the_kernel_does_not_take():
    logits = torch.randn(2, 64)
    with pytest.raises(ValueError, match="int32 covering 64 tokens"):
        apply_token_bitmask(logits, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0]))
    with pytest.raises(ValueError, match="f32 logits"):
        apply_token_bitmask(logits.half(), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0]))
    with pytest.raises(ValueError, match="2 row indices for 1 bitmask rows"):
        apply_token_bitmask(logits, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0, 1]))
