"""Rotary position embedding (RoPE), rotate-half layout.

Contract: x [T, H * head_dim] (all heads of a token packed), positions [T] (int); returns x's
shape and dtype. Each head's first half is rotated against its second half (the Hugging Face
layout, not GPT-J's interleaved one). Frequencies come from `theta` and an optional Hugging Face
`rope_scaling` dict: `linear` (positions divided by factor), `llama3` (long wavelengths scaled,
short kept, a smooth band between) or `longrope` (per-frequency factors, cos and sin times
`rope_attention_factor`). cos/sin are computed in fp32.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from llmc.compiler.ops.rope import ROPE_SCALING_TYPES, rope_attention_factor, rope_inv_freq, rope_ref

__all__ = ["ROPE_SCALING_TYPES", "RopeTables", "rope_attention_factor", "rope_inv_freq", "rope_ref"]


class RopeTables:
    """cos and sin [T, head_dim/2] (fp32, times the rotation's attention factor: longrope's, else
    1) of one step's positions, gathered from tables of every position up to the largest seen yet
    (grown by doubling, as vLLM's cos/sin cache is made once), so a step costs two row gathers, not
    a rotation's arithmetic; the same positions tensor, unmodified, gets the tables it already
    has. A step plan takes the whole tables (`covering`) and reads each token's rows itself.
    `key(attrs)` names the tables a rope_kv_write node's attributes need, so the layers sharing a
    rotation share one."""

    @staticmethod
    def key(attrs: dict[str, Any]) -> tuple:
        scaling = attrs["scaling"] and json.dumps(attrs["scaling"], sort_keys=True)   # a dict: keyed by its text
        return attrs.get("rotary_dim", attrs["head_dim"]), attrs["theta"], scaling

    @classmethod
    def for_attrs(cls, attrs: dict[str, Any]) -> "RopeTables":
        """The tables of a rope_kv_write: [T, rotary_dim/2] (rotary_dim: head_dim unless partial)."""
        return cls(attrs.get("rotary_dim", attrs["head_dim"]), attrs["theta"], attrs["scaling"])

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None):
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self.attention_factor = rope_attention_factor(scaling)
        self._all: tuple[torch.Tensor, torch.Tensor] = self._tables_to(256)   # cos, sin of positions 0..255
        self._key: tuple[torch.Tensor, int] | None = None
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def _tables_to(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [end, head_dim/2] of positions 0..end-1 (fp32, times the attention factor)."""
        freqs = torch.arange(end, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._key is None or self._key[0] is not positions or self._key[1] != positions._version:
            try:
                self._tables = self._gather(positions)
            except IndexError:              # a position past the tables: grow them (rarely: by doubling)
                self._all = self._tables_to(max(2 * self._all[0].shape[0], int(positions.max()) + 1))
                self._tables = self._gather(positions)
            self._key = (positions, positions._version)
        return self._tables

    def covering(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [P, head_dim/2] of positions 0..P-1 with P >= `end` (the tables grown by doubling
        when they hold fewer): for a step plan, whose rope_kv_write reads each token's row itself."""
        if self._all[0].shape[0] < end:
            self._all = self._tables_to(max(2 * self._all[0].shape[0], end))
        return self._all

    def _gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._all
        return cos.index_select(0, positions), sin.index_select(0, positions)
