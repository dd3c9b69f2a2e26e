"""Step plans (runtime/step_plan.py, kernels/cpu/step_plan.cpp): a decode or prefill graph run as
one native call equals the same graph run op by op with the native kernels, bit for bit (the same
kernels; a prompt's AMX GEMMs split by tokens, not panels: bf16's 204-token prefill at 2 threads),
and the torch refs within the dtype's tolerance (bf16: as close to an fp32 run on the same weights as
the bf16 refs are; planted bugs fail it); the KV cache it writes is the op-by-op one. Prefill steps mix prompt chunks (whole, first parts, a rest
over its cached part) with decodes. Tiny random models whose shapes every plan kernel takes (widths a
multiple of 16, head_dim 32): Llama with separate and tied embeddings, Qwen2 with QKV biases; f32
and bf16 activations, float, int8 and int4 weights, float and int8 caches; 1 to 9 sequences of
lengths across block edges, on one thread and on two. The declines and bad step inputs too. Quantized
weights run with the default activations (bf16 prompts where the CPU has AMX-BF16, int8 where it has
AVX512-VNNI) where the plan meets the
op-by-op run, float ones where it meets the refs (tests/test_int8_activations.py holds int8's to theirs)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from llmc.compiler.driver import CompileConfig, compile_model
from llmc.compiler.ir import parse_graph
from llmc.compiler.quant_recipe import QuantRecipe
from llmc.runtime.artifact import load_artifact
from llmc.runtime.cpu_program import CpuProgram, load_cpu_kernels
from llmc.runtime.block_manager import BlockManager
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.executor import KVCacheSpec
from llmc.runtime.model_runner import build_step_inputs
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.scheduler import Chunk
from llmc.runtime.sequence import Sequence
from llmc.runtime.step_plan import NotPlannable, StepPlanProgram, lower_step_plan
from llmc.runtime.torch_backend import TorchProgram
from llmc.runtime.torch_executor import TorchExecutor, TorchOptions
from llmc.tools import bench_plan_call
from tiny_models import build_hf_model, write_hf_folder
from tolerances import assert_as_close_as_ref, tolerance

WIDTHS = dict(hidden_size=128, intermediate_size=160)   # head_dim 32: every plan kernel takes these widths
PLANNABLE = {"llama": ("llama_hd32", {}), "llama_tied": ("llama_tied", WIDTHS),   # tiny_models families
             "qwen2_bias": ("qwen2", dict(WIDTHS, num_attention_heads=4, num_key_value_heads=2))}
VARIANTS = {"f32": dict(), "bf16": dict(dtype="bfloat16"), "f32_kv8": dict(quant=QuantRecipe.parse(kv_dtype="int8")),
            "bf16_kv8": dict(dtype="bfloat16", quant=QuantRecipe.parse(kv_dtype="int8")),
            "int8": dict(quant=QuantRecipe.parse("int8")),
            "bf16_int4": dict(dtype="bfloat16", quant=QuantRecipe.parse("int4-g32")),
            "unfused": dict(disabled_passes=("fuse_silu_mul",))}      # split, silu and mul: generated units
NUM_BLOCKS, BLOCK = 24, 16
# One KV head (MQA): a batch-1 decode is one attention item, which two threads split (test_split_decodes_*)
SPLIT_FAMILY = {"llama_mqa": ("llama_hd32", dict(num_key_value_heads=1))}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """(family, variant) -> loaded artifact, compiled once each."""
    cache = {}

    def get(family: str, variant: str):
        if (family, variant) not in cache:
            root = tmp_path_factory.mktemp(f"{family}_{variant}")
            base, config = {**PLANNABLE, **SPLIT_FAMILY}[family]
            folder = write_hf_folder(build_hf_model(base, **config), root / "hf")
            config = CompileConfig(**VARIANTS[variant])
            cache[family, variant] = load_artifact(compile_model(folder, root / "art", config))
        return cache[family, variant]

    return get


def executor(art, kernels="native", step_plans=True, block_size=BLOCK, activations="auto",
             num_blocks=NUM_BLOCKS) -> TorchExecutor:
    cache_type = art.graphs["decode"].node_map()["kv_cache"].type
    kv = KVCacheSpec.from_graph_type(cache_type, num_blocks, block_size)
    options = TorchOptions(kernels=kernels, step_plans=step_plans, activations=activations)
    return TorchExecutor(art, torch.device("cpu"), kv, options)


def sequences(lens: list[int], seed: int = 0, num_blocks: int = NUM_BLOCKS) -> tuple[list[Sequence], BlockManager]:
    g = torch.Generator().manual_seed(seed)
    blocks = BlockManager(num_blocks, BLOCK)
    seqs = [Sequence(i, torch.randint(3, 300, (n,), generator=g).tolist(), SamplingParams(max_tokens=8))
            for i, n in enumerate(lens)]
    for s in seqs:
        blocks.allocate(s.seq_id, s.prompt_ids)
        blocks.append(s.seq_id, s.num_tokens + 4)
    return seqs, blocks


def decode_steps(executors: list[TorchExecutor], lens: list[int], steps: int = 3,
                 num_blocks: int = NUM_BLOCKS) -> list[list[torch.Tensor]]:
    """Each executor's logits for every step: a prefill of the prompts, then `steps` decode steps of
    every sequence (teacher-forced with the first executor's greedy tokens)."""
    seqs, blocks = sequences(lens, num_blocks=num_blocks)
    step = build_step_inputs([Chunk(s, 0, s.num_tokens) for s in seqs], blocks)
    for ex in executors:
        ex.run("prefill", step)
    results = [[] for _ in executors]
    for s in seqs:
        s.num_computed = s.num_tokens
        s.output_ids.append(5)
    for _ in range(steps):
        step = build_step_inputs([Chunk(s, s.num_tokens - 1, s.num_tokens) for s in seqs], blocks)
        for ex, out in zip(executors, results):
            out.append(ex.run("decode", step))
        for s, logits in zip(seqs, results[0][-1]):
            s.num_computed = s.num_tokens
            s.output_ids.append(int(logits.argmax()))
    return results


PLANNED = list(VARIANTS)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("variant", PLANNED)
@pytest.mark.parametrize("family", list(PLANNABLE))
def test_plan_equals_op_by_op_native_bit_for_bit(artifact, family, variant, threads):
    art = artifact(family, variant)
    plan, ops = executor(art), executor(art, step_plans=False)
    assert isinstance(plan.programs["decode"], StepPlanProgram) and isinstance(ops.programs["decode"], CpuProgram)
    lens = [1, 15, 16, 17, 40] + ([3, 9, 33, 70] if threads == 2 else [])   # 9 sequences: whole-decode items
    got, want = decode_steps([plan, ops], lens)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch.equal(plan.kv_cache, ops.kv_cache)


@pytest.mark.parametrize("threads", [2], indirect=True)
@pytest.mark.parametrize("variant", ["f32", "bf16_kv8"])
def test_split_decodes_in_a_plan_bit_for_bit(artifact, variant, threads):
    """One KV head and one sequence of 600 tokens on two threads: every layer's decode attention is
    split in two parts (attention_work.h's split_decodes) that the plan merges layer after layer on
    the same counters (decode_splits.h): it equals the op-by-op run, which splits each call afresh,
    bit for bit; f32's logits meet the torch refs' too (the kernel tests hold the parts' merge to its
    ref in every cache dtype)."""
    art = artifact("llama_mqa", variant)
    runs = [executor(art, num_blocks=48), executor(art, step_plans=False, num_blocks=48)]
    if variant == "f32":
        runs.append(executor(art, kernels="reference", activations="float", num_blocks=48))
    got, want, *ref = decode_steps(runs, [600], num_blocks=48)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert torch.equal(runs[0].kv_cache, runs[1].kv_cache)
    for g, r in zip(got, ref[0] if ref else []):
        torch.testing.assert_close(g, r, **tolerance(torch.float32, 160, scale=4.0))


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("variant", ["f32", "int8", "bf16_int4"])
@pytest.mark.parametrize("family", list(PLANNABLE))
def test_the_plan_picks_each_logit_rows_greedy_token_beside_it(artifact, family, variant, threads):
    """StepOutput.greedy of a plan (its logits GEMM picks as it makes them): each logit row's argmax,
    in a prefill asking for logits at every token of 5 prompts and in a decode step of the 5; a
    program op by op has none (the sampler's argmax_rows picks)."""
    art = artifact(family, variant)
    plan, ops = executor(art), executor(art, step_plans=False)
    assert plan.programs["decode"].picks and plan.programs["prefill"].picks
    seqs, blocks = sequences([1, 15, 16, 17, 40])
    step = build_step_inputs([Chunk(s, 0, s.num_tokens) for s in seqs], blocks)
    every = dataclasses.replace(step, logits_indices=torch.arange(step.input_ids.numel()))
    outs = [plan.run_step("prefill", every)]
    assert ops.run_step("prefill", every).greedy is None
    for s in seqs:
        s.num_computed = s.num_tokens
        s.output_ids.append(5)
    outs.append(plan.run_step("decode", build_step_inputs([Chunk(s, s.num_tokens - 1, s.num_tokens) for s in seqs],
                                                           blocks)))
    for out, rows in zip(outs, (89, 5)):
        assert out.greedy.shape == (rows,) and torch.equal(out.greedy, out.logits.argmax(dim=-1))


def mixed_steps(executors: list[TorchExecutor], every_position: bool = False) -> list[list[torch.Tensor]]:
    """Each executor's logits for three prefill steps over five sequences: whole prompts and first
    chunks, then the rests (over their cached parts) beside decodes, then decodes and one chunk;
    `every_position`: logits at every token of the step, not only each chunk's last."""
    seqs, blocks = sequences([6, 40, 17, 1, 33])
    plan = [[(0, 0, 6), (1, 0, 10), (2, 0, 17), (3, 0, 1), (4, 0, 20)],
            [(0, 6, 7), (1, 10, 40), (2, 17, 18), (4, 20, 33)],
            [(1, 40, 41), (3, 1, 2), (4, 33, 34)]]
    results = [[] for _ in executors]
    for chunks in plan:
        for i, start, end in chunks:
            while seqs[i].num_tokens < end:
                seqs[i].output_ids.append(7 + i)
        step = build_step_inputs([Chunk(seqs[i], start, end) for i, start, end in chunks], blocks)
        if every_position:
            step = dataclasses.replace(step, logits_indices=torch.arange(step.input_ids.numel()))
        for ex, out in zip(executors, results):
            out.append(ex.run("prefill", step))
        for i, _, end in chunks:
            seqs[i].num_computed = end
    return results


@pytest.mark.parametrize("every_position", [False, True])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("variant", ["f32", "bf16_kv8", "bf16_int4"])
@pytest.mark.parametrize("family", list(PLANNABLE))
def test_prefill_plan_equals_op_by_op_native_bit_for_bit(artifact, family, variant, threads, every_position):
    art = artifact(family, variant)
    plan, ops = executor(art), executor(art, step_plans=False)
    assert isinstance(plan.programs["prefill"], StepPlanProgram) and isinstance(ops.programs["prefill"], CpuProgram)
    got, want = mixed_steps([plan, ops], every_position)
    assert [g.shape[0] for g in got] == ([54, 45, 3] if every_position else [5, 4, 3])    # tokens or chunks
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch.equal(plan.kv_cache, ops.kv_cache)


def windowed(art, window: int, softcap: float):
    """`art` with a sliding window and a softcap on every paged attention (the optional attrs a
    Gemma-style model's graphs carry), written into the printed IR, which parses back."""
    options = f"window={window}, softcap={softcap!r}"
    graphs = {entry: parse_graph(re.sub(r"(= paged_(?:decode_)?attention\(.*?)\)( :)", rf"\1, {options})\2", str(g)))
              for entry, g in art.graphs.items()}
    return dataclasses.replace(art, graphs=graphs)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("variant", ["f32", "bf16_kv8"])
def test_plan_takes_window_and_softcap_bit_for_bit(artifact, variant, threads):
    """A window of one block and a softcap that bites: the plan equals the op-by-op native run
    (held to the refs by the kernel tests), and both differ from the run without them."""
    art = artifact("qwen2_bias", variant)
    options = windowed(art, 16, 0.5)
    assert str(options.graphs["decode"]).count("window=16, softcap=0.5") == 2        # both layers
    for steps in (lambda runs: decode_steps(runs, [1, 15, 16, 17, 40]), mixed_steps):
        plan, ops, plain = executor(options), executor(options, step_plans=False), executor(art)
        assert isinstance(plan.programs["prefill"], StepPlanProgram)
        got, want, without = steps([plan, ops, plain])
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert torch.equal(plan.kv_cache, ops.kv_cache)
        assert not torch.equal(got[-1], without[-1])


def widened(art):
    """`art` with every bf16 in its graphs and weights made f32: the same math on the same
    (bf16-valued) weights in fp32, the "exact" a bf16 run's error is measured against. The
    printed IR parses back, so the types and `dtype=` attributes change in its text."""
    graphs = {entry: parse_graph(re.sub(r"\bbf16\b", "f32", str(g))) for entry, g in art.graphs.items()}
    weights = {name: w.float() if w.dtype == torch.bfloat16 else w for name, w in art.weights.items()}
    return dataclasses.replace(art, graphs=graphs, weights=weights)


def ref_run(art, steps, exact: bool) -> tuple[list, list, list | None]:
    """The logits of every step of `steps` (decode_steps or mixed_steps): the plan's, the torch
    refs' and, with `exact`, the refs' on widened(art); each run on fresh executors."""
    runs = [executor(art, activations="float"), executor(art, kernels="reference")]   # the refs' float activations
    assert isinstance(runs[0].programs["decode"], StepPlanProgram)
    got, want, *wide = steps(runs + ([executor(widened(art), kernels="reference")] if exact else []))
    return got, want, wide[0] if exact else None


@pytest.fixture(scope="module")
def ref_runs(artifact):
    """(family, variant) -> ref_run of decode_steps and of mixed_steps, run once each."""
    cache = {}

    def get(family: str, variant: str):
        if (family, variant) not in cache:
            art, exact = artifact(family, variant), variant.startswith("bf16")
            cache[family, variant] = [ref_run(art, lambda exs: decode_steps(exs, [1, 17, 40]), exact),
                                      ref_run(art, mixed_steps, exact)]
        return cache[family, variant]

    return get


def assert_logits_match_refs(runs: list[tuple[list, list, list | None]], dtype: torch.dtype) -> None:
    """For each ref_run (plan, refs, exact): f32: each step's logits equal the refs' within the
    dtype tolerance. bf16 (the two round at different points): over all the run's steps, the
    plan's logits are as close to the fp32 run's as the bf16 refs' are, in RMS
    (tolerances.assert_as_close_as_ref)."""
    for got, want, exact in runs:
        if dtype == torch.float32:
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, **tolerance(dtype, 160, scale=4.0))
        else:
            assert_as_close_as_ref(torch.cat(got), torch.cat(want), torch.cat(exact), dtype, norm="rms")


