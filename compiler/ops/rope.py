"""RoPE ops, their records and torch references: rotary position embedding, rotate-half layout,
and rope_kv_write (RoPE of q and k fused with the KV cache write).

Contract: x [T, H * head_dim] (all heads of a token packed), positions [T] (int); returns x's
shape and dtype. Each head's first half is rotated against its second half (the Hugging Face
layout, not GPT-J's interleaved one). Frequencies come from `theta` and an optional Hugging Face
`rope_scaling` dict: `linear` (positions divided by factor), `llama3` (long wavelengths scaled,
short kept, a smooth band between) or `longrope` (Phi-3: each frequency divided by its own factor,
cos and sin times an attention factor; see `longrope_choice`). cos/sin are computed in fp32.
Partial rotary (Phi-4-mini's partial_rotary_factor; optional attr `rotary_dim`, absent = head_dim,
even): only each head's first rotary_dim values turn (rotate-half over them, frequencies over
rotary_dim), the rest pass through, as transformers' apply_rotary_pos_emb.

rope_kv_write may norm q and k before the rotation (attr `qk_norm`, absent or "" for none): "head"
normalizes each head over its head_dim values with weights q_norm, k_norm [head_dim] (Qwen3,
Gemma 3: head_rmsnorm), "all" each token's whole q row [H*D] and k row [KVH*D] with weights of
those widths (OLMo-2: rmsnorm); both exactly as norms.py's references, eps from attr `norm_eps`,
rounding from the optional attr `norm_rounding` (norms.py's ROUNDINGS; absent = "normed").
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .attention import check_cache, kv_write_ref, kv_write_types
from .checks import expect, float_, heads_width, index_tensor
from .norms import ROUNDINGS, head_rmsnorm_ref, rmsnorm_ref
from .record import Declined, Lowered, Operand, Operands, OpRecord, operands

ROPE_SCALING_TYPES = ("default", "linear", "llama3", "longrope")


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
    if kind == "longrope":
        return _longrope_inv_freq(head_dim, theta, scaling)
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


def longrope_choice(scaling: dict[str, Any], max_positions: int, original_max: int | None) -> dict[str, Any]:
    """The rope attrs' scaling dict of a `longrope` config: its Hugging Face dict plus `factors`,
    the one set of factors the artifact rotates with, chosen at compile time: "long" when the
    served context `max_positions` (ModelConfig.max_position_embeddings) exceeds `original_max`
    (the pretraining context; None: the dict's, else max_positions), else "short". transformers
    instead picks per forward call by the call's length, so one sequence's keys could be rotated
    with both sets depending on how it was split into calls; one set per artifact rotates every
    token of every sequence alike, whatever the batch or chunking (as llama.cpp decides per
    context size). `original_max_position_embeddings` and `factor` (max_positions / original_max,
    transformers' default when the config has none) are filled in, so `rope_attention_factor`
    needs nothing else."""
    original = original_max or scaling.get("original_max_position_embeddings") or max_positions
    if not all(isinstance(scaling.get(k), list) for k in ("short_factor", "long_factor")):
        raise ValueError(f"longrope scaling needs short_factor and long_factor lists; got keys {sorted(scaling)}")
    return {**scaling, "rope_type": "longrope", "original_max_position_embeddings": original,
            "factor": scaling.get("factor") or max_positions / original,
            "factors": "long" if max_positions > original else "short"}


def _longrope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """1 / (factor_i * theta^(2i/d)) with the set `longrope_choice` chose, as transformers computes it."""
    if scaling.get("factors") not in ("long", "short"):
        raise ValueError(f"longrope scaling needs 'factors': 'long' or 'short' (longrope_choice picks it at "
                         f"compile time); got {scaling.get('factors')!r}")
    factors = scaling[f"{scaling['factors']}_factor"]
    if len(factors) != head_dim // 2:
        raise ValueError(f"longrope {scaling['factors']}_factor has {len(factors)} values; the rotary dim "
                         f"{head_dim} needs {head_dim // 2}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** exponents)


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: 1.0 but for longrope, whose `attention_factor` when the
    config gives one, else transformers' rule sqrt(1 + ln(factor) / ln(original_max)) for a
    factor above 1 (the config's, else max_positions / original_max: longrope_choice fills it
    in), else 1.0. transformers applies it with either set of factors."""
    if (scaling or {}).get("rope_type", (scaling or {}).get("type")) != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, original = scaling.get("factor") or 1.0, scaling["original_max_position_embeddings"]
    return math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0


def rope_ref(x: torch.Tensor, positions: torch.Tensor, head_dim: int, theta: float,
             scaling: dict[str, Any] | None, rotary_dim: int | None = None) -> torch.Tensor:
    if rotary_dim is not None and rotary_dim != head_dim:
        heads = x.view(x.shape[0], -1, head_dim)                      # [T, H, D]
        turned = rope_ref(heads[..., :rotary_dim].reshape(x.shape[0], -1), positions, rotary_dim, theta, scaling)
        return torch.cat((turned.view(x.shape[0], -1, rotary_dim), heads[..., rotary_dim:]), -1).reshape(x.shape)
    acc = torch.promote_types(x.dtype, torch.float32)                 # float64 stays float64
    inv_freq = rope_inv_freq(head_dim, theta, scaling).to(x.device, acc)
    freqs = positions.to(acc)[:, None] * inv_freq[None, :]            # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)                           # [T, D]
    scale = rope_attention_factor(scaling)                            # cos, sin times it (longrope)
    cos, sin = (emb.cos() * scale).to(x.dtype)[:, None, :], (emb.sin() * scale).to(x.dtype)[:, None, :]
    heads = x.view(x.shape[0], -1, head_dim)                          # [T, H, D]
    half = head_dim // 2
    rotated = torch.cat((-heads[..., half:], heads[..., :half]), dim=-1)
    return (heads * cos + rotated * sin).reshape(x.shape)


QK_NORMS = ("", "head", "all")


def qk_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, kind: str, eps: float, head_dim: int,
                rounding: str = "normed") -> torch.Tensor:
    """x normed as rope_kv_write's `qk_norm` says: "" not at all, "head" per head, "all" per row;
    rounded as `rounding` says (norms.py)."""
    if kind == "head":
        return head_rmsnorm_ref(x, weight, eps, head_dim, rounding)
    return rmsnorm_ref(x, weight, eps, rounding) if kind == "all" else x


def rope_kv_write_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *, layer: int, head_dim: int, theta: float,
                      scaling: dict[str, Any] | None, q_norm: torch.Tensor | None = None,
                      k_norm: torch.Tensor | None = None, qk_norm: str = "", norm_eps: float = 0.0,
                      rotary_dim: int | None = None, norm_rounding: str = "normed") -> tuple[torch.Tensor, torch.Tensor]:
    """(rope(q), the cache with rope(k) and v stored at the tokens' slots of `layer`); with
    `qk_norm`, q and k are normed (weights q_norm, k_norm; rounding `norm_rounding`) before their
    rotation; with `rotary_dim`, only each head's first rotary_dim values turn."""
    q = qk_norm_ref(q, q_norm, qk_norm, norm_eps, head_dim, norm_rounding)
    k = qk_norm_ref(k, k_norm, qk_norm, norm_eps, head_dim, norm_rounding)
    q = rope_ref(q, positions, head_dim, theta, scaling, rotary_dim)
    k = rope_ref(k, positions, head_dim, theta, scaling, rotary_dim)
    return q, kv_write_ref(kv_cache, k, v, slot_mapping, layer)


