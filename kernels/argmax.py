"""Greedy picks: each row's first largest logit (kernels/cpu/argmax_rows.cpp on a CPU).

Contract: logits f32 or bf16 [R, V] (V >= 1) -> i64 [R] on the logits' device: each row's smallest
index holding its maximum, a NaN counting as larger than every number (a row with NaNs gives its
first NaN). torch.argmax(logits, dim=-1) is the meaning; on a CPU it compares one element at a
time, which for a 49152-token vocabulary took as long as several layers of a small model's decode.
"""

from __future__ import annotations

import torch


def argmax_rows_ref(logits: torch.Tensor) -> torch.Tensor:
    """The meaning, in torch."""
    return logits.argmax(dim=-1)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Launcher: the native kernel where it is loaded and the logits are on the CPU, else the ref on
    the logits' device."""
    if logits.dim() != 2 or logits.shape[1] == 0 or logits.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"argmax_rows takes f32 or bf16 logits [rows, vocab] with a vocabulary, not "
                         f"{logits.dtype} {tuple(logits.shape)}")
    if logits.device.type == "cpu" and hasattr(torch.ops.llmc, "argmax_rows"):
        return torch.ops.llmc.argmax_rows(logits.contiguous())
    return argmax_rows_ref(logits)
