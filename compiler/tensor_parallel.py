"""The shard plan of a tensor-parallel artifact: how each rank's weights are cut from the one full
copy that weights.safetensors holds.

`llmc compile --tp N` (passes/shard.py) writes the plan into the manifest as
`manifest["tensor_parallel"] = {"size": N, "weights": {name: rule}}`, one rule per weight the
sharded graphs declare:
- `{"rule": "replicate"}`: every rank holds the whole tensor;
- `{"rule": "split", "dim": d}`: rank r holds the r-th of N equal parts along dim d;
- `{"rule": "segments", "dim": d, "sizes": [...], "units": [...]}`: the tensor is segments of
  `sizes` along d (a merged QKV: q | k | v rows; gate_up: gate | up rows), segment i made of
  `units[i]` equal units (heads, rows); with N dividing units[i], rank r holds units
  [r * u / N, (r + 1) * u / N) of it; with fewer units than ranks (KV heads), unit r * u // N, so
  the N / u ranks that share a unit each hold a copy.
A rule may name a `source`: the weight it cuts is that one (a tied embedding's table, whose LM head
is split by vocabulary while the embedding reads the whole table on every rank).

`rank_weights(weights, plan, rank)` cuts them (views where a rank's part is one slice, a copy where
it is several segments); the runtime loads an artifact for a rank through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch


def replicate() -> dict:
    return {"rule": "replicate"}


def split(dim: int) -> dict:
    return {"rule": "split", "dim": dim}


def segments(dim: int, sizes: list[int], units: list[int]) -> dict:
    return {"rule": "segments", "dim": dim, "sizes": list(sizes), "units": list(units)}


def _unit_range(units: int, size: int, rank: int) -> tuple[int, int]:
    """The units [start, stop) of one segment rank `rank` holds (see the module docstring)."""
    if units % size == 0:
        return rank * units // size, (rank + 1) * units // size
    if size % units == 0:
        first = rank * units // size
        return first, first + 1
    raise ValueError(f"{units} units cannot be shared by {size} ranks")


def _pieces(rule: dict, length: int, size: int, rank: int) -> list[tuple[int, int]]:
    """[start, stop) ranges along the rule's dim that make rank `rank`'s part, in order."""
    if rule["rule"] == "split":
        if length % size:
            raise ValueError(f"dim {rule['dim']} of {length} does not split into {size} equal parts")
        return [(rank * length // size, (rank + 1) * length // size)]
    assert rule["rule"] == "segments", f"unknown shard rule {rule!r}"
    if sum(rule["sizes"]) != length:
        raise ValueError(f"segments {rule['sizes']} do not add up to dim {rule['dim']}'s {length}")
    pieces, offset = [], 0
    for seg, units in zip(rule["sizes"], rule["units"]):
        width = seg // units
        start, stop = _unit_range(units, size, rank)
        pieces.append((offset + start * width, offset + stop * width))
        offset += seg
    return pieces


def cut(tensor: torch.Tensor, rule: dict, size: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of `tensor` under `rule` (a view when it is one slice)."""
    if rule["rule"] == "replicate":
        return tensor
    dim = rule["dim"]
    parts = [tensor.narrow(dim, start, stop - start) for start, stop in _pieces(rule, tensor.shape[dim], size, rank)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def cut_shape(shape: tuple[int, ...], rule: dict, size: int) -> tuple[int, ...]:
    """The shape of every rank's part of a tensor of `shape` (the same on every rank)."""
    if rule["rule"] == "replicate":
        return tuple(shape)
    dim = rule["dim"]
    width = sum(stop - start for start, stop in _pieces(rule, shape[dim], size, 0))
    return (*shape[:dim], width, *shape[dim + 1:])


def describe(rule: dict, size: int) -> str:
    """The rule in words, for `llmc inspect`."""
    source = f" of {rule['source']}" if "source" in rule else ""
    if rule["rule"] == "replicate":
        return f"replicated{source}"
    if rule["rule"] == "split":
        return f"split dim {rule['dim']} in {size}{source}"
    shares = [f"{s} ({u} {'/' if u % size == 0 else 'shared by'} {size})" for s, u in zip(rule["sizes"], rule["units"])]
    return f"segments of dim {rule['dim']}: {' | '.join(shares)}{source}"


@dataclass(frozen=True)
class TensorParallelPlan:
    """The manifest's "tensor_parallel" entry; size 1 (no rules) for an unsharded artifact."""

    size: int = 1
    weights: Mapping[str, dict] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"tensor-parallel size {self.size!r} is not a rank count")

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any]) -> "TensorParallelPlan":
        entry = manifest.get("tensor_parallel") or {}
        return cls(int(entry.get("size", 1)), dict(entry.get("weights", {})))

    def to_manifest(self) -> dict:
        return {"size": self.size, "weights": {name: dict(rule) for name, rule in sorted(self.weights.items())}}

    def source(self, name: str) -> str:
        """The stored tensor weight `name` is cut from (itself unless its rule names another)."""
        return self.weights.get(name, {}).get("source", name)

    def rank_shape(self, name: str, full_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Every rank's shape of weight `name`, whose source has `full_shape`."""
        return cut_shape(tuple(full_shape), self.weights.get(name, replicate()), self.size)

    def rank_weights(self, weights: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        """Rank `rank`'s tensors: every planned weight cut from its source, other tensors as they are."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside the {self.size} ranks of this artifact")
        held = {name: t for name, t in weights.items() if name not in self.weights}
        for name, rule in self.weights.items():
            held[name] = cut(weights[self.source(name)], rule, self.size, rank)
        return held


def rank_weights(weights: Mapping[str, torch.Tensor], plan: Mapping[str, Any], rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s weights under `plan` (the manifest's "tensor_parallel" entry, or the manifest)."""
    entry = plan.get("tensor_parallel", plan) if "size" not in plan else plan
    return TensorParallelPlan.from_manifest({"tensor_parallel": entry}).rank_weights(weights, rank)
