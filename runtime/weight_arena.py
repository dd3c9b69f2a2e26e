"""An executor's CPU weights in one anonymous mapping, in the order a decode step reads them, advised for
transparent huge pages (huge_pages.py says why).

Contract: place_weights(weights, order) -> the same mapping (name -> plain tensor or GemvWeight), each
contiguous tensor in it (a plain weight, or a GemvWeight's weight, scales and mins) replaced by an
equal view into one WeightArena: the names in `order` first, in that order, then the others; each
tensor at a PAGE-aligned offset; an object held under several names placed once. A tensor that is
not contiguous is cloned, as is every tensor where the OS gives no private anonymous mapping. The
originals are not kept, so one copy stays resident (the arena's only extra bytes are the alignment
gaps, under PAGE a tensor). The weights lie in the order the step reads them. Where the huge-page
advice is refused or unknown (another OS), the arena is plain memory, said at INFO.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterable

import torch

from llmc.kernels.gemv import GemvWeight

from .huge_pages import HUGE_PAGE, huge_page_bytes

log = logging.getLogger("llmc")

PAGE = 4096                 # each tensor's alignment in the arena (it starts on a HUGE_PAGE)


class WeightArena:
    """`nbytes` of huge_page_bytes; `take(t)` copies t into the next PAGE-aligned bytes and returns the view."""

    def __init__(self, nbytes: int):
        self.bytes, self.huge_pages = huge_page_bytes(nbytes, "the weights")
        self.offset = 0
        self.end = nbytes

    def take(self, t: torch.Tensor) -> torch.Tensor:
        start = aligned(self.offset)
        if start + t.nbytes > self.end:
            raise ValueError(f"the weight arena holds {self.end} bytes; a tensor of {t.nbytes} does not fit at {start}")
        view = self.bytes[start:start + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        self.offset = start + t.nbytes
        return view


def aligned(offset: int) -> int:
    return -(-offset // PAGE) * PAGE


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors a weight holds: itself, or a GemvWeight's weight, scales and mins."""
    if isinstance(value, GemvWeight):
        return [t for t in (value.weight, value.scales, value.mins) if t is not None]
    return [value] if isinstance(value, torch.Tensor) else []


def _placed(value: Any, arena: WeightArena) -> Any:
    take = lambda t: None if t is None else arena.take(t) if t.is_contiguous() else t.clone()  # noqa: E731
    if isinstance(value, GemvWeight):
        return dataclasses.replace(value, weight=take(value.weight), scales=take(value.scales), mins=take(value.mins))
    return take(value) if isinstance(value, torch.Tensor) else value


def place_weights(weights: dict[str, Any], order: Iterable[str] = ()) -> dict[str, Any]:
    """`weights` with its tensors in one WeightArena (module docstring: the contract)."""
    names = list(dict.fromkeys([n for n in order if n in weights] + list(weights)))
    unique = list({id(weights[n]): weights[n] for n in names}.values())
    size = sum(aligned(t.nbytes) for v in unique for t in _tensors(v) if t.is_contiguous())
    try:
        arena = WeightArena(size)
    except (AttributeError, TypeError, OSError) as why:    # no private anonymous mappings here
        log.info("the weights are cloned one by one (no anonymous mapping for them: %s)", why)
        return {name: w.clone() if isinstance(w, torch.Tensor) else w for name, w in weights.items()}
    placed: dict[int, Any] = {}
    for value in unique:
        placed[id(value)] = _placed(value, arena)
    return {name: placed[id(w)] for name, w in weights.items()}


def read_order(graph) -> list[str]:
    """The weights a graph reads, in the order of the nodes that read them."""
    return list(dict.fromkeys(v.node[2:] for node in graph.nodes for v in node.inputs if v.node.startswith("w.")))