def qkv_columns(x: Operands, attrs: dict) -> tuple:
    """q, k, v of a rope_kv_write: its operands, or column views of its packed qkv."""
    if "qkv" not in x:
        return x.q, x.k, x.v
    q_width, kv_width = attrs["num_heads"] * attrs["head_dim"], attrs["num_kv_heads"] * attrs["head_dim"]
    return tuple(x.qkv.split([q_width, kv_width, kv_width], dim=-1))


def rotary_dim(attrs: dict) -> int:
    """The values of each head that turn: attr rotary_dim, or all head_dim of them."""
    return attrs.get("rotary_dim", attrs["head_dim"])


def _check_rotary_dim(attrs: dict) -> None:
    r, d = rotary_dim(attrs), attrs["head_dim"]
    expect(isinstance(r, int) and 0 < r <= d and r % 2 == 0, f"rotary_dim={r} is not even and within head_dim={d}")


def _rope_types(ts: Operands, attrs: dict):
    _check_rotary_dim(attrs)
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
    _qk_norm_types(ts, attrs, q)
    _check_rotary_dim(attrs)
    return (q, ts.kv_cache)


def norm_rounding(attrs: dict) -> str:
    """A rope_kv_write's q/k norm rounding: attr norm_rounding, "normed" where absent."""
    return attrs.get("norm_rounding", "normed")


