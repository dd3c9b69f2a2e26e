"""Rotary embedding of Q and K fused with writing K and V into the paged KV cache.

Contract: either q [T, H*D], k and v [T, KVH*D], or one packed qkv [T, (H + 2*KVH)*D] (the
output of a merged QKV GEMM, q then k then v); positions [T] int; kv_cache and slot_mapping as
in kernels/attention.py. Rotates q and k (rotate-half layout, as kernels/rope.py), stores the
rotated k and v of every token at its slot of `layer`, in place, and returns (rotated q, cache).
"""

from __future__ import annotations

from typing import Any

import torch

from .attention import kv_write_ref
from .rope import rope_ref


def rope_kv_write_ref(*tensors: torch.Tensor, layer: int, num_heads: int, num_kv_heads: int, head_dim: int,
                      theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`tensors` is (qkv, positions, cache, slots) or (q, k, v, positions, cache, slots)."""
    if len(tensors) == 4:
        qkv, positions, kv_cache, slot_mapping = tensors
        q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)         # column views
    else:
        q, k, v, positions, kv_cache, slot_mapping = tensors
    q = rope_ref(q, positions, head_dim, theta, scaling)
    k = rope_ref(k, positions, head_dim, theta, scaling)
    return q, kv_write_ref(kv_cache, k, v, slot_mapping, layer)
