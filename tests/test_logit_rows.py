"""Logit rows (issue 22's step model): a chunk asks for logits at its last `num_logits` positions;
the prefill graph's gather takes `logits_indices` i64[R], R logit rows, a dim of its own (not S).

On plain integers: the indices `build_step_inputs` emits, `logit_row_offsets`, the chunk's checks,
what counts as a pure decode. On a tiny Llama whose every graph is a native step plan: a prefill
step where chunks ask for 4 rows, 1 row, every position of a chunk over cached context and no row
gives, for every row, the logits of computing that position one step at a time (a prefill to it,
then one decode a token), within the tolerance of tests/tolerances.py (the two runs reduce in other
orders: other GEMM row counts, other attention splits), on the torch refs and on the step plans;
the plan equals the op-by-op native kernels bit for bit on the same step (its claim); the triton
executor's generated kernels (Triton's interpreter here) give the torch refs' rows. An artifact
whose prefill IR still types the gather by S (compiled before R) runs such steps the same, bit for
bit. The expected positions are worked out here, not read back from the chunk."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from llmc.compiler.codegen.aot import step_sizes
from llmc.compiler.driver import CompileConfig, compile_model
from llmc.compiler.dtypes import to_torch
from llmc.compiler.ir import parse_graph
from llmc.runtime.artifact import load_artifact
from llmc.runtime.block_manager import BlockManager
from llmc.runtime.cuda_graphs import pad_decode_step
from llmc.runtime.executor import KVCacheSpec
from llmc.runtime.model_runner import ModelRunner
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.scheduler import Chunk, ScheduledStep
from llmc.runtime.sequence import Sequence
from llmc.runtime.step_inputs import build_step_inputs, logit_row_offsets
from llmc.runtime.step_plan import StepPlanProgram
from llmc.runtime.torch_executor import TorchExecutor, TorchOptions
from tolerances import tolerance

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NUM_BLOCKS, BLOCK = 24, 16
PROMPT_LENS = (9, 5, 20, 7)
CONTEXT = {2: 3}                    # sequence -> tokens cached by an earlier step (its chunk starts there)
ROWS = {0: 4, 1: 1, 2: 17, 3: 0}    # sequence -> logit rows its chunk asks for: 4, 1, the whole chunk, none


def sequences(lens=PROMPT_LENS, seed: int = 0) -> tuple[list[Sequence], BlockManager]:
    g = torch.Generator().manual_seed(seed)
    blocks = BlockManager(NUM_BLOCKS, BLOCK)
    seqs = [Sequence(i, torch.randint(3, 300, (n,), generator=g).tolist(), SamplingParams(max_tokens=4))
            for i, n in enumerate(lens)]
    for s in seqs:
        blocks.allocate(s.seq_id, s.prompt_ids)
    return seqs, blocks


# -- on plain integers ---------------------------------------------------------------------------

def test_indices_name_each_chunks_last_positions_in_chunk_order():
    seqs, blocks = sequences()
    chunks = [Chunk(seqs[0], 0, 9, num_logits=4), Chunk(seqs[1], 0, 5), Chunk(seqs[2], 3, 20, num_logits=17),
              Chunk(seqs[3], 0, 7, num_logits=0)]
    step = build_step_inputs(chunks, blocks)
    # token rows: seq 0 at 0..8, seq 1 at 9..13, seq 2 (positions 3..19) at 14..30, seq 3 at 31..37
    assert step.logits_indices.tolist() == [5, 6, 7, 8, 13, *range(14, 31)]
    assert logit_row_offsets(chunks) == [0, 4, 5, 22, 22]
    assert [list(c.logit_positions) for c in chunks] == [[5, 6, 7, 8], [4], list(range(3, 20)), []]


def test_by_default_each_chunk_gives_its_last_token():
    seqs, blocks = sequences()
    chunks = [Chunk(seqs[0], 0, 9), Chunk(seqs[1], 2, 5), Chunk(seqs[2], 0, 1)]
    assert build_step_inputs(chunks, blocks).logits_indices.tolist() == [8, 11, 12]
    assert logit_row_offsets(chunks) == [0, 1, 2, 3] and logit_row_offsets([]) == [0]


def test_a_chunk_asks_only_for_positions_it_computes():
    seq = sequences()[0][0]
    for rows in (-1, 4):
        with pytest.raises(ValueError, match=f"3 tokens cannot ask for logits at {rows} positions"):
            Chunk(seq, 2, 5, num_logits=rows)


def test_a_pure_decode_has_one_logit_row_a_sequence():
    seqs, _ = sequences()
    decode = [Chunk(s, s.num_tokens - 1, s.num_tokens) for s in seqs]
    assert ScheduledStep(decode, [], []).is_pure_decode
    silent = [dataclasses.replace(decode[0], num_logits=0), *decode[1:]]
    assert not ScheduledStep(silent, [], []).is_pure_decode


def test_decode_graphs_refuse_a_step_whose_rows_are_not_its_sequences():
    seqs, blocks = sequences()
    step = build_step_inputs([Chunk(s, s.num_tokens - 1, s.num_tokens) for s in seqs], blocks)
    assert pad_decode_step(step, 8, 4, NUM_BLOCKS, BLOCK).logits_indices.tolist() == list(range(8))
    wider = dataclasses.replace(step, logits_indices=torch.arange(5))
    with pytest.raises(ValueError, match="5 logit rows"):
        pad_decode_step(wider, 8, 4, NUM_BLOCKS, BLOCK)


def test_aot_binds_logit_rows_for_every_token():
    assert step_sizes("prefill", 24)["R"] == 24 and step_sizes("prefill", 24)["S"] == 3
    assert step_sizes("decode", 24)["R"] == step_sizes("decode", 24)["S"] == 24


# -- on a tiny model -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def art(tiny_family):
    return load_artifact(tiny_family("llama_hd32")[2])


def test_prefill_gathers_logit_rows_decode_has_none(art):
    prefill, decode = art.graphs["prefill"], art.graphs["decode"]
    assert prefill.node_map()["logits_indices"].type.shape == ("R",)
    assert prefill.type_of(prefill.outputs[0]).shape[0] == "R"
    assert "logits_indices" not in decode.node_map() and decode.type_of(decode.outputs[0]).shape[0] == "S"
    assert "[R," in str(prefill) and "R" not in {d for n in decode.nodes for t in n.types for d in t.shape}


def executor(art, kernels: str, step_plans: bool = True) -> TorchExecutor:
    kv = KVCacheSpec.from_graph_type(art.graphs["prefill"].node_map()["kv_cache"].type, NUM_BLOCKS, BLOCK)
    return TorchExecutor(art, torch.device("cpu"), kv, TorchOptions(kernels=kernels, step_plans=step_plans))


def multi_row_step(ex: TorchExecutor) -> list[torch.Tensor]:
    """Each sequence's logit rows from one prefill step that asks for ROWS (after CONTEXT's step,
    which asks for none)."""
    seqs, blocks = sequences()
    context = [Chunk(seqs[i], 0, n, num_logits=0) for i, n in CONTEXT.items()]
    assert ex.run("prefill", build_step_inputs(context, blocks)).shape[0] == 0
    chunks = [Chunk(s, CONTEXT.get(i, 0), s.num_tokens, num_logits=ROWS[i]) for i, s in enumerate(seqs)]
    logits, offsets = ex.run("prefill", build_step_inputs(chunks, blocks)), logit_row_offsets(chunks)
    assert logits.shape[0] == offsets[-1] == sum(ROWS.values())
    return [logits[a:b] for a, b in zip(offsets, offsets[1:])]


def one_at_a_time(ex: TorchExecutor) -> list[torch.Tensor]:
    """Each sequence's logits at the same positions (its last ROWS[i]), one position a step: a
    prefill up to the first, then a decode step a token (the engine's path without speculation)."""
    seqs, blocks = sequences()
    rows = []
    for i, s in enumerate(seqs):
        positions = range(s.num_tokens - ROWS[i], s.num_tokens)
        if not positions:
            rows.append(None)
            continue
        steps = [("prefill", Chunk(s, 0, positions[0] + 1))] + [("decode", Chunk(s, p, p + 1)) for p in positions[1:]]
        rows.append(torch.cat([ex.run(entry, build_step_inputs([c], blocks)) for entry, c in steps]))
    return rows


def assert_rows_close(art, got: list[torch.Tensor], want: list[torch.Tensor | None]) -> None:
    """Each sequence's rows of `got` have ROWS' count and are `want`'s (None or empty: no rows to
    compare) within the dtype's tolerance for the model's longest reduction."""
    cfg, prefill = art.config, art.graphs["prefill"]
    dtype = to_torch(prefill.type_of(prefill.outputs[0]).dtype)
    reduction = max(cfg.hidden_size, cfg.intermediate_size, max(PROMPT_LENS))
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == (ROWS[i], cfg.vocab_size)
        if w is not None and w.numel():
            torch.testing.assert_close(g, w, **tolerance(dtype, reduction, scale=w.abs().max().item()),
                                       msg=lambda m, i=i: f"sequence {i}'s logit rows: {m}")


@pytest.mark.parametrize("kernels", ["reference", "native"])
def test_logit_rows_equal_one_position_a_step(art, kernels):
    ex = executor(art, kernels)
    assert isinstance(ex.programs["prefill"], StepPlanProgram) == (kernels == "native")
    assert_rows_close(art, multi_row_step(ex), one_at_a_time(executor(art, kernels)))


def test_triton_kernels_give_the_refs_logit_rows(art, tiny_family, tmp_path_factory):
    path = compile_model(tiny_family("llama_hd32")[1], tmp_path_factory.mktemp("cuda") / "art",
                         CompileConfig(target="cuda"))
    triton = ModelRunner.for_backend(load_artifact(path), NUM_BLOCKS, BLOCK, "triton").executor
    assert_rows_close(art, multi_row_step(triton), multi_row_step(executor(art, "reference")))


def test_plan_equals_op_by_op_native_on_logit_rows_bit_for_bit(art):
    plan, ops = executor(art, "native"), executor(art, "native", step_plans=False)
    assert isinstance(plan.programs["prefill"], StepPlanProgram)
    assert all(torch.equal(g, w) for g, w in zip(multi_row_step(plan), multi_row_step(ops)))


def typed_by_sequences(art):
    """`art` as compiled before logit rows had their own dim: the prefill gather typed by S."""
    text = re.sub(r"\[R\b", "[S", str(art.graphs["prefill"]))
    assert "logits_indices = input() : i64[S]" in text
    return dataclasses.replace(art, graphs={**art.graphs, "prefill": parse_graph(text)})


@pytest.mark.parametrize("kernels", ["reference", "native"])
def test_an_artifact_typed_by_sequences_runs_logit_rows_the_same(art, kernels):
    old, new = executor(typed_by_sequences(art), kernels), executor(art, kernels)
    assert isinstance(old.programs["prefill"], StepPlanProgram) == (kernels == "native")
    assert all(torch.equal(g, w) for g, w in zip(multi_row_step(old), multi_row_step(new)))
