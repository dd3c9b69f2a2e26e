"""Prompt attention benchmark: `python -m llmc.tools.bench_attention [--dtype bfloat16|float32]
[--kv-dtype auto|int8] [--lens 512,1024,2048,4096] [--threads N]`.

At SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head_dim 64), one prompt of T
tokens read from a paged KV cache, and a mixed step (a 512-token chunk over 512 cached tokens
plus 32 decodes of 300-700 tokens). Times, in the same run:
  tiled     the native kernel (`paged_attention`: prompt chunks as tiles of small GEMMs)
  rows      the one-query-at-a-time kernel it replaced (`paged_attention_rows`)
  sdpa      the peer: torch's F.scaled_dot_product_attention(is_causal=True) on contiguous
            q, k, v (no paging; not run for the mixed step)
and prints milliseconds, GFLOP/s of the tiled kernel (4 * D * H per causal query-key pair) and
the ratios. A benchmark, not a test: the numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Callable

import torch
import torch.nn.functional as F

from llmc.kernels.native import load_native_kernels
from llmc.kernels.quant import quantize_kv_rows
from llmc.tools.bench_kernels import BLOCK, HEAD_DIM, HEADS, KV_HEADS, step_layout


def seconds_per_call(fn: Callable[[], object], budget: float = 1.0) -> float:
    """Best-of-3 mean over enough calls to fill about `budget` seconds."""
    start = time.perf_counter()
    fn()
    repeat = max(1, min(50, int(budget / max(time.perf_counter() - start, 1e-6))))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best


def causal_pairs(chunks: list[int], lens: list[int]) -> int:
    """Query-key pairs a causal step computes: query i of a chunk of n over L sees L - n + i + 1."""
    return sum(n * (length - n) + n * (n + 1) // 2 for n, length in zip(chunks, lens))


def time_step(chunks: list[int], lens: list[int], dtype: torch.dtype, kv_dtype: str, peer: bool) -> tuple:
    cache, tables, seq_lens, qsl = step_layout(chunks, lens, dtype)
    if kv_dtype == "int8":
        cache = quantize_kv_rows(cache)
    q = torch.randn(sum(chunks), HEADS * HEAD_DIM).to(dtype)
    args = (q, cache, tables, seq_lens, qsl, 0, HEAD_DIM ** -0.5)
    tiled = seconds_per_call(lambda: torch.ops.llmc.paged_attention(*args))
    rows = seconds_per_call(lambda: torch.ops.llmc.paged_attention_rows(*args))
    sdpa = float("nan")
    if peer:
        qh = q.view(1, -1, HEADS, HEAD_DIM).transpose(1, 2)                        # [1, H, T, D]
        kh, vh = (torch.randn(1, KV_HEADS, sum(chunks), HEAD_DIM).to(dtype) for _ in range(2))
        sdpa = seconds_per_call(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True))
    flops = 4 * HEAD_DIM * HEADS * causal_pairs(chunks, lens)
    return tiled, rows, sdpa, flops / tiled / 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--kv-dtype", default="auto", choices=["auto", "int8"])
    parser.add_argument("--lens", default="512,1024,2048", help="prompt lengths, comma-separated")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    load_native_kernels()
    torch.manual_seed(0)
    rng = random.Random(0)
    steps = [(f"prompt {n}", [n], [n], True) for n in map(int, args.lens.split(","))]
    decodes = [rng.randint(300, 700) for _ in range(32)]
    steps.append(("512 over 512 + 32 decodes", [512] + [1] * 32, [1024] + decodes, False))
    print(f"attention, {args.dtype} q, {args.kv_dtype} KV cache, {torch.get_num_threads()} threads, "
          f"{HEADS} heads / {KV_HEADS} KV heads / head_dim {HEAD_DIM}, block {BLOCK}")
    print(f"{'step':<28}{'tiled ms':>10}{'rows ms':>10}{'sdpa ms':>10}{'GFLOP/s':>9}"
          f"{'rows/tiled':>11}{'sdpa/tiled':>11}")
    for label, chunks, lens, peer in steps:
        tiled, rows, sdpa, gflops = time_step(chunks, lens, dtype, args.kv_dtype, peer)
        print(f"{label:<28}{1e3 * tiled:>10.2f}{1e3 * rows:>10.2f}{1e3 * sdpa:>10.2f}{gflops:>9.1f}"
              f"{rows / tiled:>10.2f}x{sdpa / tiled:>10.2f}x")


if __name__ == "__main__":
    main()
