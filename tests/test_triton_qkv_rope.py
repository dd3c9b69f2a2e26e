"""The QKV GEMM with RoPE + KV write as its epilogue (kernels/triton/qkv_rope.py) against the
unfused path in torch (`qkv_rope_ref`: the GEMM, with its norm prologue or none, rounded to the
dtype, then rope_kv_write_ref).

Both round the GEMM's result to the dtype before the rotation and compute cos/sin the same way, so
they differ only where the fp32 sums of the product land either side of a rounding: one ulp of
the dtype in a rotated value's two inputs, then its own rounding (the tolerance below). The cache
rows the step does not write (other slots, the padding row's) must be untouched, bit for bit. Runs
in Triton's interpreter here (fp32 and fp16); q is allocated by torch.empty under deterministic
algorithms, so a column the kernel never writes is NaN.
"""

from __future__ import annotations

import pytest
import torch

from llmc.compiler.ops.rope import rope_inv_freq
from llmc.kernels.triton.qkv_rope import qkv_rope_ref, qkv_rope_triton
from tolerances import EPS, tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
THETA, LAYER, BLOCK, BLOCKS = 10000.0, 1, 8, 6
SCALE = 4.0                                         # largest |value| of the product, about
HEADS = [(4, 2, 16), (3, 3, 12)]                    # (H, KVH, D): GQA; MHA with D/2 = 6, not a power of two


def rotated_tolerance(dtype: torch.dtype, K: int) -> dict[str, float]:
    """fp32 reduction over K, one ulp of `dtype` in each of a rotated value's two inputs, and its rounding."""
    acc = tolerance(torch.float32, K, SCALE)["atol"]
    tol = acc + 3 * EPS[dtype] * SCALE
    return {"atol": tol, "rtol": tol}


def make_step(M, K, heads, dtype, bias: bool, norm: str, seed=0):
    g = torch.Generator().manual_seed(seed)
    H, KVH, D = heads
    width = (H + 2 * KVH) * D
    t = dict(x=torch.randn(M, K, generator=g), w=torch.randn(width, K, generator=g) / K ** 0.5,
             bias=torch.randn(width, generator=g) if bias else None,
             norm_weight=1 + 0.5 * torch.randn(K, generator=g) if norm else None,
             norm_residual=torch.randn(M, K, generator=g) if norm == "add" else None)
    t = {k: None if v is None else v.to(dtype=dtype, device=DEVICE) for k, v in t.items()}
    positions = torch.randint(0, 100, (M,), generator=g).to(DEVICE)
    slots = torch.randperm(BLOCKS * BLOCK, generator=g)[:M].to(DEVICE)
    if M > 1:
        slots[1] = -1                                                   # a padding row: writes nothing
    cache = torch.randn(2, 2, BLOCKS, KVH, BLOCK, D, generator=g).to(dtype=dtype, device=DEVICE)
    return t, positions, slots, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("norm", ["", "rms", "add"])
@pytest.mark.parametrize("bias", [False, True])
def test_qkv_rope_matches_the_gemm_then_rope_kv_write(dtype, M, heads, norm, bias):
    K = 48
    t, positions, slots, cache = make_step(M, K, heads, dtype, bias, norm)
    H, KVH, D = heads
    shape = dict(layer=LAYER, num_heads=H, num_kv_heads=KVH, head_dim=D)
    got_cache, want_cache = cache.clone(), cache.clone()
    opts = dict(norm_weight=t["norm_weight"], eps=1e-5, norm_residual=t["norm_residual"])
    torch.use_deterministic_algorithms(True)
    try:
        got = qkv_rope_triton(t["x"], t["w"], t["bias"], positions, got_cache, slots,
                              inv_freq=rope_inv_freq(D, THETA, None).to(DEVICE), **shape, **opts)
    finally:
        torch.use_deterministic_algorithms(False)
    want = qkv_rope_ref(t["x"], t["w"], t["bias"], positions, want_cache, slots, theta=THETA, **shape, **opts)
    assert len(got) == len(want) == (3 if norm == "add" else 2) and got[1] is got_cache
    tol = rotated_tolerance(dtype, K)
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got_cache, want_cache, **tol)
    written = torch.zeros(BLOCKS * BLOCK, dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    untouched = ~written.view(BLOCKS, 1, BLOCK, 1).expand(BLOCKS, KVH, BLOCK, D).to(DEVICE)
    assert torch.equal(got_cache[LAYER, :, untouched], cache[LAYER, :, untouched])
    assert torch.equal(got_cache[0], cache[0])                                 # another layer: untouched
    if norm == "add":
        assert torch.equal(got[2], want[2])


@pytest.mark.parametrize("change,words", [
    (dict(kv_cache=torch.zeros(2, 2, 4, 2, 8, 20, dtype=torch.int8)), "an int8 cache: rope_kv_write_triton"),
    (dict(w=torch.zeros(100, 24)), "w must be \\[128, 24\\]"),
    (dict(inv_freq=torch.zeros(4)), "inv_freq must be \\[8\\] float32"),
    (dict(slot_mapping=torch.zeros(2, dtype=torch.int64)), "slot_mapping must be \\[3\\]"),
    (dict(norm_residual=torch.zeros(3, 24)), "norm_residual needs norm_weight"),
])
def test_launcher_refuses_what_the_kernel_does_not_take(change, words):
    kw = dict(x=torch.zeros(3, 24), w=torch.zeros(128, 24), bias=None, positions=torch.zeros(3, dtype=torch.int64),
              kv_cache=torch.zeros(2, 2, 4, 2, 8, 16), slot_mapping=torch.zeros(3, dtype=torch.int64),
              inv_freq=torch.zeros(8), norm_residual=None) | change
    with pytest.raises(ValueError, match=words):
        qkv_rope_triton(kw["x"], kw["w"], kw["bias"], kw["positions"], kw["kv_cache"], kw["slot_mapping"], layer=1,
                        num_heads=4, num_kv_heads=2, head_dim=16, inv_freq=kw["inv_freq"],
                        norm_residual=kw["norm_residual"])
