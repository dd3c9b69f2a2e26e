"""Kernel benchmark: `python -m llmc.tools.bench_kernels [--dtype bfloat16|float32]`.

Times each native CPU kernel (add_rmsnorm and silu_mul: the C++ llmc codegen writes for them,
launched as the op-by-op path launches it) against its torch ref (the peer, in the same run) at SmolLM2-135M
shapes (9 query heads, 3 KV heads, head_dim 64, hidden 576, MLP 1536): a decode step of 64
sequences with 40-400 cached tokens, and a 512-token prompt step (two prompts of 256), and the
panel GEMM (kernels/panels.py) against F.linear over the model's four layer GEMMs at several token
counts (`bench_gemv` compares it with oneDNN's packed GEMM). Prints
milliseconds per call and the ratio. A benchmark, not a test: the numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Callable

import torch
import torch.nn.functional as F

from llmc.compiler.codegen.cpu_lowering import lower_cpu
from llmc.compiler.ir import parse_graph
from llmc.kernels.activation import silu_mul_ref
from llmc.kernels.attention import paged_attention_cpu, paged_attention_ref
from llmc.kernels.generated import load_generated
from llmc.kernels.gemv import gemv_cpu, prepare_linear_weight
from llmc.kernels.native import load_native_kernels
from llmc.kernels.rmsnorm import add_rmsnorm_ref
from llmc.kernels.rope import RopeTables
from llmc.kernels.rope_kv_write import rope_kv_write_cpu, rope_kv_write_ref
from llmc.runtime.cpu_program import generated_launch

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, MLP, BLOCK = 9, 3, 64, 576, 1536, 16
LAYER_GEMMS = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * MLP, HIDDEN), (HIDDEN, MLP)]   # qkv, o, gate_up, down
ROW_OPS = """graph rows {{
  %x = input() : {dt}[T,{hidden}]
  %r = input() : {dt}[T,{hidden}]
  %gate_up = input() : {dt}[T,{gate_up}]
  %w.norm = weight() : {dt}[{hidden}]
  %0 = add_rmsnorm(%x, %r, %w.norm, eps=1e-05) : {dt}[T,{hidden}], {dt}[T,{hidden}]
  %1 = silu_mul(%gate_up) : {dt}[T,{mlp}]
  return %0, %0#1, %1
}}
"""


def generated_row_ops(dtype: torch.dtype) -> dict[str, Callable[[list], tuple]]:
    """add_rmsnorm and silu_mul at the model's widths, each its generated C++ launched by run_generated."""
    dt = {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]
    graph = parse_graph(ROW_OPS.format(dt=dt, hidden=HIDDEN, gate_up=2 * MLP, mlp=MLP))
    lowering = lower_cpu({graph.name: graph})
    library = load_generated(lowering.source())
    return {unit.nodes[0].op: generated_launch(library.address(name), unit, graph)
            for unit, name in zip(lowering.units[graph.name], lowering.plan[graph.name])}


def ms_per_call(fn: Callable[[], object], repeat: int = 20) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return 1000 * (time.perf_counter() - start) / repeat


def step_layout(chunks: list[int], lens: list[int], dtype: torch.dtype):
    """A cache with random K/V, block tables, lengths and query offsets for one step."""
    tables, next_block = [], 0
    for n in lens:
        tables.append(list(range(next_block, next_block + -(-n // BLOCK))))
        next_block += len(tables[-1])
    width = max(len(t) for t in tables)
    cache = torch.randn(1, 2, next_block, KV_HEADS, BLOCK, HEAD_DIM).to(dtype)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qsl = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32)
    return cache, block_tables, torch.tensor(lens, dtype=torch.int32), qsl


def kernel_rows(name: str, tokens: int, chunks: list[int], lens: list[int], dtype: torch.dtype) -> list[tuple]:
    cache, tables, seq_lens, qsl = step_layout(chunks, lens, dtype)
    q = torch.randn(tokens, HEADS * HEAD_DIM).to(dtype)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
    positions = torch.tensor([p for c, n in zip(chunks, lens) for p in range(n - c, n)])
    slots = torch.arange(tokens) % (cache.shape[2] * BLOCK)
    x, residual = (torch.randn(tokens, HIDDEN).to(dtype) for _ in range(2))
    norm_weight, gate_up = torch.rand(HIDDEN).to(dtype), torch.randn(tokens, 2 * MLP).to(dtype)
    tables_for_rope = RopeTables(HEAD_DIM, 1e5, None)
    rope = dict(layer=0, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    generated = generated_row_ops(dtype)
    pairs = {
        "paged_attention": (lambda: paged_attention_cpu(q, cache, tables, seq_lens, qsl, 0, 0.125),
                            lambda: paged_attention_ref(q, cache, tables, seq_lens, qsl, 0, HEAD_DIM, 0.125)),
        "rope_kv_write": (lambda: rope_kv_write_cpu(qkv, positions, cache, slots, **rope, tables=tables_for_rope),
                          lambda: rope_kv_write_ref(qkv, positions, cache, slots, **rope, theta=1e5, scaling=None)),
        "add_rmsnorm": (lambda: generated["add_rmsnorm"]([x, residual, norm_weight], {}),
                        lambda: add_rmsnorm_ref(x, residual, norm_weight, 1e-5)),
        "silu_mul": (lambda: generated["silu_mul"]([gate_up], {}), lambda: silu_mul_ref(gate_up)),
    }
    return [(f"{op} ({name})", ms_per_call(native), ms_per_call(ref)) for op, (native, ref) in pairs.items()]


def gemm_rows(dtype: torch.dtype) -> list[tuple]:
    weights = [torch.randn(n, k).to(dtype) for n, k in LAYER_GEMMS]
    panels = [prepare_linear_weight(w) for w in weights]
    rows = []
    for tokens in (1, 16, 64, 512):
        xs = [torch.randn(tokens, w.shape[1]).to(dtype) for w in weights]
        fast = ms_per_call(lambda: [gemv_cpu(x, p) for p, x in zip(panels, xs)])
        peer = ms_per_call(lambda: [F.linear(x, w) for w, x in zip(weights, xs)])
        rows.append((f"layer GEMMs, panels (T={tokens})", fast, peer))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    load_native_kernels()
    rng = random.Random(0)
    torch.manual_seed(0)
    decode_lens = [rng.randint(40, 400) for _ in range(64)]
    rows = kernel_rows("decode, 64 seqs", 64, [1] * 64, decode_lens, dtype)
    rows += kernel_rows("prompt, 2 x 256", 512, [256, 256], [256, 256], dtype)
    rows += gemm_rows(dtype)
    print(f"{'kernel (' + args.dtype + ')':<44}{'native ms':>10}{'torch ms':>10}{'speedup':>9}")
    for label, native, ref in rows:
        print(f"{label:<44}{native:>10.3f}{ref:>10.3f}{ref / native:>8.2f}x")


if __name__ == "__main__":
    main()
