"""Inputs for running an IR graph outside the engine (for bisect, tests and benchmarks).

A `Step` names, per sequence, all its tokens and how many of them are already in the KV cache
(`cached`); the step computes the rest. `step_feeds(graph, step)` builds every input a graph
declares for it. For a graph that takes a cache, the blocks come from a `BlockLayout`: each
sequence's blocks are drawn at random from a pool twice as large as needed, so the block tables
skip blocks that nobody owns (holes), no sequence's blocks are in order, and the table padding
points at a foreign block. The cache starts full of random values (`garbage_cache`): a kernel
that reads a slot it should not, or a block beyond a sequence's length, reads noise. The cached
context itself is whatever the caller put there: random values (pass tests, where both graphs
get the same cache) or the model's own K/V written by a chunked prefill (`fill_context`, for
bisect). A graph without a cache only takes steps with nothing cached.

`greedy_tokens` decodes greedily with an entry-graph pair, through the cache when the graphs have
one, else by recomputing the whole sequence each step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.compiler.ir import Graph
from llmc.kernels.quant import cache_head_dim, is_int8_cache, quantize_kv_rows
from llmc.runtime.model_runner import allocate_kv_cache
from llmc.runtime.torch_backend import TorchProgram

BLOCK_SIZE = 4


@dataclass(frozen=True)
class Step:
    """All tokens of each sequence, of which the first `cached` are in the KV cache already."""

    name: str
    tokens: tuple[tuple[int, ...], ...]
    cached: tuple[int, ...]

    @staticmethod
    def prefill(name: str, sequences: list[list[int]]) -> "Step":
        """Whole sequences from an empty cache."""
        return Step(name, tuple(map(tuple, sequences)), (0,) * len(sequences))

    @staticmethod
    def decode(name: str, tokens: list[int]) -> "Step":
        """One token per sequence, with nothing cached before it."""
        return Step.prefill(name, [[t] for t in tokens])

    @staticmethod
    def after_context(name: str, sequences: list[list[int]], new: list[int]) -> "Step":
        """The last `new[i]` tokens of sequence i, after the others were cached."""
        return Step(name, tuple(map(tuple, sequences)), tuple(len(s) - n for s, n in zip(sequences, new)))

    @property
    def new_tokens(self) -> list[list[int]]:
        return [list(t[c:]) for t, c in zip(self.tokens, self.cached)]

    @property
    def lengths(self) -> list[int]:
        return [len(t) for t in self.tokens]

    @property
    def has_context(self) -> bool:
        return any(self.cached)


@dataclass(frozen=True)
class BlockLayout:
    """Each sequence's blocks, in order, in a pool of `num_blocks` blocks of `block_size` slots."""

    tables: tuple[tuple[int, ...], ...]
    num_blocks: int
    block_size: int
    padding: int        # a block no sequence owns, for the tables' padding

    @staticmethod
    def shuffled(lengths: list[int], block_size: int = BLOCK_SIZE, seed: int = 0) -> "BlockLayout":
        needed = [-(-n // block_size) for n in lengths]
        num_blocks = 2 * sum(needed) + 1
        ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        tables, start = [], 0
        for n in needed:
            tables.append(tuple(ids[start:start + n]))
            start += n
        return BlockLayout(tuple(tables), num_blocks, block_size, ids[-1])

    def slot(self, seq: int, position: int) -> int:
        return self.tables[seq][position // self.block_size] * self.block_size + position % self.block_size

    def block_tables(self) -> torch.Tensor:
        width = max(len(t) for t in self.tables)
        return torch.tensor([list(t) + [self.padding] * (width - len(t)) for t in self.tables], dtype=torch.int32)


def garbage_cache(graph: Graph, layout: BlockLayout, seed: int = 0) -> torch.Tensor:
    """A cache of the layout the graph's `kv_cache` input declares, full of random values; an
    int8 cache holds the same values as a float one of the same seed, quantized row by row."""
    cache = allocate_kv_cache(graph.node_map()["kv_cache"].type, layout.num_blocks, layout.block_size)
    g = torch.Generator().manual_seed(seed)
    values = torch.randn((*cache.shape[:-1], cache_head_dim(cache)), generator=g).mul_(3.0)
    return quantize_kv_rows(values) if is_int8_cache(cache) else values.to(cache.dtype)


def step_feeds(graph: Graph, step: Step, layout: BlockLayout | None = None,
               cache: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Every input `graph` declares for `step` (logits at every computed token of a prefill graph).
    A cache graph gets `cache` (default: a garbage cache) read through `layout` (default: a
    shuffled layout of the step's lengths)."""
    names = {n.name for n in graph.inputs()}
    if step.has_context and "kv_cache" not in names:
        raise ValueError(f"graph {graph.name} has no KV cache, so it cannot take step {step.name!r} with "
                         "cached context; recompute the whole sequences instead")
    new = step.new_tokens
    counts = [len(s) for s in new]
    feeds = {
        "input_ids": torch.tensor([t for s in new for t in s], dtype=torch.int64),
        "positions": torch.tensor([p for c, n in zip(step.cached, counts) for p in range(c, c + n)],
                                  dtype=torch.int64),
        "query_start_loc": torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32),
        "logits_indices": torch.arange(sum(counts), dtype=torch.int64),
    }
    if "kv_cache" in names:
        layout = layout or BlockLayout.shuffled(step.lengths)
        feeds["kv_cache"] = garbage_cache(graph, layout) if cache is None else cache
        feeds["slot_mapping"] = torch.tensor([layout.slot(i, p) for i, (c, n) in enumerate(zip(step.cached, counts))
                                              for p in range(c, c + n)], dtype=torch.int64)
        feeds["block_tables"] = layout.block_tables()
        feeds["seq_lens"] = torch.tensor(step.lengths, dtype=torch.int32)
    return {k: v for k, v in feeds.items() if k in names}


@torch.inference_mode()
def fill_context(prefill: TorchProgram, step: Step, layout: BlockLayout, cache: torch.Tensor,
                 chunks: int = 2) -> None:
    """Write every sequence's cached context into `cache` with the prefill graph, in `chunks`
    chunked-prefill steps (each sequence's context cut into near-equal parts)."""
    done = [0] * len(step.tokens)
    for k in range(1, chunks + 1):
        ends = [c * k // chunks for c in step.cached]
        keep = [i for i, (d, e) in enumerate(zip(done, ends)) if e > d]
        if keep:
            sub = Step(f"{step.name} context", tuple(step.tokens[i][:ends[i]] for i in keep),
                       tuple(done[i] for i in keep))
            sub_layout = BlockLayout(tuple(layout.tables[i] for i in keep), layout.num_blocks,
                                     layout.block_size, layout.padding)
            prefill(step_feeds(prefill.graph, sub, sub_layout, cache))
        done = ends


def _greedy_recompute(prefill: TorchProgram, prompt: list[int], steps: int) -> list[int]:
    ids: list[int] = list(prompt)
    for _ in range(steps):
        feeds = step_feeds(prefill.graph, Step.prefill("greedy", [ids]))
        feeds["logits_indices"] = torch.tensor([len(ids) - 1])
        (logits,) = prefill(feeds)
        ids.append(int(logits[-1].argmax()))
    return ids[len(prompt):]


def _greedy_cached(prefill: TorchProgram, decode: TorchProgram, prompt: list[int], steps: int) -> list[int]:
    layout = BlockLayout.shuffled([len(prompt) + steps])
    feeds = step_feeds(prefill.graph, Step.prefill("greedy", [prompt]), layout)
    feeds["logits_indices"] = torch.tensor([len(prompt) - 1])
    (logits,) = prefill(feeds)
    out, cache = [int(logits[-1].argmax())], feeds["kv_cache"]
    for _ in range(steps - 1):
        ids = [*prompt, *out]
        (logits,) = decode(step_feeds(decode.graph, Step.after_context("greedy", [ids], [1]), layout, cache))
        out.append(int(logits[-1].argmax()))
    return out


@torch.inference_mode()
def greedy_tokens(prefill: TorchProgram, decode: TorchProgram, prompt: list[int], steps: int) -> list[int]:
    """`steps` greedy tokens after `prompt` (through the KV cache when the graphs have one)."""
    if steps <= 0:
        return []
    if "kv_cache" in prefill.input_names:
        return _greedy_cached(prefill, decode, prompt, steps)
    return _greedy_recompute(prefill, prompt, steps)
