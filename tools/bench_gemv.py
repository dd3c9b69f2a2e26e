"""GEMV benchmark: `python -m llmc.tools.bench_gemv [--tokens 1,2,4,...,512] [--resident ART]`.

At SmolLM2-135M's GEMM shapes (hidden 576, 9 + 2x3 heads of 64, MLP 1536, vocab 49152), batch 1:
per weight format (f32, bf16, int8 per channel, int8-g32, int4-g32 in panels for float x, and
int8-g32-a8, int4-g32-a8 in quads for int8 x, the quantized artifacts' default) the time of one
call of the native kernel (kernels/gemv.py), the bytes it must read (panels, or codes, scales and
mins; x is noise), the GB/s that makes and its fraction of the read bandwidth measured in the same
run (tools/read_floor.py's floor); oneDNN's packed GEMM (kernels/linear.py) at f32 and bf16 is
the peer. Each weight is copied until the copies fill 256 MiB and the calls cycle through them, so
every call reads from memory, not from the 32 MiB-class caches, as a decode step does.
Then the crossover: one layer's four GEMMs at several token counts, the panels against oneDNN on
its own packed copy (what llmc kept beside every float weight before the panels) and oneDNN with
a per-call reorder (what a weight kept only in its plain layout would get); and quantized: the same
layer in int8 and int4 (groups of 32) with int8 activations and with f32 prompts, against fp32's panels.
With --resident ART: the weight bytes an engine on the native kernels keeps for an artifact (the
distinct tensor storages its programs hold, against the artifact's stored bytes) and the process's
resident memory before the engine, after building it and after a prefill and 4 decode steps.
A benchmark, not a test: the numbers depend on the machine; read them as ratios within one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path
from typing import Callable

import torch

from llmc.kernels.gemv import GemvWeight, gemv_cpu, prepare_linear_weight, prepare_qlinear_weight
from llmc.kernels.linear import PackedLinear, onednn_linear, onednn_packs
from llmc.kernels.native import load_native_kernels
from llmc.kernels.quant import quantize_int4, quantize_int8
from llmc.tools.profile_steps import cpu_name
from llmc.tools.read_floor import read_bandwidth

HIDDEN, MLP, VOCAB = 576, 1536, 49152
SHAPES = {"q/o": (HIDDEN, HIDDEN), "qkv": (HIDDEN + 2 * 192, HIDDEN), "gate_up": (2 * MLP, HIDDEN),
          "down": (HIDDEN, MLP), "lm_head": (VOCAB, HIDDEN)}
FORMATS = ("f32", "bf16", "int8", "int8-g32", "int4-g32", "int8-g32-a8", "int4-g32-a8")
COLD_BYTES = 256 * 2**20


def prepare(w: torch.Tensor, fmt: str) -> GemvWeight:
    """`w` [N, K] fp32 in `fmt` as the native kernel takes it."""
    if fmt in ("f32", "bf16"):
        return prepare_linear_weight(w.to(torch.float32 if fmt == "f32" else torch.bfloat16))
    group = int(fmt.split("-g")[1].split("-")[0]) if "-g" in fmt else w.shape[1]
    acts = "int8" if fmt.endswith("-a8") else "float"
    if fmt.startswith("int8"):
        return prepare_qlinear_weight(*quantize_int8(w, group), None, bits=8, group_size=group, activations=acts)
    return prepare_qlinear_weight(*quantize_int4(w, group), bits=4, group_size=group, activations=acts)


def copies(w: GemvWeight) -> list[GemvWeight]:
    """Copies of `w` filling COLD_BYTES (at least 2), so cycling through them misses the caches."""
    count = max(2, -(-COLD_BYTES // w.nbytes))
    clone = lambda t: None if t is None else t.clone()  # noqa: E731
    return [dataclasses.replace(w, weight=w.weight.clone(), scales=clone(w.scales), mins=clone(w.mins))
            for _ in range(count)]


def seconds_per_call(calls: list[Callable[[], object]], rounds: int = 12) -> float:
    """Best over `rounds` of the mean time of one call, cycling through `calls` (one warm-up round)."""
    best = float("inf")
    for i in range(rounds + 1):
        start = time.perf_counter()
        for call in calls:
            call()
        if i:
            best = min(best, (time.perf_counter() - start) / len(calls))
    return best


def format_rows(tokens: int, dtype: torch.dtype, bandwidth: float) -> list[str]:
    rows = []
    for shape_name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * 0.05
        for fmt in FORMATS:
            ws = copies(prepare(w, fmt))
            xdtype = torch.float32 if fmt == "f32" else dtype if fmt != "bf16" else torch.bfloat16
            x = torch.randn(tokens, k).to(xdtype)
            s = seconds_per_call([lambda w=w: gemv_cpu(x, w) for w in ws])
            path = "quads" if ws[0].layout == "quads" else "panels"
            rows.append(_row(shape_name, fmt, path, s, ws[0].nbytes, bandwidth))
            del ws
        for fmt, fdtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
            if not onednn_packs(fdtype):
                rows.append(f"{shape_name:<9}{fmt:<13}oneDNN packed: not on this CPU (bf16 needs AVX512-BW)")
                continue
            w_f = w.to(fdtype)
            count = max(2, -(-COLD_BYTES // (w_f.numel() * w_f.element_size())))
            packed = [PackedLinear(w_f.clone()) for _ in range(count)]
            x = torch.randn(tokens, k).to(fdtype)
            s = seconds_per_call([lambda p=p: p(x) for p in packed])
            rows.append(_row(shape_name, fmt, "oneDNN packed", s, w_f.numel() * w_f.element_size(), bandwidth))
            del packed
    return rows


def _rescale(row: str, factor: float) -> str:
    """A printed row with its fraction of the bandwidth multiplied by `factor` (a row saying why a path did
    not run, which has none, as it is)."""
    if not row.endswith("%"):
        return row
    head, fraction = row[:-8], float(row[-8:].strip().rstrip("%"))
    return f"{head}{fraction * factor:>7.0f}%"


def _row(shape: str, fmt: str, path: str, seconds: float, nbytes: int, bandwidth: float) -> str:
    rate = nbytes / seconds
    return (f"{shape:<9}{fmt:<13}{path:<15}{1e6 * seconds:>9.1f}{nbytes / 1e6:>9.2f}{rate / 1e9:>8.1f}"
            f"{100 * rate / bandwidth:>7.0f}%")


def crossover_rows(token_counts: list[int], dtype: torch.dtype) -> list[str]:
    """One layer's four GEMMs (warm: they fit the L3 cache) at each token count: the panels, oneDNN
    packed (a second copy beside the weight), oneDNN with a per-call reorder (no second copy)."""
    layer = [SHAPES[s] for s in ("qkv", "q/o", "gate_up", "down")]
    weights = [(torch.randn(n, k) * 0.05).to(dtype) for n, k in layer]
    panels = [prepare_linear_weight(w) for w in weights]
    if not onednn_packs(dtype):
        return [f"oneDNN cannot pack {dtype} weights on this CPU (it needs AVX512-BW or AVX-NE-CONVERT)"]
    packed = [PackedLinear(w) for w in weights]
    rows = []
    for t in token_counts:
        xs = [torch.randn(t, w.shape[1]).to(dtype) for w in weights]
        ours = seconds_per_call([lambda: [gemv_cpu(x, w) for x, w in zip(xs, panels)]], 20)
        peer = seconds_per_call([lambda: [p(x) for p, x in zip(packed, xs)]], 20)
        reorder = seconds_per_call([lambda: [onednn_linear(x, w, None) for x, w in zip(xs, weights)]], 20)
        rows.append(f"T={t:<5}{1e3 * ours:>10.3f}{1e3 * peer:>10.3f}{1e3 * reorder:>10.3f}{peer / ours:>9.2f}x"
                    f"{reorder / ours:>9.2f}x")
    return rows


def quantized_layer(layer: list[torch.Tensor]) -> dict[str, list[GemvWeight]]:
    """The weights of `layer` as the fp32 panels, and int8 and int4 in groups of 32 as quads with int8
    activations and with f32 prompts (the weight dequantized to fp32 from F32_PROMPT_MIN_TOKENS tokens)."""
    formats = {"fp32": [prepare_linear_weight(w) for w in layer]}
    for fmt in ("int8-g32", "int4-g32"):
        quads = [prepare(w, f"{fmt}-a8") for w in layer]
        formats[f"{fmt[:4]} a8"] = quads
        formats[f"{fmt[:4]} f32 prompts"] = [dataclasses.replace(w, prompts="f32") for w in quads]
    return formats


def quantized_crossover_rows(token_counts: list[int]) -> list[str]:
    """One layer's four GEMMs (warm) at each token count, x fp32, in each of quantized_layer's formats: ms
    per layer, and the fp32 panels' time over it."""
    formats = quantized_layer([(torch.randn(*SHAPES[s]) * 0.05) for s in ("qkv", "q/o", "gate_up", "down")])
    rows = [f"{'':<7}" + "".join(f"{name:>17}" for name in formats)]
    for t in token_counts:
        xs = [torch.randn(t, w.in_features) for w in formats["fp32"]]
        times = [seconds_per_call([lambda ws=ws: [gemv_cpu(x, w) for x, w in zip(xs, ws)]], 20)
                 for ws in formats.values()]
        rows.append(f"T={t:<5}" + "".join(f"{1e3 * s:>9.3f} ({times[0] / s:4.2f}x)" for s in times))
    return rows


