"""The native CPU kernels with an int8 KV cache (kernels/quant.py's rows) against the torch refs.

The write: V rows (not rotated) are quantized bit for bit as `quantize_kv_rows`; K rows are
quantized from the kernel's fp32 rotation where the ref rounds the rotated k to q's dtype first,
so a K code may differ from the ref's by 1 and its scale by that rounding. The read: paged
attention over int8 rows dequantized as code * scale, against the ref over the same rows;
rows no sequence owns hold NaN scales (float caches: NaN values), so a read of one shows.
"""

from __future__ import annotations

import pytest
import torch

from llmc.kernels.attention import paged_attention_cpu, paged_attention_ref
from llmc.kernels.quant import dequantize_kv_rows
from llmc.kernels.rope import RopeTables, rope_ref
from llmc.kernels.rope_kv_write import rope_kv_write_cpu, rope_kv_write_ref
from paged_layout import NAN_SCALE, poisoned_caches
from test_native_kernels import assert_matches

DTYPES = [torch.float32, torch.bfloat16]
BS = 16


def attention_run(lens, chunks, heads, kv_heads, head_dim, cache_dtype, dtype, seed=0, kernel=paged_attention_cpu,
                  window=0, softcap=0.0):
    """(`kernel` (the native launcher or op) over a cache with NaN rows, the ref over a clean one, the
    ref in float64, the clean cache); with a window, the blocks before every query's window are NaN
    too (they must not be read)."""
    clean, poisoned, tables = poisoned_caches(lens, kv_heads, head_dim, cache_dtype, dtype, BS, seed)
    if window:
        poison_outside_window(poisoned, tables, lens, chunks, window)
    qsl = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(chunks), heads * head_dim, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    seq_lens, scale, options = torch.tensor(lens, dtype=torch.int32), head_dim ** -0.5, dict(window=window,
                                                                                            softcap=softcap)
    got = kernel(q, poisoned, tables, seq_lens, qsl, 1, scale, **options)
    want = paged_attention_ref(q, clean, tables, seq_lens, qsl, 1, head_dim, scale, **options)
    exact_cache = clean if cache_dtype == torch.int8 else clean.double()
    exact = paged_attention_ref(q.double(), exact_cache, tables, seq_lens, qsl, 1, head_dim, scale, **options)
    assert got.isfinite().all()
    return got, want, exact, clean


def check_attention(lens, chunks, heads, kv_heads, head_dim, cache_dtype, dtype, seed=0, kernel=paged_attention_cpu,
                    window=0, softcap=0.0):
    """attention_run's kernel against the ref, as close to float64 as the ref is."""
    got, want, exact, _ = attention_run(lens, chunks, heads, kv_heads, head_dim, cache_dtype, dtype, seed, kernel,
                                        window, softcap)
    assert_matches(got, want, exact, dtype, max(lens))


def poison_outside_window(cache: torch.Tensor, tables: torch.Tensor, lens, chunks, window: int) -> None:
    """NaN (int8: NaN scales) in layer 1's blocks that lie wholly before the window of every
    query of their sequence, in place."""
    for s, (n, chunk) in enumerate(zip(lens, chunks)):
        first_key = max(0, n - chunk - window + 1)             # the first query's window starts here
        for b in tables[s, : first_key // BS].tolist():
            if cache.dtype == torch.int8:
                cache[1, :, b, ..., -4:] = NAN_SCALE
            else:
                cache[1, :, b] = float("nan")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32)])
