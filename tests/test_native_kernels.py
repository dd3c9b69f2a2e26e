"""The native CPU kernels (kernels/cpu/*.cpp) against their torch refs, in f32 and bf16.

Shapes include T=1, odd T, widths that are not powers of two (576), grouped queries, chunks
over a cached context, sequences ending exactly on a block boundary, and padding slots.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F

from llmc.kernels.attention import (kv_write_ref, paged_attention_cpu, paged_attention_ref,
                                    paged_decode_attention_cpu, paged_decode_attention_ref)
from llmc.kernels.linear import PackedLinear, onednn_packs
from llmc.kernels.native import clear_stale_lock, load_native_kernels
from llmc.kernels.rope import RopeTables
from llmc.kernels.rope_kv_write import rope_kv_write_cpu, rope_kv_write_ref
from paged_layout import shuffled_block_tables
from tolerances import assert_as_close_as_ref, tolerance

DTYPES = [torch.float32, torch.bfloat16]
BS = 16


@pytest.fixture(scope="module", autouse=True)
def native():
    load_native_kernels()


def assert_matches(got, want, exact, dtype, reduction):
    """f32: `got` (native) equals the torch ref `want` within the dtype tolerance. bf16, where
    the two round at different points: `got` is as close to the float64 result `exact` as the
    ref is, within a factor 2 and one bf16 ulp of the largest value."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **tolerance(dtype, reduction))
        return
    assert_as_close_as_ref(got, want, exact, dtype)


