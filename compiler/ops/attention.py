"""Attention ops, their records and torch references: causal attention over packed tokens, with and without the paged KV cache.

Layouts (tokens of all sequences flattened, heads packed per token):
  q            [T, H * D]         k, v   [T, KVH * D]     (H a multiple of KVH: grouped queries)
  kv_cache     [L, 2, NB, KVH, BS, D]   (layer, key/value, block, head, offset in block, dim):
               head-major blocks, so gathering a sequence's blocks per head yields [L, D] rows;
               an int8 cache is i8 [L, 2, NB, KVH, BS, D + 4], each row D codes and its fp32
               scale (compiler/quant_format.py): written quantized, read as code * scale
  slot_mapping [T] int: block * BS + offset where token t's K/V go; negative = padding, skipped
  block_tables [S, MB] int: the blocks of each sequence, in order (padding entries unused)
  seq_lens     [S] int: tokens of each sequence in the cache after this step's writes
  query_start_loc [S + 1] int: sequence s owns query rows qsl[s] .. qsl[s+1]-1; those are its
               last tokens, so query i of a chunk of n sits at position seq_len - n + i
Scores are scaled by `scale` and softmaxed in fp32; a query at position p sees keys at positions
j <= p. Two optional attributes (absent = off, so graphs written before them still verify):
  window  int >= 0: sliding-window attention; with window > 0 a query at position p sees only
          keys at p - window < j <= p, the last `window` tokens including its own (transformers'
          sliding_window_causal_mask_function: kv_idx > q_idx - window and kv_idx <= q_idx)
  softcap float >= 0: attention-logit soft-capping; with softcap > 0 the scaled scores become
          softcap * tanh(scores / softcap) before the mask and the softmax (Gemma 2's eager
          attention)
Returns [T, H * D] in q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quant_format import KV_SCALE_BYTES, dequantize_kv_rows, is_int8_cache, quantize_kv_rows
from .checks import FLOAT_DTYPES, expect, float_, heads_width, index_tensor, same
from .record import Declined, Lowered, Operands, OpRecord, operands

ATTN_ATTRS = ("num_heads", "num_kv_heads", "head_dim", "scale")
ATTN_OPTIONS = {"window": 0, "softcap": 0.0}     # optional attrs and the value their absence means


def attention_options(attrs: dict) -> dict:
    """A node's window and softcap, defaults where absent (see the module docstring)."""
    return {name: attrs.get(name, default) for name, default in ATTN_OPTIONS.items()}


def visible_keys(q_pos: torch.Tensor, length: int, window: int) -> torch.Tensor:
    """[n, length] bool: key j is visible to the query at q_pos [n, 1] (causal, within the window)."""
    keys = torch.arange(length, device=q_pos.device)[None, :]
    allowed = keys <= q_pos
    return allowed & (keys > q_pos - window) if window > 0 else allowed


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    return x.view(x.shape[0], -1, head_dim)                                 # [T, H, D]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float, causal: bool = False) -> torch.Tensor:
    """q [n, H, D], k/v [L, KVH, D] -> [n, H, D]; mask [n, L] bool (True = attend)."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc: torch.Tensor,
                  head_dim: int, scale: float, *, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention within each packed sequence (a prompt with no earlier context); with a
    window or a softcap (module docstring) the scores are computed and masked explicitly."""
    qh, kh, vh = _heads(q, head_dim), _heads(k, head_dim), _heads(v, head_dim)
    out = torch.empty_like(qh)
    bounds = query_start_loc.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:
            continue
        if not window and not softcap:
            out[start:end] = _sdpa(qh[start:end], kh[start:end], vh[start:end], None, scale, causal=True)
            continue
        allowed = visible_keys(torch.arange(end - start, device=q.device)[:, None], end - start, window)
        k_seq, v_seq = (x[start:end].transpose(0, 1)[None] for x in (kh, vh))      # [1, KVH, n, D]
        out[start:end] = _attend(q[None, start:end], k_seq, v_seq, allowed[None], scale, softcap)[0].view(
            end - start, -1, head_dim)
    return out.view(q.shape)


