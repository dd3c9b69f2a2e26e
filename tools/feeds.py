"""Inputs for running an IR graph outside the engine (for bisect, tests and benchmarks).

`step_feeds(graph, step)` builds every input a graph declares for one step in which each listed
sequence is computed from an empty KV cache: a graph that takes no cache (before
insert_paged_attention) and one that does compute the same logits for such a step. Blocks are
laid out one sequence after another in a fresh zero cache. `greedy_tokens` decodes greedily with
an entry-graph pair, through the cache when the graphs take one, else by recomputing the whole
sequence each step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.compiler.ir import Graph
from llmc.runtime.model_runner import allocate_kv_cache
from llmc.runtime.torch_backend import TorchProgram

BLOCK_SIZE = 4


@dataclass(frozen=True)
class Step:
    """One step's tokens: a list of token ids per sequence, each sequence starting at `positions`."""

    name: str
    sequences: tuple[tuple[int, ...], ...]
    positions: tuple[tuple[int, ...], ...]

    @staticmethod
    def prefill(name: str, sequences: list[list[int]]) -> "Step":
        return Step(name, tuple(map(tuple, sequences)), tuple(tuple(range(len(s))) for s in sequences))

    @staticmethod
    def decode(name: str, tokens: list[int], positions: list[int]) -> "Step":
        """One token per sequence, each at its own position, with nothing cached before it."""
        return Step(name, tuple((t,) for t in tokens), tuple((p,) for p in positions))


def empty_cache(graph: Graph, num_blocks: int, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """A zero KV cache of the layout the graph's `kv_cache` input declares."""
    return allocate_kv_cache(graph.node_map()["kv_cache"].type, num_blocks, block_size)


def _cache_feeds(graph: Graph, step: Step, block_size: int) -> dict[str, torch.Tensor]:
    tables, slots, next_block = [], [], 0
    for seq in step.sequences:
        blocks = list(range(next_block, next_block + -(-len(seq) // block_size)))
        next_block += len(blocks)
        tables.append(blocks)
        slots += [blocks[i // block_size] * block_size + i % block_size for i in range(len(seq))]
    width = max(len(t) for t in tables)
    return {
        "kv_cache": empty_cache(graph, next_block, block_size),
        "slot_mapping": torch.tensor(slots, dtype=torch.int64),
        "block_tables": torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        "seq_lens": torch.tensor([len(s) for s in step.sequences], dtype=torch.int32),
    }


def step_feeds(graph: Graph, step: Step, block_size: int = BLOCK_SIZE) -> dict[str, torch.Tensor]:
    """Every input `graph` declares, for `step` (logits at every token of a prefill graph)."""
    lengths = [len(s) for s in step.sequences]
    feeds = {
        "input_ids": torch.tensor([t for s in step.sequences for t in s], dtype=torch.int64),
        "positions": torch.tensor([p for ps in step.positions for p in ps], dtype=torch.int64),
        "query_start_loc": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
        "logits_indices": torch.arange(sum(lengths), dtype=torch.int64),
    }
    names = {n.name for n in graph.inputs()}
    if "kv_cache" in names:
        feeds |= _cache_feeds(graph, step, block_size)
    return {k: v for k, v in feeds.items() if k in names}


def _greedy_recompute(prefill: TorchProgram, prompt: list[int], steps: int) -> list[int]:
    ids: list[int] = list(prompt)
    for _ in range(steps):
        feeds = step_feeds(prefill.graph, Step.prefill("greedy", [ids]))
        feeds["logits_indices"] = torch.tensor([len(ids) - 1])
        (logits,) = prefill(feeds)
        ids.append(int(logits[-1].argmax()))
    return ids[len(prompt):]


def _greedy_cached(prefill: TorchProgram, decode: TorchProgram, prompt: list[int], steps: int) -> list[int]:
    feeds = step_feeds(prefill.graph, Step.prefill("greedy", [prompt]), block_size=len(prompt) + steps)
    feeds["logits_indices"] = torch.tensor([len(prompt) - 1])
    (logits,) = prefill(feeds)
    out, cache = [int(logits[-1].argmax())], feeds["kv_cache"]   # one block holds the sequence
    for pos in range(len(prompt), len(prompt) + steps - 1):
        (logits,) = decode({
            "input_ids": torch.tensor([out[-1]]), "positions": torch.tensor([pos]),
            "query_start_loc": torch.tensor([0, 1], dtype=torch.int32), "kv_cache": cache,
            "slot_mapping": torch.tensor([pos]), "block_tables": torch.tensor([[0]], dtype=torch.int32),
            "seq_lens": torch.tensor([pos + 1], dtype=torch.int32)})
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