REF_VARIANTS = ["f32", "bf16", "int8", "bf16_int4"]


def variant_dtype(variant: str) -> torch.dtype:
    return torch.bfloat16 if variant.startswith("bf16") else torch.float32


@pytest.mark.parametrize("variant", REF_VARIANTS)
@pytest.mark.parametrize("family", list(PLANNABLE))
def test_plan_matches_the_torch_refs(ref_runs, family, variant):
    assert_logits_match_refs(ref_runs(family, variant), variant_dtype(variant))


# Planted in the plan's logits. The bf16 refs are 1-4% (RMS) off the fp32 run in the llama
# families, so a 3% scale passes there as rounding; f32's tolerance is ~4e-4.
BUGS = {"negated": -1.0, "zeroed": 0.0, "5% high": 1.05, "5% low": 0.95, "3% high": 1.03}
PLANTED = [(v, bug) for v in REF_VARIANTS for bug in BUGS if not (v.startswith("bf16") and bug == "3% high")]


@pytest.mark.parametrize("variant,bug", PLANTED)
@pytest.mark.parametrize("family", list(PLANNABLE))
def test_a_bug_planted_in_the_plans_logits_fails_the_check(ref_runs, family, variant, bug):
    planted = [([g * BUGS[bug] for g in got], want, exact) for got, want, exact in ref_runs(family, variant)]
    with pytest.raises(AssertionError):
        assert_logits_match_refs(planted, variant_dtype(variant))