def kv_write_ref(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor, layer: int) -> torch.Tensor:
    """Store each token's K and V at its slot of `layer`, in place; returns the cache."""
    kv_heads, block_size = kv_cache.shape[3:5]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    for which, x in ((0, k), (1, v)):
        rows = x.view(x.shape[0], kv_heads, x.shape[1] // kv_heads)[valid]      # [n, KVH, D]
        rows = quantize_kv_rows(rows) if is_int8_cache(kv_cache) else rows.to(kv_cache.dtype)
        kv_cache[layer, which][blocks, :, offsets] = rows
    return kv_cache


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
            scale: float, softcap: float = 0.0) -> torch.Tensor:
    """Grouped-query attention of B sequences with padded contexts.

    q [B, n, H*D], k/v [B, KVH, L, D], allowed [B, n, L] (True = may attend) -> [B, n, H*D];
    scores scaled, soft-capped where softcap > 0, then masked and softmaxed.
    The G query heads that share a KV head are stacked with the n queries as the rows of one
    matrix ([B, KVH, G*n, D]), so each KV head's K and V are multiplied once, unrepeated.
    """
    batch, n, width = q.shape
    kv_heads, head_dim = k.shape[1], k.shape[3]
    groups = width // (kv_heads * head_dim)
    rows = q.view(batch, n, kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4)  # [B, KVH, G, n, D]
    rows = rows.reshape(batch, kv_heads, groups * n, head_dim)                 # [B, KVH, G*n, D]
    acc = torch.promote_types(q.dtype, torch.float32)                           # float64 stays float64
    scores = torch.matmul(rows, k.transpose(-1, -2)).to(acc) * scale          # [B, KVH, G*n, L]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    mask = allowed[:, None, None].expand(batch, 1, groups, n, allowed.shape[-1])
    scores = scores.masked_fill(~mask.reshape(batch, 1, groups * n, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs, v)                                               # [B, KVH, G*n, D]
    out = out.view(batch, kv_heads, groups, n, head_dim).permute(0, 3, 1, 2, 4)  # [B, n, KVH, G, D]
    return out.reshape(batch, n, width)


def _gather_context(kv_cache: torch.Tensor, layer: int, tables: torch.Tensor, dtype: torch.dtype):
    """Keys and values [B, KVH, MB*BS, D] of B sequences, read through their block tables.

    One index per (sequence, head, block) into the cache viewed as [NB*KVH, BS, D] lands the
    rows of each head's context next to each other: no copy beyond the gather itself.
    """
    kv_heads, block_size, row = kv_cache.shape[3:]
    heads = torch.arange(kv_heads, device=tables.device)[None, :, None]
    index = tables.long()[:, None, :] * kv_heads + heads                      # [B, KVH, MB]
    shape = (tables.shape[0], kv_heads, tables.shape[1] * block_size, row)
    k, v = (torch.index_select(kv_cache[layer, which].flatten(0, 1), 0, index.flatten()).view(shape)
            for which in (0, 1))
    if is_int8_cache(kv_cache):
        return dequantize_kv_rows(k, dtype), dequantize_kv_rows(v, dtype)
    return k.to(dtype), v.to(dtype)


def paged_decode_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, layer: int, head_dim: int,
                               scale: float, bucket: int = 16, *, window: int = 0,
                               softcap: float = 0.0) -> torch.Tensor:
    """One query per sequence (its newest token, at position seq_len - 1) over its cached context,
    batched; window and softcap as the module docstring says.

    Sequences are sorted by length and attended in buckets of `bucket`, each padded only to its
    own longest context, so short sequences do not read as many blocks as the longest one.
    """
    options = {"window": window, "softcap": softcap}
    if q.shape[0] <= bucket:
        return _decode_bucket(q, kv_cache, block_tables, seq_lens, layer, scale, **options)
    out = torch.empty_like(q)
    block_size = kv_cache.shape[4]
    for index in torch.argsort(seq_lens).split(bucket):
        width = -(-int(seq_lens[index].max()) // block_size)
        out[index] = _decode_bucket(q[index], kv_cache, block_tables[index, :width], seq_lens[index], layer, scale,
                                    **options)
    return out


def _decode_bucket(q, kv_cache, block_tables, seq_lens, layer, scale, window, softcap):
    k, v = _gather_context(kv_cache, layer, block_tables, q.dtype)           # [S, KVH, L, D]
    allowed = visible_keys(seq_lens[:, None].long() - 1, k.shape[2], window)  # [S, L]
    return _attend(q[:, None], k, v, allowed[:, None, :], scale, softcap)[:, 0]


def paged_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, layer: int,
                        head_dim: int, scale: float, *, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Each sequence's query chunk attends causally to its whole cached context (within the
    window where window > 0; scores soft-capped where softcap > 0: module docstring).

    Sequences with one query token (decodes in a mixed step) are batched together; each
    longer chunk is attended on its own, with the causal mask offset by its cached context.
    """
    out = torch.empty_like(q)
    bounds, lens = query_start_loc.tolist(), seq_lens.tolist()
    singles = [s for s in range(len(lens)) if bounds[s + 1] - bounds[s] == 1]
    if singles:
        rows = torch.tensor([bounds[s] for s in singles], device=q.device)
        index = torch.tensor(singles, device=q.device)
        out[rows] = paged_decode_attention_ref(q[rows], kv_cache, block_tables[index], seq_lens[index],
                                               layer, head_dim, scale, window=window, softcap=softcap)
    block_size = kv_cache.shape[4]
    for s, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        n, length = end - start, lens[s]
        if n <= 1:
            continue
        table = block_tables[s:s + 1, : (length + block_size - 1) // block_size]
        k, v = _gather_context(kv_cache, layer, table, q.dtype)              # [1, KVH, L', D]
        q_pos = torch.arange(length - n, length, device=q.device)[:, None]   # [n, 1]
        allowed = visible_keys(q_pos, k.shape[2], window)                     # [n, L']
        out[start:end] = _attend(q[None, start:end], k, v, allowed[None], scale, softcap)[0]
    return out


# ------------------------------------------------------------------ type rules


def check_heads(q, k, v, attrs) -> None:
    heads_width(q, attrs["num_heads"], attrs["head_dim"], "attention query")
    heads_width(k, attrs["num_kv_heads"], attrs["head_dim"], "attention key")
    same(k, v, "attention key/value")
    expect(attrs["num_heads"] % attrs["num_kv_heads"] == 0, "num_heads must be a multiple of num_kv_heads")


def check_cache(cache, attrs) -> None:
    expect(len(cache.shape) == 6 and cache.shape[1] == 2, f"kv cache must be [L,2,NB,KVH,BS,D], got {cache}")
    expect(cache.dtype in (*FLOAT_DTYPES, "i8"), f"kv cache must be float or i8, got {cache}")
    row = attrs["head_dim"] + (KV_SCALE_BYTES if cache.dtype == "i8" else 0)
    expect(cache.shape[3] == attrs["num_kv_heads"] and cache.shape[5] == row,
           f"kv cache {cache} does not match num_kv_heads={attrs['num_kv_heads']}, head_dim={attrs['head_dim']}"
           + (f" (+{KV_SCALE_BYTES} scale bytes per i8 row)" if cache.dtype == "i8" else ""))
    layers = cache.shape[0]
    expect(not isinstance(layers, int) or 0 <= attrs["layer"] < layers,
           f"layer {attrs['layer']} is outside a kv cache of {layers} layers")


def check_options(attrs: dict) -> None:
    """window an int >= 0, softcap a float >= 0 (where present)."""
    window, softcap = attention_options(attrs).values()
    expect(isinstance(window, int) and not isinstance(window, bool) and window >= 0,
           f"attention window must be an int >= 0 (0 = off), got {window!r}")
    expect(isinstance(softcap, float) and softcap >= 0.0,
           f"attention softcap must be a float >= 0.0 (0.0 = off), got {softcap!r}")


def _attention_types(ts: Operands, attrs: dict):
    check_options(attrs)
    check_heads(ts.q, ts.k, ts.v, attrs)
    index_tensor(ts.query_start_loc, "query_start_loc")
    return (ts.q,)


def kv_write_types(ts: Operands, attrs: dict):
    check_cache(ts.kv_cache, attrs)
    heads_width(ts.k, attrs["num_kv_heads"], attrs["head_dim"], "kv_write key")
    same(ts.k, ts.v, "kv_write key/value")
    index_tensor(ts.slot_mapping, "slot_mapping")
    return (ts.kv_cache,)


def _paged_attention_types(ts: Operands, attrs: dict):
    check_options(attrs)
    check_cache(ts.kv_cache, attrs)
    float_(ts.q, "paged attention query")
    heads_width(ts.q, attrs["num_heads"], attrs["head_dim"], "paged attention query")
    index_tensor(ts.block_tables, "block_tables", rank=2)
    index_tensor(ts.seq_lens, "seq_lens")
    if "query_start_loc" in ts:
        index_tensor(ts.query_start_loc, "query_start_loc")
    return (ts.q,)


# ------------------------------------------------------------------ records
# The three attention ops also take the optional attrs ATTN_OPTIONS (window, softcap); graphs
# written before them have none, so they are read through attention_options, not required.

_NO_CACHE = ("attention without the KV cache; keep the insert_paged_attention pass")
_CPU_ATTENTION = Lowered("kernels/cpu/paged_attention.cpp (tiles for prompt chunks, split-K for decodes)")

RECORDS = [
    OpRecord("attention", (operands("q", "k", "v", "query_start_loc"),), ATTN_ATTRS, _attention_types, "attention",
             "causal attention within each sequence of packed tokens, no cache",
             reference=lambda x, a: attention_ref(x.q, x.k, x.v, x.query_start_loc, a["head_dim"], a["scale"],
                                                  **attention_options(a)),
             backends={"native": Lowered("the torch reference (SDPA; explicit scores with window/softcap)"),
                       "step_plan": Declined(_NO_CACHE), "triton": Declined(_NO_CACHE)}),
    OpRecord("kv_write", (operands("kv_cache", "k", "v", "slot_mapping"),), ("layer", "num_kv_heads", "head_dim"),
             kv_write_types, "data_movement",
             "store k, v of each token at its slot of the paged cache; returns the cache", side_effects=True,
             reference=lambda x, a: kv_write_ref(x.kv_cache, x.k, x.v, x.slot_mapping, a["layer"]),
             backends={"native": Lowered("the torch reference"),
                       "step_plan": Declined("a KV cache write outside rope_kv_write; keep the fuse_rope_kv_write pass"),
                       "triton": Declined("a KV cache write outside rope_kv_write; keep the fuse_rope_kv_write pass")}),
    OpRecord("paged_attention", (operands("q", "kv_cache", "block_tables", "seq_lens", "query_start_loc"),),
             ("layer",) + ATTN_ATTRS, _paged_attention_types, "attention",
             "causal attention of packed query chunks over the paged cache (prefill and mixed steps)",
             reference=lambda x, a: paged_attention_ref(x.q, x.kv_cache, x.block_tables, x.seq_lens,
                                                        x.query_start_loc, a["layer"], a["head_dim"], a["scale"],
                                                        **attention_options(a)),
             backends={"native": _CPU_ATTENTION, "step_plan": Lowered("instruction paged_attention"),
                       "triton": Lowered("template kernels/triton/paged_prefill_attention.py")}),
    OpRecord("paged_decode_attention", (operands("q", "kv_cache", "block_tables", "seq_lens"),),
             ("layer",) + ATTN_ATTRS, _paged_attention_types, "attention",
             "attention of one query token per sequence over the paged cache",
             reference=lambda x, a: paged_decode_attention_ref(x.q, x.kv_cache, x.block_tables, x.seq_lens,
                                                               a["layer"], a["head_dim"], a["scale"],
                                                               **attention_options(a)),
             backends={"native": _CPU_ATTENTION, "step_plan": Lowered("instruction paged_decode_attention"),
                       "triton": Lowered("template kernels/triton/paged_decode_attention.py")}),
]