def _storage_bytes(t: torch.Tensor) -> tuple[int, int]:
    return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


def resident_rows(artifact: str) -> list[str]:
    """Weight storage held by a native-kernel engine for `artifact`, and the process's RSS."""
    from llmc.runtime.engine import Engine, EngineConfig
    from llmc.tools.profile_steps import profile_decode

    rss = lambda: int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6  # noqa: E731
    before = rss()
    engine = Engine(artifact, EngineConfig(backend_options={"kernels": "native"}))
    built = rss()
    profile_decode(engine, 4)
    storages = {}
    for program in engine.runner.executor.programs.values():
        for value in program.constants:
            parts = [value.weight, value.scales, value.mins] if isinstance(value, GemvWeight) else [value]
            storages.update(_storage_bytes(t) for t in parts if t is not None)
    stored = sum(t.numel() * t.element_size() for t in engine.artifact.weights.values())
    held = sum(storages.values())
    return [f"artifact weights {stored / 1e6:.1f} MB stored; the programs hold {held / 1e6:.1f} MB in "
            f"{len(storages)} storages ({held / stored:.3f}x: one copy, GEMM weights as panels of 32 rows)",
            f"RSS {before:.0f} MB before the engine, {built:.0f} MB built, {rss():.0f} MB after a prefill and 4 decode "
            f"steps (+{rss() - before:.0f} MB)"]