def random_cache(lens: list[int], kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """A 2-layer cache with random K/V for each sequence's tokens in shuffled blocks of 16."""
    g = torch.Generator().manual_seed(seed)
    tables, block_tables, num_blocks = shuffled_block_tables(lens, BS, g, spare=2)
    cache = torch.zeros(2, 2, num_blocks, kv_heads, BS, head_dim, dtype=dtype)
    for s, n in enumerate(lens):
        slots = torch.tensor([tables[s][p // BS] * BS + p % BS for p in range(n)])
        k, v = (torch.randn(n, kv_heads * head_dim, generator=g).to(dtype) for _ in range(2))
        kv_write_ref(cache, k, v, slots, layer=1)
    return cache, block_tables


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_decode_attention_matches_ref(dtype, heads, kv_heads, head_dim):
    lens = [1, 16, 17, 32, 250, 7, 100]       # one token, exact blocks, one past a block
    cache, tables = random_cache(lens, kv_heads, head_dim, dtype, seed=head_dim)
    q = torch.randn(len(lens), heads * head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    seq_lens, scale = torch.tensor(lens, dtype=torch.int32), head_dim ** -0.5
    got = paged_decode_attention_cpu(q, cache, tables, seq_lens, 1, scale)
    want = paged_decode_attention_ref(q, cache, tables, seq_lens, 1, head_dim, scale)
    exact = paged_decode_attention_ref(q.double(), cache.double(), tables, seq_lens, 1, head_dim, scale)
    assert_matches(got, want, exact, dtype, max(lens))


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_chunks_match_ref(dtype):
    """Decodes, chunks over a cached context (longer than one 16-query tile), a whole prompt."""
    lens, chunk = [9, 57, 1, 40, 6, 33], [1, 21, 1, 40, 1, 17]
    cache, tables = random_cache(lens, 3, 64, dtype, seed=3)
    qsl = torch.tensor([0] + torch.tensor(chunk).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(chunk), 9 * 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = paged_attention_cpu(q, cache, tables, seq_lens, qsl, 1, 0.125)
    want = paged_attention_ref(q, cache, tables, seq_lens, qsl, 1, 64, 0.125)
    exact = paged_attention_ref(q.double(), cache.double(), tables, seq_lens, qsl, 1, 64, 0.125)
    assert_matches(got, want, exact, dtype, max(lens))


def test_attention_launcher_refuses_what_the_kernel_does_not_take():
    cache = torch.zeros(1, 2, 4, 3, 16, 12)                               # head_dim 12
    with pytest.raises(ValueError, match="head_dim a multiple of 16"):
        paged_decode_attention_cpu(torch.zeros(1, 36), cache, torch.zeros(1, 1, dtype=torch.int32),
                                   torch.ones(1, dtype=torch.int32), 0, 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("packed", [True, False])
def test_rope_kv_write_matches_ref(dtype, packed):
    heads, kv_heads, d, t = 9, 3, 64, 13
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    parts = [qkv] if packed else [x.contiguous() for x in qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)]
    positions = torch.randint(0, 500, (t,), generator=g)
    slots = torch.randperm(4 * BS, generator=g)[:t]
    slots[5] = -1                                                         # padding: not written
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    attrs = dict(layer=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=d)
    caches = [torch.zeros(2, 2, 4, kv_heads, BS, d, dtype=dt) for dt in (dtype, dtype, torch.float64)]
    q_got, _ = rope_kv_write_cpu(*parts, positions, caches[0], slots, **attrs,
                                 tables=RopeTables(d, 10000.0, scaling))
    q_want, _ = rope_kv_write_ref(*parts, positions, caches[1], slots, **attrs, theta=10000.0, scaling=scaling)
    q_exact, _ = rope_kv_write_ref(*[x.double() for x in parts], positions, caches[2], slots, **attrs,
                                   theta=10000.0, scaling=scaling)
    assert_matches(q_got, q_want, q_exact, dtype, 2)
    assert_matches(caches[0], caches[1], caches[2], dtype, 2)


def test_rope_tables_are_reused_within_a_step_and_remade_after_a_change():
    tables, positions = RopeTables(64, 10000.0, None), torch.arange(5)
    first = tables(positions)
    assert tables(positions) is first
    positions += 1                                                        # in place: a new step's values
    cos, _ = tables(positions)
    torch.testing.assert_close(cos, (positions.float()[:, None] * tables.inv_freq).cos())


LONGROPE = {"rope_type": "longrope", "factors": "long", "long_factor": [1.0 + i / 8 for i in range(32)],
            "short_factor": [1.0] * 32, "factor": 4.0, "original_max_position_embeddings": 256}


@pytest.mark.parametrize("scaling", [None, LONGROPE])
def test_rope_tables_gather_positions_past_the_tables_made_so_far(scaling):
    """Positions beyond the first tables (0..255) grow them; each row is the rotation's cos and sin
    of its position times the attention factor, whichever step first reached it."""
    tables = RopeTables(64, 10000.0, scaling)
    for positions in (torch.tensor([3, 255]), torch.tensor([256, 7, 1000]), torch.tensor([5000, 0])):
        cos, sin = tables(positions)
        freqs = positions.float()[:, None] * tables.inv_freq
        torch.testing.assert_close(cos, freqs.cos() * tables.attention_factor)
        torch.testing.assert_close(sin, freqs.sin() * tables.attention_factor)


def test_rope_kv_write_refuses_a_slot_outside_the_cache():
    cache = torch.zeros(1, 2, 2, 1, BS, 32)
    with pytest.raises(RuntimeError, match="outside the cache"):
        rope_kv_write_cpu(torch.zeros(1, 96), torch.zeros(1, dtype=torch.long), cache, torch.tensor([2 * BS]),
                          layer=0, num_heads=1, num_kv_heads=1, head_dim=32, tables=RopeTables(32, 1e4, None))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, tokens, bias):
    if not onednn_packs(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} weights on this CPU (bf16 needs AVX512-BW or AVX-NE-CONVERT)")
    g = torch.Generator().manual_seed(tokens)
    x, w = torch.randn(tokens, 576, generator=g).to(dtype), torch.randn(960, 576, generator=g).to(dtype)
    b = torch.randn(960, generator=g).to(dtype) if bias else None
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert_matches(PackedLinear(w)(x, b), F.linear(x, w, b), exact, dtype, 576)


def test_packed_linear_refuses_a_mismatched_input():
    with pytest.raises(ValueError, match="does not fit"):
        PackedLinear(torch.zeros(8, 16))(torch.zeros(2, 8))


@pytest.mark.parametrize("case, words", [
    ("block outside the cache", "outside the cache"),
    ("more queries than tokens", "has 3 queries, length 2"),
    ("length past the block table", "block-table entries"),
])
def test_attention_kernel_refuses_reads_outside_its_inputs(case, words):
    cache, tables, lens, qsl = torch.zeros(1, 2, 4, 1, BS, 16), torch.tensor([[1, 2]], dtype=torch.int32), [20], [0, 1]
    if case == "block outside the cache":
        tables[0, 1] = 4
    elif case == "more queries than tokens":
        lens, qsl = [2], [0, 3]
    else:
        lens = [40]
    q = torch.zeros(qsl[-1], 16)
    with pytest.raises(RuntimeError, match=words):
        torch.ops.llmc.paged_attention(q, cache, tables, torch.tensor(lens, dtype=torch.int32),
                                       torch.tensor(qsl, dtype=torch.int32), 0, 1.0)


def test_a_build_lock_left_by_a_stopped_build_is_removed_and_a_fresh_one_kept(tmp_path):
    """torch's builder would wait forever on the lock a build killed midway leaves behind."""
    lock = tmp_path / "lock"
    lock.touch()
    clear_stale_lock(tmp_path)
    assert lock.exists()                                   # a build may be running right now
    old = time.time() - 3600
    os.utime(lock, (old, old))
    clear_stale_lock(tmp_path)
    assert not lock.exists()
    clear_stale_lock(tmp_path)                             # no lock: nothing to do
