"""Grammar masks on logits (structured output): every token a row's bitmask does not allow gets
-inf, in place, before sampling (kernels/cpu/token_bitmask.cpp on a CPU).

Contract: logits f32 [R, V] (contiguous), bitmask i32 [N, W] with W >= ceil(V / 32) (bit t % 32
of word t // 32 set: token t allowed), rows i64 [N] (bitmask row i masks logits row rows[i]; in
[0, R), distinct) -> logits, changed in place where a bit is clear. Bits past V are ignored.
"""

from __future__ import annotations

import torch



def token_bitmask_bools(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [N, vocab]: True where the bitmask allows the token."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The meaning, in torch: the masked rows set to -inf where their bit is clear."""
    allowed = token_bitmask_bools(bitmask, logits.shape[1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Launcher: the native kernel where it is loaded and the logits are on the CPU, else the ref on
    the logits' device (a GPU's: the bitmask, vocab / 32 words a row, is copied there; the logits
    never leave it)."""
    if logits.dtype != torch.float32 or logits.dim() != 2:
        raise ValueError(f"grammar masks apply to f32 logits [rows, vocab], not {logits.dtype} {tuple(logits.shape)}")
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"a bitmask [rows, words] of int32 covering {logits.shape[1]} tokens is needed, "
                         f"not {bitmask.dtype} {tuple(bitmask.shape)}")
    if rows.numel() != bitmask.shape[0]:
        raise ValueError(f"{rows.numel()} row indices for {bitmask.shape[0]} bitmask rows")
    if logits.device.type == "cpu" and logits.is_contiguous() and hasattr(torch.ops.llmc, "apply_token_bitmask"):
        return torch.ops.llmc.apply_token_bitmask(logits, bitmask.contiguous(), rows.to(torch.int64))
    return apply_token_bitmask_ref(logits, bitmask.to(logits.device, non_blocking=True),
                                   rows.to(logits.device, non_blocking=True))