def token_counts(text: str) -> list[int]:
    """--tokens: comma-separated positive counts."""
    try:
        counts = [int(t) for t in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of token counts; "
                                         "give positive integers such as 1,16,64")
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512", type=token_counts,
                        help="token counts of the crossover tables")
    parser.add_argument("--x-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="x's dtype for the quantized formats")
    parser.add_argument("--skip-crossover", action="store_true")
    parser.add_argument("--resident", metavar="ART", help="only report the resident weight memory of an artifact")
    args = parser.parse_args(argv)
    load_native_kernels()
    if args.resident:
        print("\n".join(resident_rows(args.resident)))
        return
    torch.manual_seed(0)
    bandwidth = read_bandwidth()
    rows = format_rows(1, getattr(torch, args.x_dtype), bandwidth)
    again = read_bandwidth()              # on a shared machine the floor moves: the higher one is the floor
    if again > bandwidth:
        rows = [_rescale(row, bandwidth / again) for row in rows]
    print(f"{cpu_name()} | torch threads {torch.get_num_threads()} | load average {os.getloadavg()[0]:.1f} | "
          f"read bandwidth {max(bandwidth, again) / 1e9:.1f} GB/s (the native read floor, best of two in this run) | "
          f"batch 1, cold weights, quantized x {args.x_dtype}")
    print(f"{'GEMM':<9}{'format':<13}{'path':<15}{'us/call':>9}{'MB':>9}{'GB/s':>8}{'of bw':>8}")
    for row in rows:
        print(row)
    if args.skip_crossover:
        return
    for dtype in (torch.float32, torch.bfloat16):
        print(f"\none layer's GEMMs (qkv, o, gate_up, down), {str(dtype)[6:]}, ms per layer: panels | oneDNN packed | "
              f"oneDNN reorder per call | packed/panels | reorder/panels")
        for row in crossover_rows(args.tokens, dtype):
            print(row)
    print("\none layer's GEMMs (qkv, o, gate_up, down), quantized in groups of 32, x float32, ms per layer (and the "
          "fp32 panels' time over it)")
    for row in quantized_crossover_rows(args.tokens):
        print(row)


if __name__ == "__main__":
    main()
