"""Attention references (paged and cache-less) against a naive per-sequence computation in
float64, with and without a sliding window and soft-capping."""

from __future__ import annotations

import pytest
import torch

from llmc.kernels.attention import attention_ref, kv_write_ref, paged_attention_ref, paged_decode_attention_ref
from paged_layout import shuffled_block_tables
from tolerances import tolerance

LAYERS, KVH, GROUPS, D, BS = 2, 3, 3, 12, 4
H = KVH * GROUPS


def random_layout(lens: list[int], seed: int):
    """A cache holding random K/V for each sequence's tokens, in shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    tables, block_tables, num_blocks = shuffled_block_tables(lens, BS, g, spare=3)
    cache = torch.zeros(LAYERS, 2, num_blocks, KVH, BS, D)
    keys = [torch.randn(n, KVH * D, generator=g) for n in lens]
    values = [torch.randn(n, KVH * D, generator=g) for n in lens]
    for s, n in enumerate(lens):
        slots = torch.tensor([tables[s][p // BS] * BS + p % BS for p in range(n)])
        kv_write_ref(cache, keys[s], values[s], slots, layer=1)
    return cache, block_tables, keys, values


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, window: int = 0,
          softcap: float = 0.0) -> torch.Tensor:
    """q [n, H*D] at positions first_pos.., k/v [L, KVH*D]; causal, keys j > pos - window where
    window > 0, scores softcap * tanh(scores / softcap) where softcap > 0; float64; GQA by
    repetition."""
    qh = q.double().view(-1, H, D).transpose(0, 1)                                    # [H, n, D]
    kh = k.double().view(-1, KVH, D).repeat_interleave(GROUPS, dim=1).transpose(0, 1)  # [H, L, D]
    vh = v.double().view(-1, KVH, D).repeat_interleave(GROUPS, dim=1).transpose(0, 1)
    scores = qh @ kh.transpose(1, 2) * D ** -0.5
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(first_pos, first_pos + q.shape[0])[:, None]
    key = torch.arange(k.shape[0])[None, :]
    hidden = (key > pos) | ((key <= pos - window) if window else False)
    scores = scores.masked_fill(hidden, float("-inf"))
    return (torch.softmax(scores, -1) @ vh).transpose(0, 1).reshape(q.shape[0], -1).float()


@pytest.mark.parametrize("num_seqs", [1, 5, 40])   # 40 > one bucket of 16: the sorted-bucket path
def test_decode_attention_matches_naive(num_seqs):
    g = torch.Generator().manual_seed(num_seqs)
    lens = torch.randint(1, 30, (num_seqs,), generator=g).tolist()
    cache, tables, keys, values = random_layout(lens, seed=num_seqs)
    q = torch.randn(num_seqs, H * D, generator=g)
    got = paged_decode_attention_ref(q, cache, tables, torch.tensor(lens, dtype=torch.int32), 1, D, D ** -0.5)
    want = torch.cat([naive(q[s:s + 1], keys[s], values[s], lens[s] - 1) for s in range(num_seqs)])
    torch.testing.assert_close(got, want, **tolerance(torch.float32, 30))


def test_mixed_chunks_match_naive():
    """Chunks of 1 (decodes), several tokens over a cached context, and a whole prompt."""
    lens, chunk = [9, 17, 1, 23, 6], [1, 5, 1, 23, 1]
    cache, tables, keys, values = random_layout(lens, seed=7)
    q = torch.randn(sum(chunk), H * D)
    starts = torch.tensor([0] + torch.tensor(chunk).cumsum(0).tolist(), dtype=torch.int32)
    got = paged_attention_ref(q, cache, tables, torch.tensor(lens, dtype=torch.int32), starts, 1, D, D ** -0.5)
    want = torch.cat([naive(q[starts[s]:starts[s + 1]], keys[s], values[s], lens[s] - chunk[s])
                      for s in range(len(lens))])
    torch.testing.assert_close(got, want, **tolerance(torch.float32, 30))


def test_padding_slots_are_not_written():
    cache = torch.zeros(1, 2, 2, KVH, BS, D)
    k = torch.ones(3, KVH * D)
    kv_write_ref(cache, k, k, torch.tensor([0, -1, 5]), layer=0)
    assert cache[0, 0, 0, :, 0].eq(1).all() and cache[0, 0, 1, :, 1].eq(1).all()
    assert cache.sum() == 2 * 2 * KVH * D


OPTIONS = [dict(window=1), dict(window=BS), dict(window=7), dict(softcap=2.0), dict(window=5, softcap=1.5)]


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_decode_window_softcap_match_naive(options):
    lens = [1, 3, 4, 9, 17, 29]
    cache, tables, keys, values = random_layout(lens, seed=3)
    q = torch.randn(len(lens), H * D, generator=torch.Generator().manual_seed(4)) * 3   # scores large enough to cap
    got = paged_decode_attention_ref(q, cache, tables, torch.tensor(lens, dtype=torch.int32), 1, D, D ** -0.5,
                                     **options)
    want = torch.cat([naive(q[s:s + 1], keys[s], values[s], lens[s] - 1, **options) for s in range(len(lens))])
    torch.testing.assert_close(got, want, **tolerance(torch.float32, 30))


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_mixed_chunks_window_softcap_match_naive(options):
    lens, chunk = [9, 17, 1, 23, 6], [1, 5, 1, 23, 1]
    cache, tables, keys, values = random_layout(lens, seed=8)
    q = torch.randn(sum(chunk), H * D) * 3
    starts = torch.tensor([0] + torch.tensor(chunk).cumsum(0).tolist(), dtype=torch.int32)
    got = paged_attention_ref(q, cache, tables, torch.tensor(lens, dtype=torch.int32), starts, 1, D, D ** -0.5,
                              **options)
    want = torch.cat([naive(q[starts[s]:starts[s + 1]], keys[s], values[s], lens[s] - chunk[s], **options)
                      for s in range(len(lens))])
    torch.testing.assert_close(got, want, **tolerance(torch.float32, 30))


@pytest.mark.parametrize("options", [{}, *OPTIONS], ids=str)
def test_cacheless_attention_matches_naive(options):
    chunk = [1, 6, 13]
    starts = torch.tensor([0, 1, 7, 20], dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(sum(chunk), w, generator=g) * 2 for w in (H * D, KVH * D, KVH * D))
    got = attention_ref(q, k, v, starts, D, D ** -0.5, **options)
    want = torch.cat([naive(q[a:b], k[a:b], v[a:b], 0, **options) for a, b in zip(starts[:-1], starts[1:])])
    torch.testing.assert_close(got, want, **tolerance(torch.float32, 13))


def test_window_is_transformers_sliding_window():
    """Our window convention is transformers' sliding-window causal mask, key for key."""
    masking = pytest.importorskip("transformers.masking_utils")
    from llmc.compiler.ops.attention import visible_keys
    for window in (1, 3, 4):
        rule = masking.sliding_window_causal_mask_function(window)
        want = rule(torch.tensor(0), torch.tensor(0), torch.arange(10)[:, None], torch.arange(10)[None, :])
        assert torch.equal(visible_keys(torch.arange(10)[:, None], 10, window), want)


@pytest.mark.parametrize("attrs, error", [({}, None), (dict(window=4096, softcap=50.0), None),
                                          (dict(window=-1), "window must be an int >= 0"),
                                          (dict(window=2.0), "window must be an int >= 0"),
                                          (dict(softcap=50), "softcap must be a float >= 0.0")])
def test_window_and_softcap_are_optional_checked_attrs(attrs, error):
    """Absent (graphs written before them) means off; present, the type rule checks them."""
    from llmc.compiler.ir import IRError, TensorType
    from llmc.compiler.ops.verify import infer_types
    types = [TensorType("f32", ("T", 96)), TensorType("f32", (2, 2, "NB", 2, "BS", 16)),
             TensorType("i32", ("S", "MB")), TensorType("i32", ("S",))]
    base = dict(layer=0, num_heads=6, num_kv_heads=2, head_dim=16, scale=0.25)
    if error is None:
        assert infer_types("paged_decode_attention", types, dict(base, **attrs)) == (types[0],)
    else:
        with pytest.raises(IRError, match=error):
            infer_types("paged_decode_attention", types, dict(base, **attrs))
