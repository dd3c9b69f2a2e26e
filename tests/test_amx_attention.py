"""Prompt attention on AMX tiles (kernels/cpu/amx_attention.h) and its fallback, against the ref.

bf16 q over a bf16 cache, chunks of 2 or more queries: prompts of several 64-key tiles, chunks over
cached context ending mid-block and mid-tile next to decodes, keys in several spans of 512, 1 to 4
query heads per KV head, head_dim 32 to 256, windows and softcap. Unused cache rows are NaN, so a read
past a sequence's end (or a zero key's NaN product) shows. Two bounds: as close to float64 as paged_attention_ref is (it
rounds its probabilities to bf16 too), and the contract's own: each probability rounded once to bf16
(half an ulp, 2^-9 relatively) moves an output by at most 2^-9 max|v|, the output's rounding by
2^-9 of its size. On AMX where it is usable (skipped, saying why, where not); on the AVX-512
fallback, forced with LLMC_CPU_AMX=off, everywhere. A tiny bf16 Llama's prefill through the step
plan on AMX and on the fallback, against its fp32 artifact. The path is named with its reason.
"""

from __future__ import annotations

import pytest
import torch

from llmc.compiler.driver import CompileConfig, compile_model
from llmc.kernels.amx import AMX_OVERRIDE, attention_path, cpu_gemm_path, describe_attention_path
from llmc.runtime.artifact import load_artifact
from llmc.runtime.model_runner import build_step_inputs
from llmc.runtime.scheduler import Chunk
from llmc.runtime.step_plan import StepPlanProgram
from test_step_plan import executor, sequences
from test_native_int8_kv import attention_run
from tolerances import EPS, assert_as_close_as_ref

BF16 = torch.bfloat16
HALF_ULP = EPS[BF16] / 2                                  # 2^-8 / 2: one bf16 rounding, relatively
CASES = [
    # (lens, chunks, heads, kv_heads, head_dim): whole prompts of 1-4 key tiles, 64 exactly, 2 queries
    ([200, 64, 65, 2, 33], [200, 64, 65, 2, 33], 9, 3, 64),
    # chunked prefill whose context ends mid-block and mid-tile, next to decodes
    ([300, 5, 130, 1, 97, 64, 250], [77, 1, 3, 1, 32, 63, 1], 9, 3, 64),
    ([150, 40, 9], [150, 23, 1], 4, 4, 32),
    ([150, 40], [150, 23], 8, 2, 128),
    ([70, 20], [70, 20], 2, 1, 256),
    # keys in several spans of 512 (head_dim 32 and 64 keep each row block's outputs in tiles over a span)
    ([1100, 700], [40, 700], 9, 3, 64),
    ([600, 530], [600, 17], 4, 2, 32),
]
OPTIONS = [dict(window=37), dict(window=64), dict(softcap=1.5), dict(window=16, softcap=1.5)]


def amx_or_skip() -> None:
    path, why = cpu_gemm_path()
    if path != "amx-bf16":
        pytest.skip(f"AMX is not usable here: {why}")


def check(lens, chunks, heads, kv_heads, head_dim, seed, window=0, softcap=0.0) -> None:
    """The native op over a poisoned cache against the ref and float64 over a clean one."""
    got, want, exact, clean = attention_run(lens, chunks, heads, kv_heads, head_dim, BF16, BF16, seed,
                                            window=window, softcap=softcap)
    assert_as_close_as_ref(got, want, exact, BF16)
    bound = HALF_ULP * (clean[1, 1].abs().max().item() + exact.abs().max().item()) * 1.01   # fp32 slack
    assert (got.double() - exact).abs().max().item() <= bound


def on_path(monkeypatch, amx: bool) -> None:
    if amx:
        monkeypatch.delenv(AMX_OVERRIDE, raising=False)
        amx_or_skip()
    else:
        monkeypatch.setenv(AMX_OVERRIDE, "off")


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "fallback"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_prompt_attention_meets_the_contract(case, amx, monkeypatch):
    on_path(monkeypatch, amx)
    check(*CASES[case], seed=20 + case)


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "fallback"])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_window_and_softcap_on_each_path(options, amx, monkeypatch):
    on_path(monkeypatch, amx)
    check([130, 90, 40], [130, 33, 40], 6, 2, 64, seed=30, **options)


@pytest.fixture(scope="module")
def llama_bf16(tiny_family, tmp_path_factory):
    """The tiny Llama (head_dim 32: every graph a step plan) compiled bf16, and its fp32 artifact."""
    _, folder, fp32 = tiny_family("llama_hd32")
    art = compile_model(folder, tmp_path_factory.mktemp("amx_attention") / "art", CompileConfig(dtype="bfloat16"))
    return art, fp32


def test_the_step_plans_prefill_on_amx_and_on_the_fallback(llama_bf16, monkeypatch):
    """Prompts of 15, 17, 64 and 100 tokens (partial blocks, a second key tile) in one prefill step:
    the last tokens' logits on AMX as close to the fp32 artifact's as the forced fallback's are
    (RMS, tests/test_step_plan.py's rule)."""
    on_path(monkeypatch, True)
    bf16, fp32 = (load_artifact(path) for path in llama_bf16)
    seqs, blocks = sequences([15, 17, 64, 100])
    step = build_step_inputs([Chunk(s, 0, s.num_tokens) for s in seqs], blocks)
    amx_plan = executor(bf16)
    assert isinstance(amx_plan.programs["prefill"], StepPlanProgram)
    amx, exact = amx_plan.run("prefill", step), executor(fp32).run("prefill", step)
    monkeypatch.setenv(AMX_OVERRIDE, "off")
    fallback = executor(bf16).run("prefill", step)
    assert_as_close_as_ref(amx.float(), fallback.float(), exact, BF16, norm="rms")


def test_the_path_names_its_reason(monkeypatch):
    """AMX for a bf16 cache with head_dim a multiple of 32; the AVX-512 tiles, saying why, for other
    head dims, an int8 cache, or the override."""
    monkeypatch.delenv(AMX_OVERRIDE, raising=False)
    amx_or_skip()
    assert attention_path(64) == ("amx-bf16", "") and describe_attention_path(64) == "prompt attention amx-bf16"
    assert attention_path(80) == ("avx512-bf16", "head_dim 80 is not a multiple of 32")
    assert attention_path(64, torch.int8) == ("avx512-bf16", "the KV cache is int8")
    monkeypatch.setenv(AMX_OVERRIDE, "off")
    assert describe_attention_path(64) == "prompt attention avx512-bf16 (LLMC_CPU_AMX=off)"
