"""Compile every Triton kernel for a GPU on a machine without one, and check it fits the GPU:
`python -m llmc.kernels.triton.aot_compile [--quick | --tiles] [--shard=I/N] [ARTIFACT ...]`.

Triton's interpreter runs any shapes and types numpy accepts, so a kernel that passes every
interpreter test can still fail to compile for a GPU (a dot below 16 on K, a broadcast the IR
rejects, a pointer cast, a dtype a GPU op does not take), and the interpreter's bf16 dot is wrong,
so the bf16 tests take fp32 dots on CPU tensors and the GPU's bf16 path runs nowhere here.

How: the launchers themselves run, on tensors of the `meta` device (shapes, dtypes and strides, no
memory), while Triton's driver is one that names an sm_90 GPU (H100/H200) and launches nothing
(sm90_target.py). Every `kernel[grid](...)` then goes through Triton's own argument specialization
(pointer dtypes, 16-byte divisibility, ints equal to 1) and its first-call compile, TTIR -> TTGIR
-> LLVM -> PTX -> cubin with the wheel's own ptxas, with the launcher's own choices: block sizes
per M bucket, dtype and weight format, num_warps and num_stages, and tensor-core dots for bf16
and fp16 (the launchers upcast bf16 on CPU tensors only). What is compiled is what a GPU step
compiles first; a kernel already compiled for the same specialization is compiled once.

Resources: each compiled kernel is loaded as on a GPU (Triton's CompiledKernel._init_handles, the
stand-in driver answering from the cubin), and its line shows Triton's n_regs, its local memory
(4 * n_spills), the bytes of it that ptxas -v counts as register spills, and metadata.shared. A
spill, or shared memory over sm_90's 227 KiB a block (Triton's own OutOfResources), FAILs like a
compile error; local memory that is no spill (sin/cos's range reduction keeps a 28-byte array
there) passes.

Cases: every template in fp16, bf16 and fp32 at SmolLM2-135M's sizes: the GEMM with each epilogue
on the decode and the prefill tile, and with the heaviest epilogues at every M specialization of
every bucket of pick_config (and a K that is not a multiple of 16), the GEMM with its RMSNorm
prologue and the QKV GEMM with RoPE + KV write, the dequantizing GEMM for every weight format
likewise, the RoPE + KV write, paged decode (both stages) and prefill attention over a float and
an int8 cache, with a head_dim that is a power of two and one that is not, the row gather and the
quantized gather. --quick keeps fp16 and bf16, one or two of each; --tiles (tile_cases) each
template's launch configs once per dtype, weight format and cache. Each ARTIFACT (compiled with
`llmc compile --target cuda`) adds every kernel its generated modules launch in prefill and decode
steps (compiler/codegen/aot.py: every M bucket; --quick one step of each; --tiles the prefill and
decode tiles). --shard=I/N takes every N-th case from the I-th, for N processes at once. Each
compile prints OK or FAIL, then a count by dtype; the exit status is the number of failures. Two
checks read the PTX: the int8 KV writer divides with div.rn.f32 only (rounding as torch does), and
the GEMMs' and attention's fp16/bf16 dots are tensor-core instructions on fp16/bf16 operands
(mma.sync, or wgmma on sm_90), not fp32 FMAs. It must run without TRITON_INTERPRET=1 (the kernels
are decorated as interpreted functions otherwise), and it changes Triton's driver for the rest of
the process. It proves compilation and fit only, not numbers or speed: those need the GPU tests.
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from itertools import product
from pathlib import Path

import torch

from llmc.compiler.codegen.aot import END_ROWS, QUICK_ROWS, STEP_ROWS_OF, Case, artifact_cases
from llmc.compiler.quant_format import KV_SCALE_BYTES

from .sm90_target import SM90, NoLaunchDriver, kernel_resources

# The int8 KV writer must divide exactly as torch does (scale = amax / 127, x / scale): Triton's
# `/` on fp32 is div.full.f32 (approximate) on NVIDIA GPUs, tl.math.div_rn is div.rn.f32.
APPROXIMATE_DIVISION = ("div.full.f32", "div.approx.f32")
TENSOR_CORE_TYPES = {"fp16": "f16", "bf16": "bf16"}         # Triton's pointer dtype -> PTX's mma operand type
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
GEMM_ROWS = (1, 24, 64, 200)        # pick_config's buckets: decode tile, M <= 32, M <= 64, prefill tile
# Each bucket's M specializations (Triton's: M = 1, M a multiple of 16, any other M); K 72: a width
# not a multiple of 16 (tiny test models'), loaded element by element
EVERY_M = (1, 8, 16, 24, 32, 37, 64, 200, 256)
TILE_M = (1, 24, 37, 200)           # one of each bucket's tiles, M not a multiple of 16 (its masks)
# SmolLM2-135M's GEMMs: the merged gate/up ([2 x 1536, 576]: K 576), the down projection (K 1536)
K, N_W, QK, QN_W = 576, 3072, 1536, 1152
UNALIGNED_K = 72
EPILOGUES = {"none": {}, "bias": dict(bias=True), "silu": dict(activation="silu"), "gated": dict(gated=True),
             "residual": dict(residual=True), "bias+gated+residual": dict(bias=True, gated=True, residual=True),
             "geglu": dict(activation="gelu_tanh", gated=True), "softcap": dict(softcap=30.0),   # Gemma's
             "bias+silu+residual": dict(bias=True, activation="silu", residual=True)}
# The epilogues that hold the most registers: two accumulators and code tiles (gated), or the full
# N tile with a residual tile beside it (not gated)
HEAVIEST = ("bias+gated+residual", "bias+silu+residual")
WEIGHT_FORMATS = {"int8": (8, None), "q8_0": (8, 32), "int4-g32": (4, 32), "int4-g128": (4, 128)}  # bits, group
# (heads, KV heads, head_dim): SmolLM2-135M's, and a head_dim padded to a power of two with masks
HEAD_SHAPES = ((9, 3, 64), (6, 2, 80))
BLOCK_SIZE, CACHE_BLOCKS, TABLE_WIDTH = 16, 64, 8
MODES = {"": STEP_ROWS_OF, "--quick": QUICK_ROWS, "--tiles": END_ROWS}    # mode -> an artifact's steps


@dataclass(frozen=True)
class Compile:
    case: str
    dtype: str
    kernel: str                     # the kernel's name, or "(launcher)" if the case failed outside a compile
    details: str                    # block sizes and other constexprs of the specialization
    error: str | None
    shared: int | None = None       # bytes of shared memory a block takes (Triton's metadata.shared)
    registers: int | None = None    # per thread (Triton's n_regs); None if not loaded (too much shared memory)
    local: int | None = None        # bytes of local memory a thread takes (4 * Triton's n_spills)
    spilled: int | None = None      # bytes of those that are register spill stores (ptxas -v)


def _exact_division(constexprs: dict, signature: dict, ptx: str) -> str | None:
    """The int8 KV writer divides with div.rn.f32 only; None if so (or if the cache is a float one)."""
    if not constexprs.get("KV_INT8"):
        return None
    found = [op for op in APPROXIMATE_DIVISION if op in ptx]
    return f"the int8 KV writer's PTX divides with {found or 'no div.rn.f32'}" \
        if found or "div.rn.f32" not in ptx else None


def _tensor_core_dots(operand: str) -> Callable[[dict, dict, str], str | None]:
    """fp16/bf16 `operand` (a pointer argument): its dots compile to mma or wgmma instructions on
    operands of its dtype (an upcast to fp32 dots, right for the interpreter only, would not)."""
    def check(constexprs: dict, signature: dict, ptx: str) -> str | None:
        dtype = signature[operand].lstrip("*")
        if dtype not in TENSOR_CORE_TYPES:
            return None
        ptx_type = TENSOR_CORE_TYPES[dtype]
        if re.search(rf"\bmma\S*\.{ptx_type}\.{ptx_type}\b", ptx) is None:     # mma.sync.., wgmma.mma_async..
            return f"{operand} is {dtype} but no dot compiles to a {ptx_type} tensor-core instruction (mma/wgmma)"
        return None
    return check


PTX_CHECKS = {"_rope_kv_write_kernel": _exact_division, "_linear_kernel": _tensor_core_dots("x_ptr"),
              "_qlinear_kernel": _tensor_core_dots("x_ptr"), "_decode_split_kernel": _tensor_core_dots("q_ptr"),
              "_prefill_kernel": _tensor_core_dots("q_ptr")}


class AheadOfTime:
    """While installed, each Triton launch compiles for `target` and launches nothing; `run(case)`
    returns the compiles the case caused, failed ones included (the case carries on after one)."""

    def __init__(self, target):
        from triton.runtime.jit import JITFunction

        self.target, self.jit = target, JITFunction
        self.compiles: list[Compile] = []
        self.case: Case | None = None

    def install(self) -> "AheadOfTime":
        from triton.runtime.driver import driver

        driver.set_active(NoLaunchDriver(self.target))
        run, do_compile, aot = self.jit.run, self.jit._do_compile, self

        def compile_only(jit, *args, grid, warmup, **kwargs):
            try:
                return run(jit, *args, grid=grid, warmup=True, **kwargs)
            except _Reported:
                return None

        def recorded(jit, key, signature, device, constexprs, options, attrs, warmup):
            names = {(i,): name for i, name in enumerate(jit.arg_names)}
            values = {names[path]: value for path, value in constexprs.items() if path in names}
            try:
                kernel = do_compile(jit, key, signature, device, constexprs, options, attrs, warmup)
            except Exception as exc:          # noqa: BLE001 (every compile error is reported, then counted)
                aot.record(jit, values, options, f"{type(exc).__name__}: {str(exc)[:800]}\n     {signature}")
                raise _Reported from exc
            check = PTX_CHECKS.get(jit.__name__)
            used, error = kernel_resources(kernel)
            error = error or (check(values, signature, kernel.asm["ptx"]) if check else None)
            aot.record(jit, values, options, error, used)
            return kernel

        self.jit.run, self.jit._do_compile = compile_only, recorded
        return self

    def record(self, jit, constexprs: dict, options, error: str | None, used: dict | None = None) -> None:
        """One compile of `jit`; `used`: its resources (kernel_resources), None if it failed."""
        shown = " ".join(f"{k}={v}" for k, v in constexprs.items() if v is not None and not isinstance(v, bool))
        flags = "+".join(k for k, v in constexprs.items() if v is True)
        details = f"{shown} {flags} w{options.num_warps} s{options.num_stages}".replace("  ", " ")
        self.compiles.append(Compile(self.case.label, self.case.dtype, jit.__name__, details, error, **(used or {})))

    def run(self, case: Case) -> list[Compile]:
        self.case, first = case, len(self.compiles)
        try:
            case.launch()
        except Exception as exc:              # noqa: BLE001 (a launcher that cannot run is a failure too)
            self.compiles.append(Compile(case.label, case.dtype, "(launcher)", "",
                                         f"{type(exc).__name__}: {str(exc)[:800]}"))
        return self.compiles[first:]


class _Reported(Exception):
    """A compile error already recorded: the launch is skipped and its case goes on."""


def meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _quantized(rows: int, width: int, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes, scales, mins) of a [rows, width] weight as compiler/quant_format.py stores it; int8 has no mins."""
    codes = meta(rows, width, dtype=torch.int8) if bits == 8 else meta(rows, width // 2, dtype=torch.uint8)
    scales = meta(rows, width // group, dtype=torch.float16)
    return codes, scales, scales if bits == 4 else None


def _gemm(launcher: Callable, x: torch.Tensor, weight: tuple, epilogue: dict, **options) -> None:
    """`launcher` (linear_triton or qlinear_triton) on x and `weight` with `epilogue`'s operands."""
    n_w, gated = weight[0].shape[0], epilogue.get("gated", False)
    bias = meta(n_w, dtype=x.dtype) if epilogue.get("bias") else None
    residual = meta(x.shape[0], n_w // 2 if gated else n_w, dtype=x.dtype) if epilogue.get("residual") else None
    launcher(x, *weight, bias, residual, activation=epilogue.get("activation", "none"), gated=gated,
             softcap=epilogue.get("softcap", 0.0), **options)


def _cache(heads: tuple[int, int, int], dtype: torch.dtype, int8: bool) -> torch.Tensor:
    _, kv_heads, head_dim = heads          # [L, 2, NB, KVH, BS, D], int8: rows of D codes + a 4-byte scale
    return meta(2, 2, CACHE_BLOCKS, kv_heads, BLOCK_SIZE, head_dim + KV_SCALE_BYTES * int8,
                dtype=torch.int8 if int8 else dtype)


def gemm_cases(dtypes, rows, epilogues, k: int = K) -> Iterator[Case]:
    from llmc.kernels.triton.gemm import linear_triton

    for dtype, m, name in product(dtypes, rows, epilogues):
        t = DTYPES[dtype]
        yield Case(f"gemm {dtype} M={m}{f' K={k}' * (k != K)} {name}", dtype,
                   partial(_gemm, linear_triton, meta(m, k, dtype=t), (meta(N_W, k, dtype=t),), EPILOGUES[name]))


def norm_gemm_cases(dtypes, rows) -> Iterator[Case]:
    """The GEMM with its RMSNorm prologue (norm_linear_triton): add_rmsnorm into the merged gate/up
    GEMM with its gated epilogue, a plain rmsnorm into the same weight ungated."""
    from llmc.kernels.triton.gemm import norm_linear_triton

    for dtype, m, add in product(dtypes, rows, (True, False)):
        t = DTYPES[dtype]
        yield Case(f"norm gemm {dtype} M={m} {'add_rmsnorm gated' if add else 'rmsnorm'}", dtype,
                   partial(norm_linear_triton, meta(m, K, dtype=t), meta(K, dtype=t), meta(N_W, K, dtype=t), eps=1e-5,
                           norm_residual=meta(m, K, dtype=t) if add else None, gated=add))


def qkv_rope_cases(dtypes, rows) -> Iterator[Case]:
    """The QKV GEMM with RoPE + KV write as its epilogue (qkv_rope_triton) and an add_rmsnorm prologue,
    at SmolLM2-135M's heads."""
    from llmc.kernels.triton.qkv_rope import qkv_rope_triton

    h, kvh, d = HEAD_SHAPES[0]
    for dtype, m in product(dtypes, rows):
        t, index = DTYPES[dtype], meta(m, dtype=torch.int64)
        yield Case(f"qkv rope {dtype} M={m} H={h}/{kvh} D={d}", dtype,
                   partial(qkv_rope_triton, meta(m, K, dtype=t), meta((h + 2 * kvh) * d, K, dtype=t), None, index,
                           _cache((h, kvh, d), t, False), index, layer=1, num_heads=h, num_kv_heads=kvh, head_dim=d,
                           inv_freq=meta(d // 2, dtype=torch.float32), norm_weight=meta(K, dtype=t), eps=1e-5,
                           norm_residual=meta(m, K, dtype=t)))


def merge_gemm_cases(dtypes, rows) -> Iterator[Case]:
    """The O projection with decode attention's merge as its prologue (merge_linear_triton) and a
    residual epilogue, over as many splits as decode_splits gives M sequences of a 4096-key context
    (2 at least: with one there is no prologue), at both head shapes."""
    from llmc.kernels.triton.gemm import merge_linear_triton
    from llmc.kernels.triton.paged_decode_attention import DecodeParts, decode_splits

    for dtype, m, (h, kvh, d) in product(dtypes, rows, HEAD_SHAPES):
        t, splits, d_pad = DTYPES[dtype], max(2, decode_splits(m, kvh, 4096)[0]), 1 << (d - 1).bit_length()
        parts = DecodeParts(meta(m, h, splits, d_pad, dtype=torch.float32), meta(m, h, splits, dtype=torch.float32),
                            meta(m, h, splits, dtype=torch.float32), d, t)
        yield Case(f"merge gemm {dtype} M={m} H={h} D={d} splits={splits}", dtype,
                   partial(merge_linear_triton, parts, meta(K, h * d, dtype=t), None, meta(m, K, dtype=t)))


def qgemm_cases(dtypes, rows, formats, epilogues) -> Iterator[Case]:
    from llmc.kernels.triton.qgemm import qlinear_triton

    for dtype, m, fmt, name in product(dtypes, rows, formats, epilogues):
        bits, group = WEIGHT_FORMATS[fmt]
        group = group or QK                                                 # per output channel
        yield Case(f"qgemm {dtype} M={m} {fmt} {name}", dtype,
                   partial(_gemm, qlinear_triton, meta(m, QK, dtype=DTYPES[dtype]), _quantized(QN_W, QK, bits, group),
                           EPILOGUES[name], bits=bits, group_size=group))


def rope_kv_write_cases(dtypes, tokens, head_shapes) -> Iterator[Case]:
    from llmc.kernels.triton.rope_kv_write import rope_kv_write_triton

    for dtype, t, (h, kvh, d), int8 in product(dtypes, tokens, head_shapes, (False, True)):
        dt, positions, slots = DTYPES[dtype], meta(t, dtype=torch.int64), meta(t, dtype=torch.int64)
        qkv = meta(t, (h + 2 * kvh) * d, dtype=dt)                          # [T, (H + 2 KVH) D]: a merged QKV GEMM's
        yield Case(f"rope_kv_write {dtype} T={t} H={h}/{kvh} D={d} {'int8' if int8 else dtype} cache", dtype,
                   partial(rope_kv_write_triton, qkv, positions, _cache((h, kvh, d), dt, int8), slots, layer=1,
                           num_heads=h, num_kv_heads=kvh, head_dim=d, inv_freq=meta(d // 2, dtype=torch.float32)))


def attention_cases(dtypes, rows, head_shapes) -> Iterator[Case]:
    from llmc.kernels.triton.paged_decode_attention import paged_decode_attention_triton
    from llmc.kernels.triton.paged_prefill_attention import paged_prefill_attention_triton

    for dtype, r, (h, kvh, d), int8 in product(dtypes, rows, head_shapes, (False, True)):
        dt, seqs, shape = DTYPES[dtype], min(r, 3), f"H={h}/{kvh} D={d} {'int8' if int8 else dtype} cache"
        cache, q = _cache((h, kvh, d), dt, int8), meta(r, h * d, dtype=dt)
        yield Case(f"paged decode {dtype} S={r} {shape}", dtype,
                   partial(paged_decode_attention_triton, q, cache, meta(r, TABLE_WIDTH, dtype=torch.int32),
                           meta(r, dtype=torch.int32), 1, 0.125))
        yield Case(f"paged prefill {dtype} T={r} {shape}", dtype,
                   partial(paged_prefill_attention_triton, q, cache, meta(seqs, TABLE_WIDTH, dtype=torch.int32),
                           meta(seqs, dtype=torch.int32), meta(seqs + 1, dtype=torch.int32), 1, 0.125))


def gather_cases(dtypes, widths) -> Iterator[Case]:
    from llmc.kernels.triton.gather import gather_rows_triton
    from llmc.kernels.triton.qembedding import qembedding_triton

    for dtype, width in product(dtypes, widths):
        t, rows = DTYPES[dtype], 300
        for index in (torch.int64, torch.int32):
            yield Case(f"gather {dtype} C={width} {str(index)[6:]} index", dtype,
                       partial(gather_rows_triton, meta(rows, width, dtype=t), meta(7, dtype=index)))
        for bits, group in ((8, width), (4, 32)):
            yield Case(f"qembedding {dtype} C={width} int{bits}", dtype,
                       partial(qembedding_triton, *_quantized(rows, width, bits, group), meta(7, dtype=torch.int64),
                               bits=bits, group_size=group, dtype=t))


def template_cases(quick: bool) -> Iterator[Case]:
    """Every template (see module docstring); `quick`: fp16 and bf16, one shape of each."""
    if quick:
        dtypes = ("bf16", "fp16")
        yield from gemm_cases(dtypes, (1, 200), ("bias+gated+residual",))
        yield from gemm_cases(dtypes, (1,), ("geglu", "softcap"))
        yield from norm_gemm_cases(dtypes, (1, 200))
        yield from qkv_rope_cases(dtypes, (1, 200))
        yield from merge_gemm_cases(dtypes, (1, 87))
        yield from qgemm_cases(dtypes, (1,), ("int8",), ("bias+gated+residual",))
        yield from qgemm_cases(dtypes, (200,), ("int4-g32",), ("silu",))
        yield from rope_kv_write_cases(dtypes, (5,), HEAD_SHAPES[1:])
        yield from attention_cases(dtypes, (5,), HEAD_SHAPES[1:])
        yield from gather_cases(dtypes, (96,))
        return
    dtypes, every = tuple(DTYPES), tuple(EPILOGUES)
    yield from gemm_cases(dtypes, (GEMM_ROWS[0], GEMM_ROWS[-1]), every)        # each epilogue on both end tiles
    for k in (K, UNALIGNED_K):
        yield from gemm_cases(dtypes, EVERY_M, HEAVIEST, k)
    yield from qgemm_cases(dtypes, EVERY_M, WEIGHT_FORMATS, HEAVIEST)
    yield from norm_gemm_cases(dtypes, GEMM_ROWS)
    yield from qkv_rope_cases(dtypes, GEMM_ROWS)
    yield from merge_gemm_cases(dtypes, EVERY_M)
    yield from rope_kv_write_cases(dtypes, (1, 37), HEAD_SHAPES)
    yield from attention_cases(dtypes, (1, 37), HEAD_SHAPES)
    yield from gather_cases(dtypes, (96, 576))


def tile_cases() -> Iterator[Case]:
    """Each template's launch configs once per dtype, weight format and cache (`--tiles`): the
    GEMMs at every M bucket of pick_config with the HEAVIEST epilogues, every weight format; RoPE +
    KV write and attention over a float and an int8 cache at both head shapes; the gathers."""
    dtypes = tuple(DTYPES)
    yield from gemm_cases(dtypes, TILE_M, HEAVIEST)
    yield from gemm_cases(dtypes, (1, 200), HEAVIEST, UNALIGNED_K)
    yield from norm_gemm_cases(dtypes, TILE_M)
    yield from qkv_rope_cases(dtypes, TILE_M)
    yield from merge_gemm_cases(dtypes, (1, 24, 37, 87))
    yield from qgemm_cases(dtypes, TILE_M, WEIGHT_FORMATS, HEAVIEST)
    yield from rope_kv_write_cases(dtypes, (5,), HEAD_SHAPES)
    yield from attention_cases(dtypes, (5,), HEAD_SHAPES)
    yield from gather_cases(dtypes, (576,))


def report(c: Compile) -> str:
    used = "" if c.shared is None else \
        f" | {c.registers or '-'} regs, {c.spilled or 0} B spilled ({c.local or 0} B local), {c.shared} B shared"
    return f"{'OK  ' if c.error is None else 'FAIL'} {c.case}: {c.kernel} {c.details}{used}" + \
        (f"\n     {c.error}" if c.error else "")


def summary(compiles: list[Compile]) -> str:
    ok = Counter(c.dtype for c in compiles if c.error is None)
    failed = sum(c.error is not None for c in compiles)
    kernels = len({c.kernel for c in compiles if c.error is None})
    per_dtype = ", ".join(f"{dtype} {n}" for dtype, n in sorted(ok.items()))
    return f"{sum(ok.values())} compiles for sm_90 OK ({per_dtype}) of {kernels} kernels; {failed} failed"


def main(argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled for a GPU")
        return 1
    from triton.backends.compiler import GPUTarget

    mode = next((a for a in argv if a in MODES), "")
    shard, shards = _shard(next((a for a in argv if a.startswith("--shard=")), "--shard=0/1"))
    artifacts = [Path(a) for a in argv if not a.startswith("--")]
    cases: Iterator[Case] = tile_cases() if mode == "--tiles" else template_cases(mode == "--quick")
    if artifacts:                             # codegen knows each unit's inputs
        rows = MODES[mode]
        cases = (case for source in (cases, *(artifact_cases(a, rows) for a in artifacts)) for case in source)
    aot = AheadOfTime(GPUTarget(*SM90)).install()
    for i, case in enumerate(cases):
        if i % shards == shard:
            for c in aot.run(case):
                print(report(c), flush=True)
    print(summary(aot.compiles))
    return min(sum(c.error is not None for c in aot.compiles), 255)


def _shard(arg: str) -> tuple[int, int]:
    """--shard=I/N: this process takes every N-th case from the I-th (N processes compile in parallel)."""
    found = re.fullmatch(r"--shard=(\d+)/(\d+)", arg)
    if found is None or not int(found.group(1)) < int(found.group(2)):
        raise SystemExit(f"{arg} is not a shard: write --shard=I/N with 0 <= I < N")
    return int(found.group(1)), int(found.group(2))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
