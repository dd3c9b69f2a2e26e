"""Quantized row gather: out[i, :] = dequant(table)[ids[i], :] (the `qembedding` op).

Contract: a quantized table [V, D] as kernels/quant.py stores it (int8: codes i8 [V, D] and
scales f16 [V, D/G]; int4: packed uint8 [V, D/2] in GGUF block order, scales and mins f16
[V, D/G]), all contiguous; ids [T] int32/int64 with values in [0, V) (not checked: that would
sync with the device); returns [T, D] in `dtype` (fp32, fp16 or bf16). Each element is
code * scale (+ min) in fp32, rounded to `dtype` once, as `qembedding_ref`. One program per
(output row, block of BLOCK_C columns); an int4 column c reads byte (c // 32) * 16 + c % 16 of its
row, the low nibble for c % 32 < 16, else the high one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import INT4_BLOCK, qembedding_ref

__all__ = ["qembedding_ref", "qembedding_triton"]

BLOCK_C = 1024
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _qembedding_kernel(
    codes_ptr,   # [V, D] i8, or [V, D/2] u8 packed int4 (row stride stride_c)
    scales_ptr,  # [V, D/G] f16 (row stride stride_s)
    mins_ptr,    # [V, D/G] f16; read only for BITS == 4
    ids_ptr,     # [T] row of each output row
    out_ptr,     # [T, D] the dequantized rows (row stride stride_o), written
    D, GROUP, stride_c, stride_s, stride_o,
    BITS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)                 # [BLOCK]
    mask = cols < D
    source = tl.load(ids_ptr + row).to(tl.int64)
    group = source * stride_s + cols // GROUP
    scale = tl.load(scales_ptr + group, mask=mask, other=0.0).to(tl.float32)
    if BITS == 8:
        code = tl.load(codes_ptr + source * stride_c + cols, mask=mask, other=0).to(tl.float32)
        value = code * scale
    else:
        byte = tl.load(codes_ptr + source * stride_c + (cols // 32) * 16 + cols % 16, mask=mask, other=0)
        code = tl.where(cols % 32 < 16, byte & 0xF, byte >> 4).to(tl.float32)
        value = code * scale + tl.load(mins_ptr + group, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + cols, value.to(out_ptr.dtype.element_ty), mask=mask)


def qembedding_triton(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, ids: torch.Tensor, *,
                      bits: int, group_size: int, dtype: torch.dtype, out: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Launcher: checks the contract (ValueError naming the bad value), one program per row and
    column block."""
    width = _check_inputs(codes, scales, mins, ids, bits, group_size, dtype)
    shape = (ids.shape[0], width)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=codes.device)
    elif tuple(out.shape) != shape or out.dtype != dtype or out.device != codes.device or out.stride(1) != 1:
        raise ValueError(f"out must be {list(shape)} {dtype} on {codes.device} with contiguous rows; got "
                         f"{list(out.shape)} {out.dtype} on {out.device}")
    block = min(BLOCK_C, triton.next_power_of_2(width))
    if ids.shape[0]:
        _qembedding_kernel[(ids.shape[0], triton.cdiv(width, block))](
            codes, scales, mins if mins is not None else scales, ids, out,
            width, group_size, codes.stride(0), scales.stride(0), out.stride(0), BITS=bits, BLOCK=block)
    return out


def _check_inputs(codes, scales, mins, ids, bits, group_size, dtype) -> int:
    """The row width D, after checking every input against the contract."""
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4; got {bits!r}")
    code_dtype, per_byte = (torch.int8, 1) if bits == 8 else (torch.uint8, 2)
    if codes.dim() != 2 or codes.dtype != code_dtype:
        raise ValueError(f"{bits}-bit codes must be {code_dtype} [V, D{'/2' * (bits == 4)}]; got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    width = codes.shape[1] * per_byte
    if group_size <= 0 or width % group_size or (bits == 4 and group_size % INT4_BLOCK):
        raise ValueError(f"group_size {group_size} must divide D = {width}"
                         + (" and be a multiple of 32" * (bits == 4)))
    groups = (codes.shape[0], width // group_size)
    for name, t in (("scales", scales), ("mins", mins if bits == 4 else scales)):
        if t is None or tuple(t.shape) != groups or t.dtype != torch.float16:
            raise ValueError(f"{name} must be float16 {list(groups)}; got "
                             f"{'None' if t is None else f'{t.dtype} {list(t.shape)}'}")
    if bits == 8 and mins is not None:
        raise ValueError("int8 tables have no mins (w = scale * code)")
    for name, t in (("codes", codes), ("scales", scales), ("mins", mins)):
        if t is not None and (not t.is_contiguous() or t.device != codes.device):
            raise ValueError(f"{name} must be contiguous on {codes.device}; got strides {t.stride()} on {t.device}")
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64) or ids.device != codes.device:
        raise ValueError(f"ids must be 1-D int32/int64 on {codes.device}; got {ids.dtype} {tuple(ids.shape)} on "
                         f"{ids.device}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be fp32, fp16 or bf16; got {dtype}")
    return width
