"""End to end on quantized graphs: a tiny model compiled for the cuda target, its GEMMs rewritten
into `qlinear` (int8 or int4 weights), its embedding into `qembedding`, its KV cache made int8,
lowered again; the triton executor (Triton's interpreter here) runs the generated kernels through
tests/test_triton_executor.py's steps (a prefill, a chunked prefill with a decode, decodes) and
must give the torch executor's logits (kernels/quant.py's refs) on the same graphs.

The rewrite is done by hand here, as the quantize_weights / quantize_kv passes will do it: the
codes are kernels/quant.py's quantizations of the float weights, and every node's type is
inferred again from the op rules, so the graphs pass `verify`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from llmc.compiler.codegen import lower
from llmc.compiler.ir import Graph, Node, TensorType, Value
from llmc.compiler.ops import infer_types, verify
from llmc.kernels.quant import KV_SCALE_BYTES, quantize_int4, quantize_int8
from llmc.runtime.artifact import KERNELS_DIR, Artifact, load_artifact
from test_triton_executor import cuda_artifact, run_backend  # noqa: F401  (cuda_artifact: a fixture)
from tolerances import tolerance

GroupOf = Callable[[str, int], int]              # (weight name, K) -> group size


def int4_groups(name: str, k: int) -> int:
    """The widest group of 128, 64, 32 that divides K; the head in 32s: every int4 group size."""
    return 32 if "lm_head" in name else next(g for g in (128, 64, 32) if k % g == 0)


def per_channel(name: str, k: int) -> int:
    return k


def q8_0_blocks(name: str, k: int) -> int:
    return 32 if k % 32 == 0 else k


def _quantized_weight(name: str, w: torch.Tensor, bits: int, group: int, weights: dict) -> list[Node]:
    """Weight nodes of `name`'s codes, scales (and mins), their tensors added to `weights`."""
    parts = quantize_int4(w, group) if bits == 4 else quantize_int8(w, group)
    dtypes = ["u4x2" if bits == 4 else "i8", "f16", "f16"]
    nodes = []
    for suffix, tensor, dtype in zip(("codes", "scales", "mins"), parts, dtypes):
        weights[f"{name}.{suffix}"] = tensor
        nodes.append(Node(f"w.{name}.{suffix}", "weight", (), {}, (TensorType(dtype, tuple(tensor.shape)),)))
    return nodes


def _rewrite(node: Node, weights: dict, bits: int, group_of: GroupOf, made: dict) -> tuple[list[Node], Node]:
    """(new weight nodes, the node) with a linear -> qlinear, an embedding -> qembedding."""
    if node.op not in ("linear", "embedding"):
        return [], node
    float_weight = node.inputs[1] if node.op == "linear" else node.inputs[0]
    name = float_weight.node[2:]
    w = weights[name]
    group = group_of(name, w.shape[1])
    fresh = [] if name in made else _quantized_weight(name, w, bits, group, weights)
    made.setdefault(name, [Value(f"w.{name}.{s}") for s in ("codes", "scales", "mins")][: 3 if bits == 4 else 2])
    attrs = {k: v for k, v in node.attrs.items()} | {"bits": bits, "group_size": group}
    if node.op == "linear":
        inputs = (node.inputs[0], *made[name], *node.inputs[2:])
        return fresh, Node(node.name, "qlinear", inputs, attrs, node.types)
    attrs["dtype"] = node.type.dtype
    return fresh, Node(node.name, "qembedding", (*made[name], node.inputs[1]), attrs, node.types)


def quantized_graph(graph: Graph, weights: dict, bits: int, group_of: GroupOf, kv_int8: bool) -> Graph:
    """`graph` with quantized GEMMs and embedding (and an int8 cache), types inferred again."""
    nodes, types, made = [], {}, {}
    for node in graph.nodes:
        fresh, node = _rewrite(node, weights, bits, group_of, made) if bits else ([], node)
        types.update({n.value(): n.type for n in fresh})
        if node.name == "kv_cache" and kv_int8:
            *dims, head_dim = node.type.shape
            node = dataclasses.replace(node, types=(TensorType("i8", (*dims, head_dim + KV_SCALE_BYTES)),))
        elif node.op not in ("input", "weight"):
            node = dataclasses.replace(node, types=infer_types(node.op, [types[v] for v in node.inputs], node.attrs))
        for n in [*fresh, node]:
            nodes.append(n)
            types.update({n.value(i): t for i, t in enumerate(n.types)})
    used = {v.node for n in nodes for v in n.inputs}
    graph = Graph(graph.name, [n for n in nodes if n.op != "weight" or n.name in used], graph.outputs)
    verify(graph)
    return graph


def quantized_artifact(artifact: Artifact, folder, bits: int, group_of: GroupOf, kv_int8: bool) -> Artifact:
    """The artifact with quantized graphs, and their kernel modules written into folder/kernels/."""
    weights = dict(artifact.weights)
    graphs = {entry: quantized_graph(g, weights, bits, group_of, kv_int8) for entry, g in artifact.graphs.items()}
    (folder / KERNELS_DIR).mkdir(parents=True)
    for name, source in lower(graphs).modules.items():
        (folder / KERNELS_DIR / f"{name}.py").write_text(source)
    return dataclasses.replace(artifact, path=folder, graphs=graphs, weights=weights)


# An int8 cache stores K after RoPE and GEMMs that each backend sums in its own order, so an element
# within fp32 rounding of a rounding boundary can land one code (amax / 127 of its row) away from
# the ref's: with one such code (measured: 6.6e-4 when the gated GEMM takes 64-wide tiles instead
# of 32) logits of magnitude ~1 move by well under half a step. The writer's quantization is
# checked bit for bit in tests/test_triton_int8_kv.py.
KV8_ATOL = 0.5 / 127

# (family, bits, groups, int8 KV cache): int8 per output channel over K = 72 (qkv bias, the gated
# MLP) with an int8 cache; int4 in groups of 128, 64 and 32 with an int8 cache; GGUF Q8_0 blocks
# of 32 over a float cache.
CASES = [("qwen2", 8, per_channel, True), ("llama_hd32", 4, int4_groups, True),
         ("llama_hd32", 8, q8_0_blocks, False)]


@pytest.mark.parametrize("family,bits,group_of,kv_int8", CASES, ids=["int8-kv8", "int4-kv8", "q8_0"])
def test_triton_executor_runs_quantized_graphs_as_the_torch_executor(cuda_artifact, tmp_path, family, bits,
                                                                     group_of, kv_int8):
    artifact = quantized_artifact(load_artifact(cuda_artifact(family)), tmp_path, bits, group_of, kv_int8)
    ops = {n.op for g in artifact.graphs.values() for n in g.nodes}
    assert {"qlinear", "qembedding"} <= ops and not {"linear", "embedding"} & ops
    assert artifact.graphs["decode"].node_map()["kv_cache"].type.dtype == ("i8" if kv_int8 else "f32")
    want, got = run_backend(artifact, "torch", decodes=3), run_backend(artifact, "triton", decodes=3)
    tol = tolerance(torch.float32, artifact.config.intermediate_size, scale=4.0)
    if kv_int8:
        tol["atol"] += KV8_ATOL
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert not g.isnan().any(), f"step {step}"
        torch.testing.assert_close(g, w, **tol, msg=lambda m: f"step {step}: {m}")
