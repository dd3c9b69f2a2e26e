"""The probes `llmc debug bisect` runs every stage of the pipeline on, and how a stage runs one.

A probe is one step of one entry graph (tools/feeds.py): random prefills and a decode from an
empty cache, the chat prompt, and two steps over real cached context: a decode of three
sequences whose contexts (9, 22 and 36 tokens) end mid-block, and a chunked-prefill step that
computes 6 more tokens of one sequence, one decode token of another and a whole new sequence.
The blocks come from a shuffled layout with holes, the cache starts as noise, and the context is
written by the stage's own prefill graph in two chunks, so a decode probe exercises RoPE at
real positions, the paged K/V write and read, and the softmax over many keys.

A stage whose graphs take no cache (before insert_paged_attention) computes a probe with
context the only way it can: its prefill graph over the whole sequences, logits read at the
probe's tokens, which is what the cached step must compute. A sharded stage (--tp N) runs its
ranks in lockstep (tools/bisect_ranks.py) on the same feeds and the same cache of all KV heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.compiler.ir import Graph
from llmc.models.config import ModelConfig
from llmc.runtime.torch_backend import TorchProgram

from .bisect_ranks import RankedProgram, Ranks, stage_program
from .feeds import BlockLayout, Step, fill_context, garbage_cache, step_feeds


@dataclass(frozen=True)
class Probe:
    entry: str
    step: Step


def make_probes(config: ModelConfig, prompt_ids: list[int], seed: int) -> list[Probe]:
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(0, config.vocab_size, (n,), generator=g).tolist()

    return [Probe("prefill", Step.prefill("random prefill", [rand(7), rand(4)])),
            Probe("prefill", Step.prefill("chat prompt", [prompt_ids])),
            Probe("decode", Step.decode("random decode", rand(3))),
            Probe("decode", Step.after_context("decode, context", [rand(10), rand(23), rand(37)], [1, 1, 1])),
            Probe("prefill", Step.after_context("chunk, context", [rand(17), rand(30), rand(5)], [6, 1, 5]))]


def takes_cache(graph: Graph) -> bool:
    return any(n.name == "kv_cache" for n in graph.inputs())


def runs_as_is(graphs: dict[str, Graph], probe: Probe) -> bool:
    """Whether the probe's own entry graph computes it (else the prefill graph recomputes it)."""
    return takes_cache(graphs[probe.entry]) or not probe.step.has_context


def prepare(graphs: dict[str, Graph], weights: dict[str, torch.Tensor], probe: Probe,
            cache_dtype: torch.dtype | None = None,
            ranks: Ranks | None = None) -> tuple[TorchProgram | RankedProgram, dict[str, torch.Tensor]]:
    """The program and feeds whose first output is the probe's logits under these graphs (see
    the module docstring); `cache_dtype` overrides the cache's element type (float64 runs), and
    `ranks` runs sharded graphs rank by rank."""
    program, step = stage_program(graphs[probe.entry], weights, ranks), probe.step
    graph = program.graph
    if takes_cache(graph):
        layout = BlockLayout.shuffled(step.lengths)
        cache = garbage_cache(graph, layout)
        cache = cache if cache_dtype is None else cache.to(cache_dtype)
        fill_context(stage_program(graphs["prefill"], weights, ranks), step, layout, cache)
        return program, step_feeds(graph, step, layout, cache)
    if not step.has_context:
        return program, step_feeds(graph, step)
    prefill = stage_program(graphs["prefill"], weights, ranks)
    feeds = step_feeds(prefill.graph, Step.prefill(step.name, [list(t) for t in step.tokens]))
    starts = torch.tensor([0, *step.lengths]).cumsum(0)[:-1].tolist()
    feeds["logits_indices"] = torch.tensor([s + p for s, c, n in zip(starts, step.cached, step.lengths)
                                            for p in range(c, n)])
    return prefill, feeds


@torch.inference_mode()
def probe_logits(graphs: dict[str, Graph], weights: dict[str, torch.Tensor], probe: Probe,
                 cache_dtype: torch.dtype | None = None, ranks: Ranks | None = None) -> torch.Tensor:
    program, feeds = prepare(graphs, weights, probe, cache_dtype, ranks)
    return program(feeds)[0]