def test_plan_times_each_instruction(artifact):
    art = artifact("llama", "f32")
    ex = executor(art)
    seqs, blocks = sequences([5, 20])
    ex.run("prefill", build_step_inputs([Chunk(s, 0, s.num_tokens) for s in seqs], blocks))
    for s in seqs:
        s.num_computed = s.num_tokens
        s.output_ids.append(7)
    step = build_step_inputs([Chunk(s, s.num_tokens - 1, s.num_tokens) for s in seqs], blocks)
    logits, launches = ex.run_timed("decode", step)
    graph = art.graphs["decode"]
    # one launch a node, but a GEMM and the generated epilogue after it (linear+silu_mul): one call
    assert "+".join(t.label for t in launches).split("+") == [n.op for n in graph.nodes
                                                             if n.op not in ("input", "weight")]
    assert "linear+silu_mul" in [t.label for t in launches]
    assert all(t.seconds >= 0 for t in launches) and {t.kind for t in launches} >= {"gemm", "attention"}
    assert torch.equal(logits, ex.run("decode", step))                 # the same step again, untimed


def test_graphs_the_plan_cannot_take_run_op_by_op(artifact):
    art = artifact("llama", "unfused")
    with pytest.raises(NotPlannable, match=r"1 \(rmsnorm\) has no plan kernel"):    # without the generated kernels
        lower_step_plan(art.graphs["decode"], {}, BLOCK)
    art = artifact("llama", "f32")
    assert isinstance(executor(art, kernels="reference").programs["decode"], TorchProgram)
    with pytest.raises(NotPlannable, match="not prepared as"):      # the refs' plain weights
        lower_step_plan(art.graphs["decode"], dict(art.weights), BLOCK, kernels=load_cpu_kernels(art))
    assert isinstance(executor(art, block_size=32).programs["decode"], CpuProgram)
    programs = executor(art, step_plans=False).programs
    assert all(isinstance(p, CpuProgram) for p in programs.values())


