"""Which kernel runs the native CPU kernels' bf16 GEMMs here: AMX tiles or the AVX-512 panel kernel.

kernels/cpu/amx_gemm.h has the AMX kernel and its contract (panel_gemm's for bf16: the meaning is
kernels/panels.py's panel_linear_ref) and makes the choice at run time: AMX where the CPU has
AMX-BF16 and the Linux kernel grants the tile state (asked once per process, as oneDNN does; a
program that does not ask dies with SIGILL on its first tile instruction), for GEMMs of
`AMX_MIN_TOKENS` or more tokens (prefill, batched decode; batch-1 decode reads its weights once
and stays on the AVX-512 kernel, whose prefetch streams them), in the op (`panel_gemm`) and the step
plan alike, on the one resident copy of the weight (the bf16 panels are AMX's B tiles already). f32
GEMMs never take AMX: their products stay fp32.

The same choice (the same support, override and hook) puts a bf16 model's prompt attention (chunks
of 2 or more queries over a bf16 KV cache) on AMX tiles, kernels/cpu/amx_attention.h, where head_dim
is a multiple of `AMX_ATTENTION_DEPTH` (head_dim 32 and 64 with each row block's outputs held in tiles,
amx_attention_resident.h); else it runs on the AVX-512 (vdpbf16ps) tiles of attention_items.h. `attention_path` says which, and why.

Quantized GEMMs with int8 activations over quads (kernels/cpu/qdot_gemm.cpp) take AMX-INT8 tiles
(kernels/cpu/amx_qgemm.h; the CPU's AMX-INT8 and the same tile state) from `AMX_INT8_MIN_TOKENS`
tokens, the AVX512-VNNI kernel below that and wherever AMX-INT8 is not usable, with the same numbers
on both paths; `cpu_qgemm_path` says which, and why. With bf16 prompts (`activations="bf16"`) those
of 32 or more tokens take AMX-BF16 instead, x and the weight dequantized to bf16 (kernels/cpu/
amx_dequant_gemm.h; the same support and override as the bf16 GEMMs).

Environment:
  LLMC_CPU_AMX=off          bf16 GEMMs on the AVX-512 panel kernel even where AMX is usable (read
                            at each GEMM, so a test can compare both paths in one process)
  LLMC_AMX_TEST_REFUSE=1    test hook: the process asks the kernel for a tile feature that does not
                            exist, so the request fails as a refusal would (read once, at the first
                            GEMM or `cpu_gemm_path`)
"""

from __future__ import annotations

import logging

import torch

AMX_OVERRIDE = "LLMC_CPU_AMX"
AMX_REFUSE_HOOK = "LLMC_AMX_TEST_REFUSE"
AMX_MIN_TOKENS = 4               # llmc_amx::kMinTokens
AMX_INT8_MIN_TOKENS = 32         # llmc_amx_int8::kMinTokens
AMX_ATTENTION_DEPTH = 32         # llmc_cpu::kAmxDepth: AMX prompt attention needs head_dim a multiple of it


def cpu_gemm_path() -> tuple[str, str]:
    """(path, why): ("amx-bf16", "") or the fallback ("avx512-bf16", the reason AMX is not taken).
    Needs the native kernels loaded."""
    path, why = torch.ops.llmc.cpu_gemm_path()
    return path, why


def describe_gemm_path() -> str:
    """'bf16 GEMMs amx-bf16', or 'bf16 GEMMs avx512-bf16 (why)', for a report's kernel line."""
    path, why = cpu_gemm_path()
    return f"bf16 GEMMs {path}" + (f" ({why})" if why else "")


def attention_path(head_dim: int, cache_dtype: torch.dtype = torch.bfloat16) -> tuple[str, str]:
    """(path, why) of bf16 prompt attention over a cache of `cache_dtype` with this head_dim:
    ("amx-bf16", "") or the fallback and why (the CPU's reason, the cache or the head_dim)."""
    path, why = cpu_gemm_path()
    if path != "amx-bf16":
        return path, why
    if cache_dtype != torch.bfloat16:
        return "avx512-bf16", f"the KV cache is {str(cache_dtype).removeprefix('torch.')}"
    if head_dim % AMX_ATTENTION_DEPTH:
        return "avx512-bf16", f"head_dim {head_dim} is not a multiple of {AMX_ATTENTION_DEPTH}"
    return path, ""


def describe_attention_path(head_dim: int, cache_dtype: torch.dtype = torch.bfloat16) -> str:
    """'prompt attention amx-bf16', or 'prompt attention avx512-bf16 (why)', for a report's kernel line."""
    path, why = attention_path(head_dim, cache_dtype)
    return f"prompt attention {path}" + (f" ({why})" if why else "")


def cpu_qgemm_path() -> tuple[str, str]:
    """(path, why) of int8-activation GEMMs of AMX_INT8_MIN_TOKENS or more tokens: ("amx-int8", "")
    or the fallback ("avx512-vnni", "avx2", or "portable" without either) and the reason AMX is not taken.
    Needs the native kernels loaded."""
    path, why = torch.ops.llmc.cpu_qgemm_path()
    return path, why


def describe_qgemm_path() -> str:
    """'amx-int8 from 32 tokens, avx512-vnni below', or 'avx512-vnni; no AMX-INT8: why', for the
    kernel line of a quantized artifact with int8 activations."""
    path, why = cpu_qgemm_path()
    if why:
        return f"{path}; no AMX-INT8: {why}"
    return f"{path} from {AMX_INT8_MIN_TOKENS} tokens, {torch.ops.llmc.qdot_isa()} below"


def announce_gemm_path(log: logging.Logger) -> None:
    """One INFO line where bf16 GEMMs do not run on AMX, and one for prompt attention, saying why
    (the native kernels' loader calls this once per process)."""
    path, why = cpu_gemm_path()
    if why:
        log.info("%s: bf16 GEMMs run on %s", why, path)
        log.info("%s: bf16 prompt attention runs on %s tiles", why, path)


def announce_qgemm_path(log: logging.Logger) -> None:
    """One INFO line where int8-activation GEMMs do not run on AMX-INT8, saying why (the native
    kernels' loader calls this once per process)."""
    path, why = cpu_qgemm_path()
    if why:
        log.info("%s: int8-activation GEMMs run on %s", why, path)
