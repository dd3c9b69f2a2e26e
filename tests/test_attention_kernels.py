"""Paged attention references against a naive per-sequence computation in float64."""

from __future__ import annotations

import pytest
import torch

from llmc.kernels.attention import kv_write_ref, paged_attention_ref, paged_decode_attention_ref
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


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int) -> torch.Tensor:
    """q [n, H*D] at positions first_pos.., k/v [L, KVH*D]; causal; float64; GQA by repetition."""
    qh = q.double().view(-1, H, D).transpose(0, 1)                                    # [H, n, D]
    kh = k.double().view(-1, KVH, D).repeat_interleave(GROUPS, dim=1).transpose(0, 1)  # [H, L, D]
    vh = v.double().view(-1, KVH, D).repeat_interleave(GROUPS, dim=1).transpose(0, 1)
    scores = qh @ kh.transpose(1, 2) * D ** -0.5
    pos = torch.arange(first_pos, first_pos + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > pos, float("-inf"))
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
