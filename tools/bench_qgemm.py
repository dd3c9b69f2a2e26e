"""Quantized GEMM benchmark on a GPU: `python -m llmc.tools.bench_qgemm [--dtype float16|bfloat16]`.

Times kernels/triton/qgemm.py on int8 (per output channel, and GGUF Q8_0's groups of 32) and
int4 (groups of 32 and 128) weights against its peers measured in the same run: the float Triton
GEMM (kernels/triton/gemm.py) and F.linear (cuBLAS) on the fp16/bf16 weight, at Llama-3-8B's layer
GEMM shapes and decode-to-prefill token counts, each with the configs codegen would pick. Prints
microseconds per call, the ratio to the float Triton GEMM, and the weight bytes streamed per
second (what bounds decode). A benchmark, not a test: the numbers depend on the GPU.
`--device cpu` runs the same code on tiny shapes in Triton's interpreter (TRITON_INTERPRET=1),
only to check that it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

from llmc.kernels.quant import quantize_int4, quantize_int8
from llmc.kernels.triton.gemm import linear_triton
from llmc.kernels.triton.qgemm import qlinear_triton

# (name, N_w, K, gated): qkv, o, gate_up (merged, SiLU-and-multiply), down
LLAMA3_8B = [("qkv", 6144, 4096, False), ("o", 4096, 4096, False), ("gate_up", 28672, 4096, True),
             ("down", 4096, 14336, False)]
TINY = [("qkv", 96, 128, False), ("gate_up", 160, 128, True)]
FORMATS = [("int8", 8, None), ("q8_0", 8, 32), ("int4-g32", 4, 32), ("int4-g128", 4, 128)]


def us_per_call(fn, device: torch.device) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        return 1000 * do_bench(fn, warmup=25, rep=100)
    fn()
    start = time.perf_counter()
    fn()
    return 1e6 * (time.perf_counter() - start)


def quantized(w: torch.Tensor, bits: int, group: int | None) -> tuple:
    if bits == 8:
        codes, scales = quantize_int8(w, group)
        return codes, scales, None, group or w.shape[1]
    return (*quantize_int4(w, group), group)


def bench_gemm(name: str, n_w: int, K: int, gated: bool, tokens: int, dtype: torch.dtype, device) -> list[str]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n_w, K, generator=g) / K ** 0.5
    x = torch.randn(tokens, K, generator=g).to(dtype).to(device)
    w_float = w.to(dtype).to(device)
    float_us = us_per_call(lambda: linear_triton(x, w_float, gated=gated), device)
    cublas_us = us_per_call(lambda: F.linear(x, w_float), device)
    rows = [f"{name:<8} T={tokens:<5} {'triton ' + str(dtype)[6:]:<22} {float_us:9.1f} us   1.00x  "
            f"{w_float.numel() * w_float.element_size() / float_us / 1e3:7.1f} GB/s",
            f"{'':<8} {'':<7} {'F.linear (no epilogue)':<22} {cublas_us:9.1f} us  {float_us / cublas_us:5.2f}x"]
    for label, bits, group in FORMATS:
        codes, scales, mins, group_size = quantized(w, bits, group)
        codes, scales = codes.to(device), scales.to(device)
        mins = None if mins is None else mins.to(device)
        us = us_per_call(lambda: qlinear_triton(x, codes, scales, mins, bits=bits, group_size=group_size,
                                                gated=gated), device)
        weight_bytes = sum(t.numel() * t.element_size() for t in (codes, scales, mins) if t is not None)
        rows.append(f"{'':<8} {'':<7} {label:<22} {us:9.1f} us  {float_us / us:5.2f}x  "
                    f"{weight_bytes / us / 1e3:7.1f} GB/s")
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU here; `--device cpu` with TRITON_INTERPRET=1 only checks that the benchmark runs")
        return 1
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("--device cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
        return 1
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    shapes, token_counts = (LLAMA3_8B, [1, 16, 128, 512]) if device.type == "cuda" else (TINY, [1, 5])
    print(f"{'gemm':<8} {'tokens':<7} {'kernel':<22} {'time':>12}  {'vs float':>8}  weight streamed")
    for name, n_w, K, gated in shapes:
        for tokens in token_counts:
            print("\n".join(bench_gemm(name, n_w, K, gated, tokens, dtype, device)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
