"""The int8 KV cache in the Triton templates: the RoPE + KV write quantizes each K/V row exactly as
`quantize_kv_rows`, both paged attention kernels dequantize it as the refs do.

Caches are poisoned: every row no token owns holds random codes and a NaN scale (its last 4
bytes), and block table padding entries name such a block, so a kernel that reads a row it
must not turns the output NaN; the refs run on the same cache with those scales zeroed.
"""

from __future__ import annotations

import pytest
import torch

from llmc.kernels.attention import kv_write_ref, paged_attention_ref, paged_decode_attention_ref
from llmc.kernels.quant import KV_SCALE_BYTES, dequantize_kv_rows, quantize_kv_rows
from llmc.kernels.rope import rope_inv_freq
from llmc.kernels.rope_kv_write import rope_kv_write_ref
from llmc.kernels.triton.paged_decode_attention import decode_splits, paged_decode_attention_triton
from llmc.kernels.triton.paged_prefill_attention import paged_prefill_attention_triton
from llmc.kernels.triton.rope_kv_write import rope_kv_write_triton
from paged_layout import shuffled_block_tables
from test_triton_attention import assert_attention_close
from test_triton_rope_kv_write import rope_tolerance
from tolerances import EPS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]          # bf16: the interpreter's bf16 dot is wrong
LAYER, THETA = 1, 10000.0