def test_plan_declines_a_head_dim_its_rope_kernel_does_not_take(tiny_family):
    art = load_artifact(tiny_family("llama_gqa")[2])                   # hidden 72, head_dim 12
    assert isinstance(executor(art).programs["decode"], CpuProgram)


def test_bad_step_inputs_are_refused_before_anything_is_written(artifact):
    art = artifact("llama", "f32")
    ex = executor(art)
    seqs, blocks = sequences([4])
    ex.run("prefill", build_step_inputs([Chunk(s, 0, s.num_tokens) for s in seqs], blocks))
    seqs[0].num_computed = 4
    seqs[0].output_ids.append(299)
    step = build_step_inputs([Chunk(seqs[0], 4, 5)], blocks)
    cache = ex.kv_cache.clone()
    feeds = step.feeds(ex.kv_cache)
    program = ex.programs["decode"]
    with pytest.raises(RuntimeError, match="token id 300 is outside the vocabulary of 300"):
        program({**feeds, "input_ids": torch.tensor([300])})
    slots = ex.kv_cache.shape[2] * BLOCK                               # the pool and the scratch block
    with pytest.raises(RuntimeError, match=f"slot {slots} is outside the cache's {slots} slots"):
        program({**feeds, "slot_mapping": torch.tensor([slots])})
    with pytest.raises(RuntimeError, match="position -1 is outside the RoPE tables' 256 rows"):
        program({**feeds, "positions": torch.tensor([-1])})
    with pytest.raises(RuntimeError, match="block 99 of sequence 0 is outside the cache's"):
        program({**feeds, "block_tables": torch.full_like(feeds["block_tables"], 99)})
    with pytest.raises(RuntimeError, match="plan input 2 must be a contiguous CPU"):
        program({**feeds, "kv_cache": ex.kv_cache.to(torch.float64)})
    assert torch.equal(ex.kv_cache, cache)


