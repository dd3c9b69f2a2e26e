"""Compile the templates for a GPU on a machine without one: `python -m llmc.kernels.triton.aot_compile`.

Triton's interpreter runs any shapes and types numpy accepts, so a kernel that passes every
interpreter test can still fail to compile for a GPU (a dot below 16 on K, a broadcast the IR
rejects, a pointer cast, a dtype a GPU op does not take). `triton.compile` with an explicit
target builds TTIR -> TTGIR -> LLVM -> PTX -> cubin with the wheel's own ptxas and needs no
device, so each variant here (the quantized paths first: every weight format and epilogue shape
of qgemm.py, the int8 KV cache in the RoPE write and both attention kernels) is compiled for
sm_90 (H100/H200) and reported OK or FAIL; the exit status is the number of failures. The int8
KV writer's PTX must also divide with div.rn.f32 only (rounding as torch does). It must run
without TRITON_INTERPRET=1 (the kernels are decorated as interpreted functions otherwise).
It proves compilation only, not numbers or speed: those need the GPU tests.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

SM90 = ("cuda", 90, 32)
# The int8 KV writer must divide exactly as torch does (scale = amax / 127, x / scale): Triton's
# `/` on fp32 is div.full.f32 (approximate) on NVIDIA GPUs, tl.math.div_rn is div.rn.f32.
APPROXIMATE_DIVISION = ("div.full.f32", "div.approx.f32")
Variant = tuple[str, object, dict[str, str], dict[str, object]]   # label, kernel, pointer/scalar types, constexprs


def _types(kernel, pointers: dict[str, str], default: str = "i32") -> dict[str, str]:
    return {name: pointers.get(name, default) for name in kernel.arg_names}


def qgemm_variants(quick: bool) -> Iterator[Variant]:
    from llmc.kernels.triton.qgemm import _qlinear_kernel

    shapes = [(8, 16, 64, 128, False), (8, 16, 32, 32, True), (4, 16, 64, 128, False), (4, 128, 128, 32, True)]
    for dtype in ("fp16",) if quick else ("fp16", "bf16", "fp32"):
        for bits, bm, bn, bk, gated in shapes[2:] if quick else shapes:
            pointers = {"codes_ptr": "*i8" if bits == 8 else "*u8", "scales_ptr": "*fp16", "mins_ptr": "*fp16",
                        **{n: f"*{dtype}" for n in ("x_ptr", "bias_ptr", "residual_ptr", "out_ptr")}}
            fp32 = dtype == "fp32"
            constexprs = dict(BITS=bits, HAS_BIAS=True, HAS_RESIDUAL=True, SILU=not gated, GATED=gated, DOT_FP32=fp32,
                              INPUT_PRECISION="ieee" if fp32 else "tf32", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8)
            yield f"qlinear {dtype} int{bits} {bm}x{bn}x{bk} gated={gated}", _qlinear_kernel, \
                _types(_qlinear_kernel, pointers), constexprs


def qembedding_variants(quick: bool) -> Iterator[Variant]:
    from llmc.kernels.triton.qembedding import _qembedding_kernel

    for bits in (8, 4):
        pointers = {"codes_ptr": "*i8" if bits == 8 else "*u8", "scales_ptr": "*fp16", "mins_ptr": "*fp16",
                    "ids_ptr": "*i64", "out_ptr": "*bf16"}
        yield f"qembedding int{bits} bf16", _qembedding_kernel, _types(_qembedding_kernel, pointers), \
            dict(BITS=bits, BLOCK=1024)


def int8_kv_variants(quick: bool) -> Iterator[Variant]:
    from llmc.kernels.triton.paged_decode_attention import _decode_split_kernel
    from llmc.kernels.triton.paged_prefill_attention import _prefill_kernel
    from llmc.kernels.triton.rope_kv_write import _rope_kv_write_kernel

    for dtype in ("fp16",) if quick else ("fp16", "bf16", "fp32"):
        pointers = {**{n: f"*{dtype}" for n in ("q_ptr", "k_ptr", "v_ptr", "q_out_ptr", "out_ptr")},
                    "positions_ptr": "*i64", "slots_ptr": "*i64", "inv_freq_ptr": "*fp32", "k_cache_ptr": "*i8",
                    "v_cache_ptr": "*i8", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
                    "query_start_loc_ptr": "*i32", "qk_scale": "fp32", "part_acc_ptr": "*fp32",
                    "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32"}
        heads = dict(HEAD_DIM=80, BLOCK_SIZE=16, D_PAD=128, TILE=32, KV_INT8=True)
        yield f"rope_kv_write {dtype} int8 cache", _rope_kv_write_kernel, _types(_rope_kv_write_kernel, pointers), \
            dict(HEADS=6, KV_HEADS=2, HALF=40, BLOCK_H=8, BLOCK_KVH=2, BLOCK_HALF=64, KV_INT8=True)
        yield f"paged decode {dtype} int8 cache", _decode_split_kernel, _types(_decode_split_kernel, pointers), \
            dict(GROUP=3, BLOCK_G=16, **heads)
        yield f"paged prefill {dtype} int8 cache", _prefill_kernel, _types(_prefill_kernel, pointers), \
            dict(GROUP=3, G_PAD=4, BLOCK_Q=16, **heads)


def compile_variant(variant: Variant, target) -> str | None:
    """None if the variant compiles to a cubin for `target`, else the error's first lines."""
    import triton
    from triton.compiler import ASTSource

    _, kernel, types, constexprs = variant
    signature = {name: "constexpr" if name in constexprs else types[name] for name in kernel.arg_names}
    try:
        compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=target, options={"num_warps": 4})
    except Exception as exc:                       # noqa: BLE001 (every compile error is reported, then counted)
        return f"{type(exc).__name__}: {str(exc)[:800]}"
    if constexprs.get("KV_INT8") and "HEADS" in constexprs:                  # the writer: exact divisions only
        found = [op for op in APPROXIMATE_DIVISION if op in compiled.asm["ptx"]]
        if found or "div.rn.f32" not in compiled.asm["ptx"]:
            return f"the int8 KV writer's PTX divides with {found or 'no div.rn.f32'}"
    return None


def main(argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled for a GPU")
        return 1
    from triton.backends.compiler import GPUTarget

    quick = "--quick" in argv
    failures = 0
    for variants in (qgemm_variants, qembedding_variants, int8_kv_variants):
        for variant in variants(quick):
            error = compile_variant(variant, GPUTarget(*SM90))
            failures += error is not None
            print(f"{'OK  ' if error is None else 'FAIL'} {variant[0]}" + (f"\n     {error}" if error else ""))
    return failures


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