def poisoned_int8_cache(num_blocks: int, kv_heads: int, block_size: int, head_dim: int, seed: int) -> torch.Tensor:
    """A 2-layer int8 cache whose every row is random codes and a NaN scale."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randint(-127, 128, (2, 2, num_blocks, kv_heads, block_size, head_dim + KV_SCALE_BYTES),
                          generator=g, dtype=torch.int8)
    scale_bytes(cache).fill_(float("nan"))
    return cache


def scale_bytes(cache: torch.Tensor) -> torch.Tensor:
    """The fp32 scales of an int8 cache [..., D + 4], as a writable float32 view [..., 1]."""
    return cache[..., -KV_SCALE_BYTES:].view(torch.float32)


def cleaned(cache: torch.Tensor) -> torch.Tensor:
    """The cache with NaN scales zeroed (rows nobody wrote dequantize to 0): for the refs."""
    clean = cache.clone()
    scale_bytes(clean).nan_to_num_(0.0)
    return clean


# ------------------------------------------------------------------ RoPE + KV write


def write_case(dtype, positions: list[int], slots: list[int], heads=6, kv_heads=2, head_dim=20, seed=0,
               qkv: torch.Tensor | None = None):
    """(Triton's q and cache, the ref's q and cache) of one write into a poisoned int8 cache."""
    g = torch.Generator().manual_seed(seed)
    if qkv is None:
        qkv = torch.randn(len(slots), (heads + 2 * kv_heads) * head_dim, generator=g)
    qkv = qkv.to(dtype)
    cache = poisoned_int8_cache(3, kv_heads, 4, head_dim, seed)
    pos, slot = torch.tensor(positions), torch.tensor(slots, dtype=torch.int32)
    attrs = dict(layer=LAYER, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    q_want, cache_want = rope_kv_write_ref(qkv, pos, cache.clone(), slot, **attrs, theta=THETA, scaling=None)
    q_out = torch.full((len(slots), heads * head_dim), float("nan"), dtype=dtype, device=DEVICE)
    q_got, cache_got = rope_kv_write_triton(qkv.to(DEVICE), pos.to(DEVICE), cache.to(DEVICE), slot.to(DEVICE),
                                            **attrs, inv_freq=rope_inv_freq(head_dim, THETA, None).to(DEVICE),
                                            q_out=q_out)
    return q_got.cpu(), cache_got.cpu(), q_want, cache_want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slots", [[9], [1, 5, -1, 11, 6]], ids=["T1", "T5-padded"])
def test_rope_kv_write_quantizes_rows_as_the_ref(dtype, slots):
    """V rows are bit for bit the ref's, as are rows nobody wrote (padding, the other layer, NaN
    scales untouched); K rows go through RoPE, whose fp32 rounding differs from the ref's in
    the last bit, so a code may land one step away: dequantized K within one scale step."""
    positions = [3, 7, 100, 0, 2][: len(slots)]
    q_got, got, q_want, want = write_case(dtype, positions, slots, seed=len(slots))
    v_got, v_want = got[:, 1].view(torch.uint8), want[:, 1].view(torch.uint8)
    assert torch.equal(v_got, v_want)
    k_got, k_want = dequantize_kv_rows(got[:, 0]), dequantize_kv_rows(want[:, 0])
    step = scale_bytes(want[:, 0]).nan_to_num(0.0)                         # [.., 1]: one code's worth
    assert torch.equal(k_got.isnan(), k_want.isnan())
    assert ((k_got - k_want).nan_to_num(0.0).abs() <= 1.01 * step + 1e-6).all()
    written = ~scale_bytes(want).isnan()                                   # a K scale: amax of a roped row,
    torch.testing.assert_close(scale_bytes(got)[written], scale_bytes(want)[written],  # a few roundings apart
                               rtol=4 * EPS[dtype], atol=0)
    torch.testing.assert_close(q_got.float(), q_want.float(), **rope_tolerance(dtype))


def test_ties_round_half_to_even_and_a_zero_row_gets_zero_codes():
    """Position 0 leaves K unrotated, so K and V rows reach the quantizer as given: a row with
    amax 127 has scale 1 and quotients exactly on .5, where rint and floor(x + 0.5) differ;
    0.49999997 (just under .5) must round to 0; an all-zero row has scale 0 and codes 0."""
    ties = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5, -126.5, 0.49999997, 4.5,
                         -4.5, 5.5, 6.5, -7.5, 8.5, 9.5, 10.5, -11.5])          # D = 20
    heads, kv_heads, D = 2, 2, 20
    qkv = torch.cat([torch.randn(2 * D), ties, torch.zeros(D), ties.flip(0), -ties])[None]   # q, k, v: 2 heads each
    q_got, got, _, want = write_case(torch.float32, [0], [6], heads, kv_heads, D, qkv=qkv)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    row = got[LAYER, 0, 1, 0, 2]                                          # slot 6: block 1, offset 2, head 0
    assert row[:D].tolist()[:11] == [127, 0, 2, 2, 0, -2, -2, 4, 126, -126, 0]
    assert torch.equal(row, quantize_kv_rows(ties))
    assert got[LAYER, 0, 1, 1, 2].view(torch.uint8).eq(0).all()            # the zero row: codes and scale 0


def test_an_int8_cache_with_head_dim_not_a_multiple_of_four_is_refused():
    cache = torch.zeros(1, 2, 2, 1, 4, 6 + KV_SCALE_BYTES, dtype=torch.int8)
    qkv = torch.zeros(1, 3 * 6)
    with pytest.raises(ValueError, match="multiple of 4"):
        rope_kv_write_triton(qkv, torch.zeros(1, dtype=torch.long), cache, torch.zeros(1, dtype=torch.long),
                             layer=0, num_heads=1, num_kv_heads=1, head_dim=6, inv_freq=rope_inv_freq(6, THETA, None))


# ------------------------------------------------------------------ attention


def attention_cache(lens: list[int], kv_heads: int, head_dim: int, block_size: int, seed: int):
    """A poisoned int8 cache holding quantized random K/V of each sequence at layer 1 in shuffled
    blocks; block table padding entries name a block nobody owns."""
    g = torch.Generator().manual_seed(seed)
    tables, block_tables, num_blocks = shuffled_block_tables(lens, block_size, g, spare=3)
    spare = min(set(range(num_blocks)) - {b for t in tables for b in t})
    for s, table in enumerate(tables):
        block_tables[s, len(table):] = spare
    cache = poisoned_int8_cache(num_blocks, kv_heads, block_size, head_dim, seed)
    for s, n in enumerate(lens):
        if n == 0:
            continue
        slots = torch.tensor([tables[s][p // block_size] * block_size + p % block_size for p in range(n)])
        k, v = (torch.randn(n, kv_heads * head_dim, generator=g) for _ in range(2))
        kv_write_ref(cache, k, v, slots, layer=LAYER)
    return cache.to(DEVICE), block_tables.to(DEVICE)


def queries(tokens: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(tokens, width, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 80), (4, 4, 32)])
def test_decode_over_an_int8_cache_matches_ref(dtype, heads, kv_heads, head_dim):
    """One token, a context ending mid-block, a padding row, one long enough for several splits."""
    lens = [1, 37, 0, 200]
    assert decode_splits(len(lens), kv_heads, 208)[0] > 1
    cache, tables = attention_cache(lens, kv_heads, head_dim, 16, seed=head_dim)
    q = queries(len(lens), heads * head_dim, dtype, seed=1)
    seq_lens, scale = torch.tensor(lens, dtype=torch.int32, device=DEVICE), head_dim ** -0.5
    got = paged_decode_attention_triton(q, cache, tables, seq_lens, LAYER, scale, out=torch.full_like(q, float("nan")))
    assert got[2].eq(0).all()
    live, clean = seq_lens > 0, cleaned(cache)
    want = paged_decode_attention_ref(q[live], clean, tables[live], seq_lens[live], LAYER, head_dim, scale)
    exact = paged_decode_attention_ref(q[live].double(), clean, tables[live], seq_lens[live], LAYER, head_dim, scale)
    assert_attention_close(got[live], want, exact, dtype, max(lens))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 4])
def test_mixed_step_over_an_int8_cache_matches_ref(dtype, block_size):
    """Decode tokens, a chunk over cached context, a whole prompt: 45 query rows, GQA of 3."""
    lens, chunks = [9, 48, 1, 30], [1, 13, 1, 30]
    cache, tables = attention_cache(lens, 2, 80, block_size, seed=block_size)
    q = queries(sum(chunks), 6 * 80, dtype, seed=2)
    seq_lens, scale = torch.tensor(lens, dtype=torch.int32, device=DEVICE), 80 ** -0.5
    qsl = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    got = paged_prefill_attention_triton(q, cache, tables, seq_lens, qsl, LAYER, scale,
                                         out=torch.full_like(q, float("nan")))
    clean = cleaned(cache)
    want = paged_attention_ref(q, clean, tables, seq_lens, qsl, LAYER, 80, scale)
    exact = paged_attention_ref(q.double(), clean, tables, seq_lens, qsl, LAYER, 80, scale)
    assert_attention_close(got, want, exact, dtype, max(lens))


@pytest.mark.parametrize("dtype", DTYPES)
def test_window_and_softcap_over_an_int8_cache_match_ref(dtype):
    """A window of 16 (a block) and a softcap that bites, decode and a mixed step, int8 rows."""
    lens, chunks, options = [9, 48, 1, 130], [1, 13, 1, 30], dict(window=16, softcap=0.8)
    cache, tables = attention_cache(lens, 2, 80, 16, seed=3)
    seq_lens, scale, clean = torch.tensor(lens, dtype=torch.int32, device=DEVICE), 80 ** -0.5, cleaned(cache)
    q = queries(len(lens), 6 * 80, dtype, seed=4)
    got = paged_decode_attention_triton(q, cache, tables, seq_lens, LAYER, scale, **options)
    want = paged_decode_attention_ref(q, clean, tables, seq_lens, LAYER, 80, scale, **options)
    exact = paged_decode_attention_ref(q.double(), clean, tables, seq_lens, LAYER, 80, scale, **options)
    assert_attention_close(got, want, exact, dtype, 16)
    q = queries(sum(chunks), 6 * 80, dtype, seed=5)
    qsl = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    got = paged_prefill_attention_triton(q, cache, tables, seq_lens, qsl, LAYER, scale, **options)
    want = paged_attention_ref(q, clean, tables, seq_lens, qsl, LAYER, 80, scale, **options)
    exact = paged_attention_ref(q.double(), clean, tables, seq_lens, qsl, LAYER, 80, scale, **options)
    assert_attention_close(got, want, exact, dtype, 16)


def test_attention_refuses_an_int8_cache_with_rows_not_four_aligned():
    cache = torch.zeros(2, 2, 4, 2, 16, 6 + KV_SCALE_BYTES, dtype=torch.int8, device=DEVICE)
    q = torch.zeros(2, 4 * 6, device=DEVICE)
    tables, lens = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE), torch.ones(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of 4"):
        paged_decode_attention_triton(q, cache, tables, lens, LAYER, 0.1)
