"""Rotary embedding of Q and K fused with writing K and V into the paged KV cache.

Contract: either q [T, H*D], k and v [T, KVH*D], or one packed qkv [T, (H + 2*KVH)*D] (the
output of a merged QKV GEMM, q then k then v); positions [T] int; kv_cache and slot_mapping as
in kernels/attention.py. Rotates q and k (rotate-half layout, as kernels/rope.py), stores the
rotated k and v of every token at its slot of `layer`, in place, and returns (rotated q, cache).
With `qk_norm` ("head" or "all", compiler/ops/rope.py) q and k are first normed with the weights
q_norm and k_norm (after the slots in `tensors`), eps `norm_eps` and rounding `norm_rounding`
("normed" or "product", compiler/ops/norms.py).
"""

from __future__ import annotations

from typing import Any

import torch

from llmc.compiler.ops import OPS, bind
from llmc.compiler.ops.rope import qkv_columns
from llmc.compiler.ops.rope import rope_kv_write_ref as _ref

from .quant import cache_head_dim
from .rope import RopeTables


def unpack_inputs(tensors: tuple[torch.Tensor, ...], num_heads: int, num_kv_heads: int, head_dim: int,
                  qk_norm: str = "") -> tuple[torch.Tensor, ...]:
    """(qkv, positions, cache, slots) or (q, k, v, positions, cache, slots) -> the second form,
    q/k/v as column views of a packed qkv (named by the op's record, split by its qkv_columns);
    with `qk_norm` both forms end with q_norm, k_norm, and so does the result."""
    attrs = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim, "qk_norm": qk_norm}
    x = bind(OPS["rope_kv_write"], list(tensors), attrs)
    norms = (x.q_norm, x.k_norm) if qk_norm else ()
    return (*qkv_columns(x, attrs), x.positions, x.kv_cache, x.slot_mapping, *norms)


def rope_kv_write_ref(*tensors: torch.Tensor, layer: int, num_heads: int, num_kv_heads: int, head_dim: int,
                      theta: float, scaling: dict[str, Any] | None, qk_norm: str = "", norm_eps: float = 0.0,
                      rotary_dim: int | None = None, norm_rounding: str = "normed") -> tuple[torch.Tensor, torch.Tensor]:
    """The op record's reference (compiler/ops/rope.py) in the launchers' signature: `tensors` is
    (qkv, positions, cache, slots) or (q, k, v, positions, cache, slots), then q_norm, k_norm
    where `qk_norm` says."""
    q, k, v, positions, kv_cache, slot_mapping, *norms = unpack_inputs(tensors, num_heads, num_kv_heads, head_dim,
                                                                       qk_norm)
    q_norm, k_norm = norms or (None, None)
    return _ref(q, k, v, positions, kv_cache, slot_mapping, layer=layer, head_dim=head_dim, theta=theta,
                scaling=scaling, q_norm=q_norm, k_norm=k_norm, qk_norm=qk_norm, norm_eps=norm_eps,
                rotary_dim=rotary_dim, norm_rounding=norm_rounding)


def native_rope_kv_write_fits(kv_cache: torch.Tensor, dtype: torch.dtype, head_dim: int,
                              rotary_dim: int | None = None) -> bool:
    """Whether kernels/cpu/rope_kv_write.cpp takes this cache with q, k, v of `dtype` and heads of
    `head_dim` (else use rope_kv_write_ref): f32 or bf16 inputs, a cache of their dtype or int8
    whose rows hold head_dim, a multiple of 32 (a partial rotary's rotary dim: any even one)."""
    return (kv_cache.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and kv_cache.dtype in (dtype, torch.int8) and head_dim % 32 == 0 and cache_head_dim(kv_cache) == head_dim
            and (rotary_dim or head_dim) % 2 == 0)


def rope_kv_write_cpu(*tensors: torch.Tensor, layer: int, num_heads: int, num_kv_heads: int, head_dim: int,
                      tables: RopeTables, qk_norm: str = "", norm_eps: float = 0.0,
                      norm_rounding: str = "normed") -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher of the native kernel (kernels/cpu/rope_kv_write.cpp): rope_kv_write_ref's meaning,
    the rotation in fp32; `tables` gives the cos/sin of the step's positions. An int8 cache's k is
    quantized from the fp32 rotation, where the ref rounds it to q's dtype first: for bf16 inputs
    a code can differ from the ref's by 1 where that rounding crosses a rounding boundary."""
    q, k, v, positions, kv_cache, slot_mapping, *norms = unpack_inputs(tensors, num_heads, num_kv_heads, head_dim,
                                                                       qk_norm)
    if not native_rope_kv_write_fits(kv_cache, q.dtype, head_dim, 2 * tables.inv_freq.numel()):
        raise ValueError(f"native rope_kv_write takes f32/bf16 q with a cache of its dtype or int8, head_dim a "
                         f"multiple of 32 (an even rotary dim); got q {q.dtype}, cache {kv_cache.dtype} "
                         f"{tuple(kv_cache.shape)}, rotary dim {2 * tables.inv_freq.numel()}")
    return run_rope_kv_write(q, k, v, positions, kv_cache, slot_mapping, layer, tables, *norms, qk_norm=qk_norm,
                             norm_eps=norm_eps, norm_rounding=norm_rounding)


NORM_SPANS = {"": 0, "head": 1, "all": 2}      # qk_norm -> the kernel's norm_span


def run_rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      kv_cache: torch.Tensor, slot_mapping: torch.Tensor, layer: int, tables: RopeTables,
                      q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, *, qk_norm: str = "",
                      norm_eps: float = 0.0, norm_rounding: str = "normed") -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_kv_write_cpu` for unpacked inputs that `native_rope_kv_write_fits` has passed (the op
    table checks once, then runs this)."""
    cos, sin = tables(positions)
    q_rot = torch.ops.llmc.rope_kv_write(q, k, v, cos, sin, kv_cache, slot_mapping.long().contiguous(), layer,
                                         q_norm, k_norm, NORM_SPANS[qk_norm], norm_eps, norm_rounding == "product")
    return q_rot, kv_cache
