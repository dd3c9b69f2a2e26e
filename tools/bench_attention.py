"""Attention benchmark: `python -m llmc.tools.bench_attention [--dtype bfloat16|float32]
[--kv-dtype auto|int8] [--lens 512,1024,2048,4096] [--decode [S:LO:HI,...]] [--threads N]`.

At SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head_dim 64), one prompt of T
tokens read from a paged KV cache, and a mixed step (a 512-token chunk over 512 cached tokens
plus 32 decodes of 300-700 tokens). Times, in the same run:
  tiled     the native kernel (`paged_attention`: prompt chunks as tiles of small GEMMs)
  rows      the one-query-at-a-time kernel it replaced (`paged_attention_rows`)
  sdpa      the peer: torch's F.scaled_dot_product_attention(is_causal=True) on contiguous
            q, k, v (no paging; not run for the mixed step)
and prints milliseconds, GFLOP/s of the tiled kernel (4 * D * H per causal query-key pair) and
the ratios.

`--decode` times batched decode steps instead (one query per sequence, as the serving loop's
decode attention runs): per entry S:LO:HI, S sequences of random lengths LO..HI whose blocks
are scattered over a cache of several layers (each call reads the next layer, so the K/V come
from memory, not from the last call's L3). It prints ms per call for `paged_attention` (new:
attention_decode.h) and `paged_attention_rows` (old: the row-by-row decode it replaced, a
block widened into scratch and a horizontal sum per key), the K/V bytes one call reads, both
kernels' GB/s, the new one's fraction of the read bandwidth measured in the same run
(`read_floor.read_bandwidth`, the native read floor), and old/new. The cache lies on huge pages
as an engine's does (runtime/huge_pages.py); base/huge is the new kernel on a copy of it in
torch's memory (base pages) over the same on huge pages, the median of calls alternating between
them on the same layer. `--dtype float32 --kv-dtype int8` times an int8 cache under f32 q.
A benchmark, not a test: the numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from llmc.kernels.native import load_native_kernels
from llmc.kernels.quant import quantize_kv_rows
from llmc.runtime.huge_pages import huge_page_zeros
from llmc.tools.bench_kernels import BLOCK, HEAD_DIM, HEADS, KV_HEADS, step_layout
from llmc.tools.read_floor import read_bandwidth, seconds_of

DECODE_STEPS = "64:100:500,8:1000:4000"
COLD_BYTES = 256 * 2**20        # K/V cycled through per decode step: well past the L3


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


def decode_layout(lens: list[int], dtype: torch.dtype, kv_dtype: str, rng: random.Random):
    """A cache of enough layers to hold COLD_BYTES, each sequence's blocks in random places, on huge
    pages as an engine's cache (runtime/huge_pages.py), and the int32 block tables; returns (cache,
    tables, bytes of K/V one layer's call reads)."""
    needed = [-(-n // BLOCK) for n in lens]
    order = list(range(sum(needed)))
    rng.shuffle(order)
    starts = list(itertools.accumulate(needed, initial=0))
    width = max(needed)
    tables = torch.tensor([order[a:b] + [0] * (width - (b - a)) for a, b in zip(starts, starts[1:])],
                          dtype=torch.int32)
    row = HEAD_DIM * torch.finfo(dtype).bits // 8 if kv_dtype != "int8" else HEAD_DIM + 4
    layer_bytes = 2 * len(order) * KV_HEADS * BLOCK * row
    layers = max(1, min(64, COLD_BYTES // layer_bytes))
    cache = torch.randn(layers, 2, len(order), KV_HEADS, BLOCK, HEAD_DIM).to(dtype)
    if kv_dtype == "int8":
        cache = quantize_kv_rows(cache)
    placed = huge_page_zeros(tuple(cache.shape), cache.dtype, "the benchmark's KV cache")   # as an engine's
    return placed.copy_(cache), tables, 2 * sum(lens) * KV_HEADS * row


def time_decode(seqs: int, lo: int, hi: int, dtype: torch.dtype, kv_dtype: str, rng: random.Random) -> tuple:
    """(new s, old s, K/V bytes, base/huge) per call of a decode step of `seqs` sequences of lo..hi
    tokens; base/huge: the new kernel on a copy of the cache in torch's memory (base pages) over the
    same on huge pages, the median of calls alternating between the two on the same layer."""
    lens = [rng.randint(lo, hi) for _ in range(seqs)]
    cache, tables, kv_bytes = decode_layout(lens, dtype, kv_dtype, rng)
    q = torch.randn(seqs, HEADS * HEAD_DIM).to(dtype)
    seq_lens, qsl = torch.tensor(lens, dtype=torch.int32), torch.arange(seqs + 1, dtype=torch.int32)
    layers = itertools.cycle(range(cache.shape[0]))

    def call(op, kv=cache, layer=None):
        return lambda: op(q, kv, tables, seq_lens, qsl, next(layers) if layer is None else layer, HEAD_DIM ** -0.5)
    new = seconds_per_call(call(torch.ops.llmc.paged_attention))
    old = seconds_per_call(call(torch.ops.llmc.paged_attention_rows))
    base, ratios = cache.clone(), []
    for i, layer in zip(range(max(20, int(0.5 / new))), layers):
        order = (cache, base) if i % 2 else (base, cache)       # neither side always first
        seconds = {id(kv): seconds_of(call(torch.ops.llmc.paged_attention, kv, layer)) for kv in order}
        ratios.append(seconds[id(base)] / seconds[id(cache)])
    return new, old, kv_bytes, statistics.median(ratios)


def run_decode(spec: str, dtype: torch.dtype, kv_dtype: str) -> None:
    rng = random.Random(0)
    bandwidth = read_bandwidth()
    print(f"read bandwidth (the native read floor): {bandwidth / 1e9:.1f} GB/s")
    print(f"{'decode step':<22}{'new ms':>9}{'old ms':>9}{'KV MB':>8}{'new GB/s':>10}{'of read':>9}"
          f"{'old GB/s':>10}{'old/new':>9}{'base/huge':>11}")
    for entry in spec.split(","):
        seqs, lo, hi = map(int, entry.split(":"))
        new, old, kv_bytes, pages = time_decode(seqs, lo, hi, dtype, kv_dtype, rng)
        print(f"{f'{seqs} x {lo}-{hi} tokens':<22}{1e3 * new:>9.3f}{1e3 * old:>9.3f}{kv_bytes / 1e6:>8.2f}"
              f"{kv_bytes / new / 1e9:>10.1f}{kv_bytes / new / bandwidth:>8.0%}{kv_bytes / old / 1e9:>10.1f}"
              f"{old / new:>8.2f}x{pages:>10.2f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--kv-dtype", default="auto", choices=["auto", "int8"])
    parser.add_argument("--lens", default="512,1024,2048", help="prompt lengths, comma-separated")
    parser.add_argument("--decode", nargs="?", const=DECODE_STEPS, default="",
                        help=f"time decode steps S:LO:HI,... instead (default {DECODE_STEPS})")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    load_native_kernels()
    torch.manual_seed(0)
    if args.decode:
        print(f"decode attention, {args.dtype} q, {args.kv_dtype} KV cache, {torch.get_num_threads()} threads, "
              f"{HEADS} heads / {KV_HEADS} KV heads / head_dim {HEAD_DIM}, block {BLOCK}")
        return run_decode(args.decode, dtype, args.kv_dtype)
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
