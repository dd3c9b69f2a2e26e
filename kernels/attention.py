"""Causal attention over packed tokens, with and without the paged KV cache: the native CPU
launchers; the torch references are the op records' (compiler/ops/attention.py).

The layouts (q, k, v, the paged cache and its int8 rows, slot mapping, block tables, lengths,
query starts) and the meaning are the references' docstring, compiler/ops/attention.py.
"""

from __future__ import annotations

import torch

from llmc.compiler.ops.attention import attention_ref, kv_write_ref, paged_attention_ref, paged_decode_attention_ref

from .quant import cache_head_dim

__all__ = ["attention_ref", "kv_write_ref", "native_attention_fits", "paged_attention_cpu", "paged_attention_ref",
           "paged_decode_attention_cpu", "paged_decode_attention_ref", "run_paged_decode_attention"]


def native_attention_fits(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether kernels/cpu/paged_attention.cpp takes these inputs (else use the refs above): q f32
    or bf16 on the CPU, a cache of q's dtype or int8, block size 16, head_dim a multiple of 16
    (no upper limit: 256 included). Any window and softcap (the refs' meaning) are taken."""
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and kv_cache.dtype in (q.dtype, torch.int8) and kv_cache.shape[4] == 16
            and cache_head_dim(kv_cache) > 0 and cache_head_dim(kv_cache) % 16 == 0)


def _check_native(q: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """The launchers' check: ValueError naming the inputs where the native kernel does not take them."""
    if not native_attention_fits(q, kv_cache):
        raise ValueError(f"native paged attention takes f32/bf16 q on the CPU, a cache of q's dtype or int8, "
                         f"block size 16 and head_dim a multiple of 16; got q {q.dtype}, "
                         f"cache {kv_cache.dtype} {tuple(kv_cache.shape)}")


def paged_attention_cpu(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, layer: int,
                        scale: float, *, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Launcher of the native kernel (kernels/cpu/paged_attention.cpp states its contract):
    paged_attention_ref's meaning (window and softcap too), reading K/V blocks in place (an int8
    cache's rows dequantized as they are read, blocks outside every window skipped) with an
    online softmax."""
    _check_native(q, kv_cache)
    as_int = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
    return torch.ops.llmc.paged_attention(q.contiguous(), kv_cache, as_int(block_tables), as_int(seq_lens),
                                          as_int(query_start_loc), layer, scale, window, softcap)


def paged_decode_attention_cpu(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, layer: int, scale: float, *, window: int = 0,
                               softcap: float = 0.0) -> torch.Tensor:
    """The decode case of `paged_attention_cpu`: one query per sequence (the kernel numbers them)."""
    _check_native(q, kv_cache)
    return run_paged_decode_attention(q, kv_cache, block_tables, seq_lens, layer, scale, window=window,
                                      softcap=softcap)


def run_paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, layer: int, scale: float, *, window: int = 0,
                               softcap: float = 0.0) -> torch.Tensor:
    """`paged_decode_attention_cpu` for inputs that `native_attention_fits` has passed (the op
    table checks once, then runs this)."""
    return torch.ops.llmc.paged_decode_attention(q.contiguous(), kv_cache, block_tables.to(torch.int32).contiguous(),
                                                 seq_lens.to(torch.int32).contiguous(), layer, scale, window, softcap)