def has_qk_norm(attrs: dict) -> bool:
    """Whether a rope_kv_write norms q and k (then it takes operands q_norm and k_norm)."""
    return attrs.get("qk_norm", "") != ""


def _qk_norm_types(ts: Operands, attrs: dict, q) -> None:
    kind = attrs.get("qk_norm", "")
    expect(kind in QK_NORMS, f"rope_kv_write qk_norm={kind!r} is not one of {QK_NORMS}")
    if not kind:
        return
    expect(isinstance(attrs.get("norm_eps"), float), "rope_kv_write with qk_norm needs a float attr norm_eps")
    expect(norm_rounding(attrs) in ROUNDINGS,
           f"rope_kv_write norm_rounding={norm_rounding(attrs)!r} is not one of {ROUNDINGS}")
    heads, kv_heads, d = attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"]
    for name, width in (("q_norm", heads * d), ("k_norm", kv_heads * d)):
        want = (d,) if kind == "head" else (width,)
        w = ts[name]
        expect(w.shape == want and w.dtype == q.dtype,
               f"rope_kv_write {name} {w} is not {q.dtype}{list(want)} (qk_norm={kind!r})")


def _rope_kv_write(x: Operands, a: dict):
    q, k, v = qkv_columns(x, a)
    return rope_kv_write_ref(q, k, v, x.positions, x.kv_cache, x.slot_mapping, layer=a["layer"],
                             head_dim=a["head_dim"], theta=a["theta"], scaling=a["scaling"],
                             q_norm=x.get("q_norm"), k_norm=x.get("k_norm"), qk_norm=a.get("qk_norm", ""),
                             norm_eps=a.get("norm_eps", 0.0), rotary_dim=a.get("rotary_dim"),
                             norm_rounding=norm_rounding(a))


# present when attr qk_norm is "head" or "all" (optional attrs qk_norm and norm_eps: old graphs have none)
_NORMS = (Operand("q_norm", when=has_qk_norm), Operand("k_norm", when=has_qk_norm))
_UNFUSED = "RoPE outside rope_kv_write; keep the fuse_rope_kv_write pass"

RECORDS = [
    OpRecord("rope", (operands("x", "positions"),), ("head_dim", "theta", "scaling"), _rope_types, "rowwise",
             "rotary embedding (rotate-half layout) of every head of x at positions",
             reference=lambda x, a: rope_ref(x.x, x.positions, a["head_dim"], a["theta"], a["scaling"],
                                             a.get("rotary_dim")),
             backends={"native": Lowered("the torch reference"), "step_plan": Declined(_UNFUSED),
                       "triton": Declined(_UNFUSED)}),
    OpRecord("rope_kv_write", ((*operands("qkv", "positions", "kv_cache", "slot_mapping"), *_NORMS),
                               (*operands("q", "k", "v", "positions", "kv_cache", "slot_mapping"), *_NORMS)),
             ("layer", "num_heads", "num_kv_heads", "head_dim", "theta", "scaling"), _rope_kv_write_types,
             "data_movement", "(norm q and k,) rope q and k, store k and v at their slots; returns (roped q, cache)",
             side_effects=True, reference=_rope_kv_write,
             backends={"native": Lowered("kernels/cpu/rope_kv_write.cpp"),
                       "step_plan": Lowered("instruction rope_kv_write (a packed qkv)"),
                       "triton": Lowered("template kernels/triton/rope_kv_write.py")}),
]