def test_int8_decode_attention_matches_ref(dtype, heads, kv_heads, head_dim):
    lens = [1, 16, 17, 250, 7]                # one token, a whole block, one past a block
    check_attention(lens, [1] * len(lens), heads, kv_heads, head_dim, torch.int8, dtype, seed=head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", ["int8", "float"])
def test_mixed_step_with_poisoned_rows_matches_ref(dtype, cache_dtype):
    """Decodes, odd chunks over a cached context (longer than a query tile), whole prompts."""
    lens, chunks = [9, 57, 1, 40, 6, 33, 71], [1, 21, 1, 40, 1, 17, 71]
    check_attention(lens, chunks, 9, 3, 64, torch.int8 if cache_dtype == "int8" else dtype, dtype, seed=3)


def rope_write(dtype: torch.dtype, positions: torch.Tensor, packed: bool, seed: int):
    """(native, ref) results of rope_kv_write into int8 caches, q's float64 rotation, and the slots written."""
    heads, kv_heads, d, t = 9, 3, 64, positions.numel()
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (heads + 2 * kv_heads) * d, generator=g) * 2).to(dtype)
    parts = [qkv] if packed else [x.contiguous() for x in qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)]
    slots = torch.randperm(4 * BS, generator=g)[:t]
    slots[t // 2] = -1                                                  # padding: not written
    caches = [torch.full((2, 2, 4, kv_heads, BS, d + 4), 7, dtype=torch.int8) for _ in range(2)]
    attrs = dict(layer=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=d)
    q_got, _ = rope_kv_write_cpu(*parts, positions, caches[0], slots, **attrs, tables=RopeTables(d, 1e4, None))
    q_want, _ = rope_kv_write_ref(*parts, positions, caches[1], slots, **attrs, theta=1e4, scaling=None)
    q_exact = rope_ref(qkv[:, :heads * d].double(), positions, d, 1e4, None)
    return (q_got, caches[0]), (q_want, caches[1]), q_exact, slots


def cache_rows(cache: torch.Tensor, which: int, slots: torch.Tensor) -> torch.Tensor:
    """The rows [n, KVH, D + 4] that `slots` (all >= 0) hold in layer 1's K (0) or V (1)."""
    return cache[1, which][slots // BS, :, slots % BS]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("packed", [True, False])
def test_rope_kv_write_int8_matches_ref(dtype, packed):
    positions = torch.randint(0, 4000, (13,), generator=torch.Generator().manual_seed(5))
    (q_got, got), (q_want, want), q_exact, slots = rope_write(dtype, positions, packed, seed=6)
    assert_matches(q_got, q_want, q_exact, dtype, 2)
    untouched = torch.ones(4 * BS, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    blocks, offsets = untouched.nonzero()[:, 0] // BS, untouched.nonzero()[:, 0] % BS
    assert got[1, :, blocks, :, offsets].eq(7).all() and got[0].eq(7).all()
    valid = slots[slots >= 0]
    torch.testing.assert_close(cache_rows(got, 1, valid), cache_rows(want, 1, valid), atol=0, rtol=0)  # V exact
    k_got, k_want = cache_rows(got, 0, valid), cache_rows(want, 0, valid)
    code_diff = (k_got[..., :-4].int() - k_want[..., :-4].int()).abs()
    # f32: the two rotations differ by an ulp or two; bf16: the ref's rotation rounds cos, sin, two
    # products and their sum to bf16, up to ~2^-7 relative, about 1/4 of a code step at most
    f32 = dtype == torch.float32
    assert code_diff.max() <= 1 and code_diff.float().mean() < (0.01 if f32 else 0.25)
    scale_rtol = 2.0**-21 if f32 else 2.0**-7
    torch.testing.assert_close(k_got[..., -4:].view(torch.float32), k_want[..., -4:].view(torch.float32),
                               rtol=scale_rtol, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kv_write_int8_is_bit_exact_where_the_rotation_is(dtype):
    """At position 0 the rotation is the identity (cos 1, sin 0), exact in any dtype: K's codes
    and scales equal quantize_kv_rows of the input's k, bit for bit."""
    (_, got), (_, want), _, slots = rope_write(dtype, torch.zeros(7, dtype=torch.long), False, seed=8)
    valid = slots[slots >= 0]
    for which in (0, 1):
        torch.testing.assert_close(cache_rows(got, which, valid), cache_rows(want, which, valid), atol=0, rtol=0)


def test_int8_k_rows_are_within_half_a_step_of_the_rotation():
    """Dequantized, the native kernel's K rows are the float64 rotation to within half a code step."""
    positions = torch.randint(0, 4000, (9,), generator=torch.Generator().manual_seed(9))
    (_, got), _, _, slots = rope_write(torch.float32, positions, False, seed=10)
    qkv = torch.randn(9, 15 * 64, generator=torch.Generator().manual_seed(10)) * 2   # rope_write's inputs
    k = rope_ref(qkv[:, 9 * 64:12 * 64].double(), positions, 64, 1e4, None)           # [T, KVH*D]
    rows = cache_rows(got, 0, slots[slots >= 0])                                       # [n, KVH, D + 4]
    scale = rows[..., -4:].contiguous().view(torch.float32).double()                   # [n, KVH, 1]
    err = (dequantize_kv_rows(rows).double() - k[slots >= 0].view(-1, 3, 64)).abs()
    assert (scale > 0).all() and (err <= scale * (0.5 + 1e-5)).all()


def op_table_attention(monkeypatch, table_op=None):
    """The native op table's int8-cache attention entries with bf16 activations (no fallback to the
    refs: those are made to fail), each as (native, ref, float64 ref) on the native write's q and
    cache: [prefill of a 21-token prompt, decode of its last token]; `table_op` wraps both entries.
    The write's q is checked as rope_kv_write_cpu's is, its codes within one of the ref's."""
    from llmc.kernels import native_ops
    from llmc.kernels.torch_ops import run_op

    table = native_ops.native_op_impls()
    monkeypatch.setattr(native_ops, "OPS", {})                         # a fallback to a ref would KeyError
    wrap = table_op or (lambda op: op)
    heads, kv_heads, d, t = 9, 3, 64, 21
    g = torch.Generator().manual_seed(14)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(torch.bfloat16)
    positions = slots = torch.arange(t)                                  # a prompt in blocks 0 and 1
    attrs = dict(layer=0, num_heads=heads, num_kv_heads=kv_heads, head_dim=d, theta=1e4, scaling=None, scale=0.125)
    caches = [torch.zeros(1, 2, 3, kv_heads, BS, d + 4, dtype=torch.int8) for _ in range(2)]
    q, _ = run_op("rope_kv_write", [qkv, positions, caches[0], slots], attrs, table)
    q_ref, _ = run_op("rope_kv_write", [qkv, positions, caches[1], slots], attrs)
    assert_matches(q, q_ref, rope_ref(qkv[:, :heads * d].double(), positions, d, 1e4, None), torch.bfloat16, 2)
    assert (caches[0][..., :-4].int() - caches[1][..., :-4].int()).abs().max() <= 1
    step = [torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([t], dtype=torch.int32)]
    qsl = torch.tensor([0, t], dtype=torch.int32)
    exact = paged_attention_ref(q.double(), caches[0], *step, qsl, 0, d, 0.125)
    inputs = {"paged_attention": ([q, caches[0], *step, qsl], exact),
              "paged_decode_attention": ([q[-1:], caches[0], *step], exact[-1:])}
    return [(run_op(op, x, attrs, {op: wrap(table[op])}), run_op(op, x, attrs), e) for op, (x, e) in inputs.items()]


def test_native_op_table_runs_an_int8_cache_natively(monkeypatch):
    """The table's entries run natively and mean what the refs mean: each attention as close to
    the float64 one over the same q and rows as the ref's."""
    for got, want, exact in op_table_attention(monkeypatch):
        assert_matches(got, want, exact, torch.bfloat16, 21)


BUGS = {"zeroed": 0.0, "negated": -1.0, "1.5x": 1.5, "3% high": 1.03, "3% low": 0.97}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_bug_planted_in_the_op_tables_attention_fails_the_check(monkeypatch, bug):
    """Each entry made to return its output scaled: the check above fails."""
    runs = op_table_attention(monkeypatch, lambda op: lambda x, a: op(x, a) * BUGS[bug])
    for got, want, exact in runs:
        with pytest.raises(AssertionError):
            assert_matches(got, want, exact, torch.bfloat16, 21)
