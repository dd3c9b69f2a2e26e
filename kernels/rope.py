"""Rotary position embedding (RoPE), rotate-half layout.

Contract: x [T, H * head_dim] (all heads of a token packed), positions [T] (int); returns x's
shape and dtype. Each head's first half is rotated against its second half (the Hugging Face
layout, not GPT-J's interleaved one). Frequencies come from `theta` and an optional Hugging Face
`rope_scaling` dict: `linear` (positions divided by factor) or `llama3` (long wavelengths scaled,
short kept, a smooth band between). cos/sin are computed in fp32.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

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


class RopeTables:
    """cos and sin [T, head_dim/2] (fp32) of one step's positions, made once and reused by every
    layer of that step: called again with the same, unmodified positions tensor, it returns the
    tables it already made. `key(attrs)` names the tables a rope_kv_write node's attributes need,
    so the layers sharing a rotation share one."""

    @staticmethod
    def key(attrs: dict[str, Any]) -> tuple:
        scaling = attrs["scaling"] and json.dumps(attrs["scaling"], sort_keys=True)   # a dict: keyed by its text
        return attrs["head_dim"], attrs["theta"], scaling

    @classmethod
    def for_attrs(cls, attrs: dict[str, Any]) -> "RopeTables":
        return cls(attrs["head_dim"], attrs["theta"], attrs["scaling"])

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None):
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self._key: tuple[torch.Tensor, int] | None = None
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._key is None or self._key[0] is not positions or self._key[1] != positions._version:
            freqs = positions.float()[:, None] * self.inv_freq[None, :]   # [T, D/2]
            self._tables = (freqs.cos().contiguous(), freqs.sin().contiguous())
            self._key = (positions, positions._version)
        return self._tables
