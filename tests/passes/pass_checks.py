"""What every pass test checks, in one place: run a pass (verified), the printed IR, numbers
before == after on random inputs, and traced tiny graphs to run a pass on.

Shapes: T=1 and odd T, hidden 72 (not a power of two). A graph that takes a KV cache is also run
on steps over cached context (`CONTEXT_STEPS`): several sequences of several blocks each, ending
mid-block, in shuffled blocks with holes, the cache full of random K/V (the same for the graph
before and after the pass): a chunk of a prompt, a decode token in the same step and a new
prompt, or a decode of three sequences, so RoPE at real positions, the paged K/V read and the
softmax over many keys are all part of what must stay the same.
"""

from __future__ import annotations

import copy
import dataclasses
import textwrap
from typing import Callable

import torch

from llmc.compiler.dtypes import to_torch
from llmc.compiler.frontend import trace
from llmc.compiler.ir import Graph, parse_graph, print_graph
from llmc.compiler.ops import verify
from llmc.models.config import ModelConfig
from llmc.passes.pipeline import pass_names, run_pipeline
from llmc.passes.rewrite import PassContext
from llmc.runtime.torch_backend import interpret
from llmc.tools.feeds import Step, step_feeds
from tolerances import tolerance

TINY = ModelConfig("LlamaForCausalLM", vocab_size=300, hidden_size=72, intermediate_size=120, num_layers=2,
                   num_heads=6, num_kv_heads=3, head_dim=12, rms_norm_eps=1e-5, rope_theta=10000.0)
TINY_QWEN = dataclasses.replace(TINY, architecture="Qwen2ForCausalLM", qkv_bias=True)

PREFILL_STEPS = [Step.prefill("T=7+4", [[5, 17, 3, 99, 42, 7, 250], [8, 1, 120, 33]]),
                 Step.prefill("T=1", [[77]])]
DECODE_STEPS = [Step.decode("S=3", [5, 200, 31]), Step.decode("S=1", [12])]
CONTEXT_STEPS = {
    "prefill": [Step.after_context("6+1+5 after 11, 29, 0 cached", [[(7 * i) % 300 for i in range(17)],
                                                                     [(11 * i + 3) % 300 for i in range(30)],
                                                                     [4, 8, 15, 16, 23]], [6, 1, 5])],
    "decode": [Step.after_context("S=3 after 9, 22, 36 cached", [[(5 * i) % 300 for i in range(10)],
                                                                  [(13 * i + 1) % 300 for i in range(23)],
                                                                  [(17 * i + 2) % 300 for i in range(37)]], [1, 1, 1])],
}


def ir(text: str) -> Graph:
    graph = parse_graph(textwrap.dedent(text))
    verify(graph)
    return graph


def printed(text: str) -> str:
    """IR text as the printer writes it (for comparing with a test's expected text)."""
    return print_graph(parse_graph(textwrap.dedent(text)))


def run_pass(fn: Callable, graph: Graph, weights: dict | None = None) -> tuple[Graph, PassContext]:
    ctx = PassContext(weights=weights)
    out = fn(copy.deepcopy(graph), ctx)
    verify(out)
    return out, ctx


def hits(ctx: PassContext) -> int:
    (count,) = ctx.hits.values()
    return count


def random_weights(graph: Graph, seed: int = 0) -> dict[str, torch.Tensor]:
    """Values of every weight the graph names: norms near 1, biases and matrices O(0.3)."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for node in graph.weights():
        shape, dtype = node.type.shape, to_torch(node.type.dtype)
        if len(shape) == 1 and "norm" in node.name:
            w = torch.rand(shape, generator=g) + 0.5
        else:
            w = torch.randn(shape, generator=g) * 0.3
        weights[node.name[2:]] = w.to(dtype)
    return weights


def feeds(graph: Graph, step: Step, seed: int = 0) -> dict[str, torch.Tensor]:
    """The standard inputs of `step`, plus random [T, N] tensors for any other float input."""
    out = step_feeds(graph, step)
    g = torch.Generator().manual_seed(seed)
    tokens = sum(len(s) for s in step.new_tokens)
    for node in graph.inputs():
        if node.name not in out and node.type.dtype.startswith(("f", "bf")):
            shape = [tokens if isinstance(d, str) else d for d in node.type.shape]
            out[node.name] = torch.randn(shape, generator=g).to(to_torch(node.type.dtype))
    return out


def assert_same_numbers(before: Graph, after: Graph, weights: dict, steps: list[Step],
                        exact: bool = False, reduction: int = 120) -> None:
    """interpret(before) == interpret(after) on every step (each from a fresh cache)."""
    for step in steps:
        want = interpret(before, weights, feeds(before, step))
        got = interpret(after, weights, feeds(after, step))
        assert len(want) == len(got)
        for a, b in zip(want, got):
            if exact:
                assert torch.equal(a, b), f"{step.name}: max abs diff {(a - b).abs().max()}"
            else:
                scale = max(1.0, float(a.abs().max()))
                torch.testing.assert_close(b, a, **tolerance(a.dtype, reduction, scale=scale))


def traced_before(pass_name: str, entry: str = "prefill", config: ModelConfig = TINY,
                  disabled: tuple[str, ...] = ()) -> tuple[Graph, dict]:
    """A tiny model's graph as the pipeline hands it to `pass_name`, with its weights."""
    graph = trace(config, entry)
    weights = random_weights(graph)
    names = pass_names()
    earlier = [n for n in names[:names.index(pass_name)] if n not in disabled]
    previous = earlier[-1] if earlier else None
    if previous is not None:
        graph, _ = run_pipeline(graph, PassContext(weights=weights), disabled, stop_after=previous)
    return graph, weights


def steps_for(graph: Graph) -> list[Step]:
    """The steps of the graph's entry, and those over cached context if it takes a cache."""
    plain = PREFILL_STEPS if graph.name == "prefill" else DECODE_STEPS
    has_cache = any(n.name == "kv_cache" for n in graph.inputs())
    return plain + CONTEXT_STEPS[graph.name] if has_cache else plain
