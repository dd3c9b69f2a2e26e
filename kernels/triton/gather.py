"""Row gather: out[i, :] = table[index[i], :] (the `embedding` and `index_select` ops).

Contract: table [N, C] (any float dtype, rows contiguous), index [M] int32/int64 with values in
[0, N); returns [M, C] in table's dtype. One program per (output row, block of columns).
Reference: `gather_rows_ref` (torch.index_select).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_C = 1024


def gather_rows_ref(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.index_select(table, 0, index.long())


@triton.jit
def _gather_rows_kernel(
    table_ptr,   # [N, C] rows to pick from
    index_ptr,   # [M] row number of each output row
    out_ptr,     # [M, C] picked rows (written)
    table_stride, out_stride, C,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    source = tl.load(index_ptr + row).to(tl.int64)
    values = tl.load(table_ptr + source * table_stride + cols, mask=cols < C)
    tl.store(out_ptr + row.to(tl.int64) * out_stride + cols, values, mask=cols < C)


def gather_rows_triton(table: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launcher: checks the contract (not the index values: that would sync with the device)."""
    if table.dim() != 2 or table.stride(1) != 1:
        raise ValueError(f"gather_rows takes a 2-D table with contiguous rows, got shape {tuple(table.shape)}")
    if index.dim() != 1 or index.dtype not in (torch.int32, torch.int64) or index.device != table.device:
        raise ValueError(f"gather_rows takes a 1-D int32/int64 index on {table.device}, got {index.dtype} "
                         f"{tuple(index.shape)} on {index.device}")
    rows, width = index.shape[0], table.shape[1]
    out = torch.empty((rows, width), dtype=table.dtype, device=table.device) if out is None else out
    if out.shape != (rows, width) or out.dtype != table.dtype or out.stride(1) != 1:
        raise ValueError(f"gather_rows out must be [{rows}, {width}] {table.dtype}, got {out.dtype} {tuple(out.shape)}")
    block = min(BLOCK_C, triton.next_power_of_2(width))
    if rows:
        _gather_rows_kernel[(rows, triton.cdiv(width, block))](table, index, out, table.stride(0), out.stride(0),
                                                              width, BLOCK=block)
    return out