def test_the_plan_runs_alike_through_pybind11_and_torchscript(artifact, capsys):
    """runtime/step_plan.py calls a plan through plan_binding.cpp's run_plan, not its TorchScript method;
    both run the same step to the same outputs, and bench_plan_call times the two."""
    art = artifact("llama", "f32")
    calls = bench_plan_call.decode_calls(Engine(art, EngineConfig()))
    with torch.inference_mode():
        pybind, torchscript = (call() for call in calls.values())
    assert len(pybind) == len(torchscript) and all(torch.equal(a, b) for a, b in zip(pybind, torchscript))
    bench_plan_call.main([str(art.path), "--steps", "1", "--flush-mib", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0].strip() for line in lines[1:]] == ["cold", "warm"], lines
    with pytest.raises(SystemExit, match="bench_plan_call: .* does not exist"):
        bench_plan_call.main([str(art.path / "missing")])


def test_the_plans_hold_the_prepared_weights_not_copies(artifact):
    """The prefill and decode plans take the panels and norm weights as prepare_weights left them:
    the engine's programs hold each stored weight once (plus the zero rows of the last panels), all in
    the executor's weight arena."""
    from llmc.runtime.engine import Engine, EngineConfig
    from test_gemv_kernels import padding_bytes, storages, tensor_bytes

    engine = Engine(artifact("llama_tied", "bf16").path, EngineConfig(backend_options={"kernels": "native"}))
    programs = engine.runner.executor.programs
    assert all(isinstance(p, StepPlanProgram) for p in programs.values())
    held = [v for p in programs.values() for v in p.constants]
    stored = sum(w.numel() * w.element_size() for w in engine.artifact.weights.values())
    assert sum(tensor_bytes(held).values()) == stored + padding_bytes(held)
    assert len(storages(held)) == 1
