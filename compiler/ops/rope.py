"""RoPE ops, their records and torch references: rotary position embedding, rotate-half layout,
and rope_kv_write (RoPE of q and k fused with the KV cache write).

Contract: x [T, H * head_dim] (all heads of a token packed), positions [T] (int); returns x's
shape and dtype. Each head's first half is rotated against its second half (the Hugging Face
layout, not GPT-J's interleaved one). Frequencies come from `theta` and an optional Hugging Face
`rope_scaling` dict: `linear` (positions divided by factor) or `llama3` (long wavelengths scaled,
short kept, a smooth band between). cos/sin are computed in fp32.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .attention import check_cache, kv_write_ref, kv_write_types
from .checks import expect, float_, heads_width, index_tensor
from .record import Declined, Lowered, Operands, OpRecord, operands

ROPE_SCALING_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], fp32, with the scaling rule applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope scaling {kind!r} is not supported; supported: {ROPE_SCALING_TYPES}")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_context = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_ref(x: torch.Tensor, positions: torch.Tensor, head_dim: int, theta: float,
             scaling: dict[str, Any] | None) -> torch.Tensor:
    acc = torch.promote_types(x.dtype, torch.float32)                 # float64 stays float64
    inv_freq = rope_inv_freq(head_dim, theta, scaling).to(x.device, acc)
    freqs = positions.to(acc)[:, None] * inv_freq[None, :]            # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)                           # [T, D]
    cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
    heads = x.view(x.shape[0], -1, head_dim)                          # [T, H, D]
    half = head_dim // 2
    rotated = torch.cat((-heads[..., half:], heads[..., :half]), dim=-1)
    return (heads * cos + rotated * sin).reshape(x.shape)


def rope_kv_write_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *, layer: int, head_dim: int, theta: float,
                      scaling: dict[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rope(q), the cache with rope(k) and v stored at the tokens' slots of `layer`)."""
    q = rope_ref(q, positions, head_dim, theta, scaling)
    k = rope_ref(k, positions, head_dim, theta, scaling)
    return q, kv_write_ref(kv_cache, k, v, slot_mapping, layer)


def qkv_columns(x: Operands, attrs: dict) -> tuple:
    """q, k, v of a rope_kv_write: its operands, or column views of its packed qkv."""
    if "qkv" not in x:
        return x.q, x.k, x.v
    q_width, kv_width = attrs["num_heads"] * attrs["head_dim"], attrs["num_kv_heads"] * attrs["head_dim"]
    return tuple(x.qkv.split([q_width, kv_width, kv_width], dim=-1))


def _rope_types(ts: Operands, attrs: dict):
    x, pos = ts.x, ts.positions
    float_(x, "rope input")
    index_tensor(pos, "rope positions")
    expect(isinstance(x.shape[1], int) and x.shape[1] % attrs["head_dim"] == 0,
           f"rope input width {x.shape[1]} is not a multiple of head_dim={attrs['head_dim']}")
    expect(x.shape[0] == pos.shape[0], f"rope positions {pos} do not match tokens of {x}")
    return (x,)


def _rope_kv_write_types(ts: Operands, attrs: dict):
    heads, kv_heads, head_dim = attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"]
    if "qkv" in ts:
        heads_width(ts.qkv, heads + 2 * kv_heads, head_dim, "rope_kv_write packed qkv")
        q = ts.qkv.with_shape(ts.qkv.shape[0], heads * head_dim)
    else:
        q = ts.q
        heads_width(q, heads, head_dim, "rope_kv_write query")
        kv_write_types(Operands(kv_cache=ts.kv_cache, k=ts.k, v=ts.v, slot_mapping=ts.slot_mapping), attrs)
    float_(q, "rope_kv_write query")
    index_tensor(ts.positions, "rope_kv_write positions")
    index_tensor(ts.slot_mapping, "slot_mapping")
    expect(ts.positions.shape[0] == q.shape[0], f"rope positions {ts.positions} do not match tokens of {q}")
    check_cache(ts.kv_cache, attrs)
    return (q, ts.kv_cache)


def _rope_kv_write(x: Operands, a: dict):
    q, k, v = qkv_columns(x, a)
    return rope_kv_write_ref(q, k, v, x.positions, x.kv_cache, x.slot_mapping, layer=a["layer"],
                             head_dim=a["head_dim"], theta=a["theta"], scaling=a["scaling"])


_UNFUSED = "RoPE outside rope_kv_write; keep the fuse_rope_kv_write pass"

RECORDS = [
    OpRecord("rope", (operands("x", "positions"),), ("head_dim", "theta", "scaling"), _rope_types, "rowwise",
             "rotary embedding (rotate-half layout) of every head of x at positions",
             reference=lambda x, a: rope_ref(x.x, x.positions, a["head_dim"], a["theta"], a["scaling"]),
             backends={"native": Lowered("the torch reference"), "step_plan": Declined(_UNFUSED),
                       "triton": Declined(_UNFUSED)}),
    OpRecord("rope_kv_write", (operands("qkv", "positions", "kv_cache", "slot_mapping"),
                               operands("q", "k", "v", "positions", "kv_cache", "slot_mapping")),
             ("layer", "num_heads", "num_kv_heads", "head_dim", "theta", "scaling"), _rope_kv_write_types,
             "data_movement", "rope q and k, store k and v at their slots; returns (roped q, cache)",
             side_effects=True, reference=_rope_kv_write,
             backends={"native": Lowered("kernels/cpu/rope_kv_write.cpp"),
                       "step_plan": Lowered("instruction rope_kv_write (a packed qkv)"),
                       "triton": Lowered("template kernels/triton/rope_kv_write.py")}),
]
