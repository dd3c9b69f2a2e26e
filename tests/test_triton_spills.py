"""No Triton kernel spills a register, or takes more shared memory than a block may have, on an
H100/H200 (sm_90), in any dtype, weight format or KV cache an artifact uses: checked without a GPU.

kernels/triton/aot_compile.py compiles every kernel for sm_90 with the wheel's ptxas under a
stand-in driver (kernels/triton/sm90_target.py) that answers what CUDA would, so Triton's own
CompiledKernel sets n_regs and n_spills and refuses metadata.shared over 227 KiB, as on a GPU; a
kernel with local memory is compiled again with ptxas -v for its own count of spilled bytes (a
local array, as sin/cos's range reduction keeps, is not a spill). `--tiles` takes each template's
launch configs once per dtype (fp32, bf16, fp16), weight format (float, int8 per channel, Q8_0,
int4 in groups of 32 and 128) and KV cache (float, int8) at SmolLM2-135M's sizes, the GEMMs with
their heaviest epilogues at one M of each of pick_config's buckets and at a K that is not a
multiple of 16; then the generated kernels of tiny Llama artifacts: fp32 (the CLI's default
dtype), int8 weights with an int8 KV cache (bf16), int4 weights and embeddings with an int8 KV
cache (fp16). Two child processes share the cases (CI machines have two cores). Every M
specialization of every bucket, and every epilogue, is the slow sweep's
(tests/test_triton_aot_compile.py). ~95 s with a cold Triton cache on two busy cores, ~20 s warm.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from llmc.compiler.codegen.gemm_configs import pick_config, pick_qconfig
from llmc.compiler.driver import CompileConfig, compile_model
from llmc.compiler.quant_recipe import QuantRecipe
from llmc.kernels.triton.sm90_target import SM90_SHARED_OPTIN, max_threads
from test_triton_aot_compile import REPO, TEMPLATE_KERNELS, compiled, run_child

# "OK   case: kernel details | 128 regs, 0 B spilled (0 B local), 65536 B shared"
RESOURCES = re.compile(r"^(OK  |FAIL) (.*?): (\S+) .*\| (\S+) regs, (\d+) B spilled \((\d+) B local\), (\d+) B shared$",
                       re.MULTILINE)
SHARDS = 2


@pytest.fixture(scope="module")
def llama_artifacts(tiny_family, tmp_path_factory):
    """llama_hd32 (widths that are multiples of 16, as a real model's) compiled for cuda: fp32,
    int8 weights with an int8 KV cache in bf16, int4 weights and embeddings with one in fp16."""
    recipes = {"float32": QuantRecipe(), "bfloat16": QuantRecipe.parse("int8", kv_dtype="int8"),
               "float16": QuantRecipe.parse("int4-g32", kv_dtype="int8", embeddings=True)}
    root = tmp_path_factory.mktemp("spills")
    return [compile_model(tiny_family("llama_hd32")[1], root / f"llama-{dtype}-{quant.weights}-kv{quant.kv_dtype}",
                          CompileConfig(target="cuda", dtype=dtype, quant=quant)) for dtype, quant in recipes.items()]


def compile_in_shards(*argv: str) -> list[tuple[str, ...]]:
    """aot_compile `argv` in SHARDS child processes at once; each compile's (status, case, kernel,
    registers, spilled, local, shared), after asserting every child ran and every compile is OK."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "llmc.kernels.triton.aot_compile", *argv]
    children = [subprocess.Popen([*command, f"--shard={i}/{SHARDS}"], env=env, cwd=REPO, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(SHARDS)]
    outputs = [child.communicate(timeout=900) for child in children]
    stdout = "".join(out for out, _ in outputs)
    done = [tuple(s.strip() if i == 0 else s for i, s in enumerate(row)) for row in RESOURCES.findall(stdout)]
    failed = "\n".join(re.findall(r"^FAIL .*\n.*", stdout, re.MULTILINE))
    assert all(child.returncode == 0 for child in children) and done, \
        f"exit statuses {[c.returncode for c in children]}\n{failed}\n" + "".join(e[-5000:] for _, e in outputs)
    assert len(done) == len(compiled(stdout)), "a compile line without its resources"
    assert all(status == "OK" for status, *_ in done), failed
    return done


def test_no_kernel_spills_or_overflows_shared_memory_on_sm90(llama_artifacts):
    done = compile_in_shards("--tiles", *map(str, llama_artifacts))
    assert all(int(spilled) == 0 and int(shared) <= SM90_SHARED_OPTIN for *_, spilled, _, shared in done)
    cases = {case for _, case, *_ in done}
    for dtype in ("fp32", "bf16", "fp16"):
        kernels = {kernel for _, case, kernel, *_ in done if re.match(rf"(q?gemm|rope|paged|gather|qembedding)\S* "
                                                                      rf"(\S+ )?{dtype} ", case)}
        assert kernels == set(TEMPLATE_KERNELS), (dtype, kernels)
        for fmt in ("int8", "q8_0", "int4-g32", "int4-g128"):
            assert any(case.startswith(f"qgemm {dtype} ") and f" {fmt} " in case for case in cases), (dtype, fmt)
        assert any(case.startswith(f"paged prefill {dtype}") and "int8 cache" in case for case in cases)
    for artifact in llama_artifacts:       # every generated pointwise module's kernel, compiled for this artifact
        generated = {p.stem + "_kernel" for p in (artifact / "kernels").glob("pointwise_*.py")}
        assert generated and generated <= {kernel for _, case, kernel, *_ in done if case.startswith(artifact.name)}
    local_only = [row for row in done if row[2] == "_rope_kv_write_kernel" and int(row[5]) > 0]
    assert local_only, "sin/cos's local array: local memory that is not a spill, and passes"


PLANTED_CHILD = """
import torch
from functools import partial
from triton.backends.compiler import GPUTarget
from llmc.compiler.codegen.gemm_configs import GemmConfig
from llmc.kernels.triton.aot_compile import SM90, AheadOfTime, Case, EPILOGUES, _gemm, meta, report, summary
from llmc.kernels.triton.gemm import linear_triton

def gemm(dtype, config):        # SmolLM2-135M's gate/up projection at a prefill step of 200 tokens
    x, w = meta(200, 576, dtype=dtype), meta(3072, 576, dtype=dtype)
    return partial(_gemm, linear_triton, x, (w,), EPILOGUES["silu"], config=config)

aot = AheadOfTime(GPUTarget(*SM90)).install()
for case in (Case("fp32 tutorial tile", "fp32", gemm(torch.float32, GemmConfig(128, 128, 32, 8, 4, 4))),
             Case("bf16 six stages of 256 x 256 x 64", "bf16", gemm(torch.bfloat16, GemmConfig(256, 256, 64, 8, 8, 6))),
             Case("fp32 picked", "fp32", gemm(torch.float32, None))):
    for c in aot.run(case):
        print(report(c))
print(summary(aot.compiles))
"""


def test_a_spilling_or_oversized_config_fails():
    """Two configs forced through linear_triton's `config`: the tutorial's 128 x 128 x 32 tile over 4
    warps in fp32 (FMA dots) spills, and six stages of 256 x 256 x 64 bf16 tiles need 384 KiB of
    shared memory; each is one FAIL naming the bytes, and pick_config's fp32 tile passes."""
    run = run_child("-c", PLANTED_CHILD)
    assert run.returncode == 0, run.stdout + run.stderr
    assert compiled(run.stdout) == [("FAIL", "fp32 tutorial tile", "_linear_kernel"),
                                    ("FAIL", "bf16 six stages of 256 x 256 x 64", "_linear_kernel"),
                                    ("OK", "fp32 picked", "_linear_kernel")], run.stdout
    spilled = re.search(r"ptxas spills (\d+) bytes a thread of registers to local memory at (\d+) registers",
                        run.stdout)
    assert spilled and int(spilled.group(1)) > 0 and int(spilled.group(2)) == 255, run.stdout
    shared = re.search(r"out of resource: shared memory, Required: (\d+), Hardware limit: (\d+)", run.stdout)
    assert shared and int(shared.group(1)) == 6 * (256 * 64 + 64 * 256) * 2 and int(shared.group(2)) == 232448, \
        run.stdout
    assert "1 compiles for sm_90 OK (fp32 1) of 1 kernels; 2 failed" in run.stdout


def test_pick_config_by_dtype_and_weight_format():
    """The tiles the compile checks hold (gemm_configs.TILES), picked by dtype and weight bits; the
    default stays the fp16/bf16 float tile (call sites without a dtype); a bad name is one sentence."""
    assert pick_config(200, 3072, 576) == pick_config(200, 3072, 576, dtype="bf16") == \
        pick_config(200, 3072, 576, dtype="f16")
    assert (pick_config(200, 3072, 576).block_m, pick_config(200, 3072, 576).num_warps) == (128, 8)
    fp32 = pick_config(200, 3072, 576, dtype="f32")
    assert (fp32.block_m, fp32.block_n, fp32.block_k) == (64, 64, 32)
    assert pick_qconfig(200, 576, 1536, bits=4, group_size=32, dtype="bf16").block_m == 64
    assert pick_qconfig(200, 576, 1536, bits=8, group_size=1536, dtype="f32").block_k == 32
    assert pick_config(200, 216, 72).block_k == 32                          # K not a multiple of 16: one small tile
    with pytest.raises(ValueError, match="'int8' is not a GEMM dtype"):
        pick_config(1, 64, 64, dtype="int8")
    with pytest.raises(ValueError, match="weight_bits 2 is not a weight format"):
        pick_config(1, 64, 64, weight_bits=2)


def test_max_threads_follows_the_register_file():
    """sm_90: 64 Ki registers a block, given to warps 256 at a time; at most 1024 threads."""
    assert max_threads(32) == 1024 and max_threads(64) == 1024
    assert max_threads(128) == 512 and max_threads(255) == 256 and max_threads(168) == 384
