"""CUDA graphs of the speculative verify step, the parts a CPU can check: which (batch size, verify
width) keys are captured, padding a step of S sequences of w tokens each to B rows, and that a
padded verify step (replayed by the eager stand-in of a graph) gives the eager prefill step's live
logits and cache bit for bit while its padding rows write the scratch block's first w slots only;
steps the graphs cannot take run eagerly; an engine whose verify steps replay graphs emits what
plain greedy emits."""

from __future__ import annotations

import pytest
import torch

from llmc.runtime.artifact import load_artifact
from llmc.runtime.block_manager import BlockManager
from llmc.runtime.cuda_graphs import (VERIFY_MAX_TOKENS, pad_decode_step, verify_batch_sizes,
                                      verify_graph_sizes)
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.executor import Executor
from llmc.runtime.model_runner import ModelRunner
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.scheduler import Chunk
from llmc.runtime.sequence import Sequence
from llmc.runtime.speculative.speculator import SpeculativeConfig
from llmc.runtime.step_inputs import build_step_inputs
from tolerances import tolerance

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NUM_BLOCKS, BLOCK_SIZE = 12, 16
PROMPTS = (37, 5, 20)


def test_verify_widths_fit_a_block_and_batch_sizes_a_token_budget():
    assert verify_batch_sizes(64, 5) == [1, 2, 4, 8, 16, 24, 32, 48]            # 48 * 5 <= 256 < 64 * 5
    assert all(b * 17 <= VERIFY_MAX_TOKENS for b in verify_batch_sizes(512, 17))
    assert verify_graph_sizes(4, 1, BLOCK_SIZE) == {}                           # no drafts: no verify graphs
    assert verify_graph_sizes(4, 3, BLOCK_SIZE) == {2: [1, 2, 4], 3: [1, 2, 4]}
    assert max(verify_graph_sizes(8, 17, BLOCK_SIZE)) == BLOCK_SIZE             # w <= block_size
    assert max(verify_graph_sizes(8, 17, 4)) == 4


def _setup(lens=PROMPTS) -> tuple[BlockManager, list[Sequence]]:
    g = torch.Generator().manual_seed(0)
    seqs = [Sequence(i, torch.randint(3, 300, (n,), generator=g).tolist(), SamplingParams())
            for i, n in enumerate(lens)]
    blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    for s in seqs:
        blocks.allocate(s.seq_id, s.prompt_ids)
        blocks.append(s.seq_id, s.num_tokens + 8)
    return blocks, seqs


def _verify_chunks(seqs: list[Sequence], widths: list[int], token: int) -> list[Chunk]:
    """Each sequence gains `token` and verifies w - 1 drafts after it: w tokens, w logit rows."""
    chunks = []
    for s, w in zip(seqs, widths):
        s.output_ids.append(token)
        s.draft_ids[:] = [token + 1 + j for j in range(w - 1)]
        chunks.append(Chunk(s, s.num_tokens - 1, s.num_tokens + w - 1, num_logits=w))
    return chunks


def test_padding_rows_compute_w_tokens_on_the_scratch_block_only():
    blocks, seqs = _setup()
    step = build_step_inputs(_verify_chunks(seqs, [3, 3, 3], 7), blocks)
    padded = pad_decode_step(step, 5, 6, NUM_BLOCKS, BLOCK_SIZE, tokens=3)
    for name in ("input_ids", "positions", "seq_lens", "slot_mapping"):
        live = getattr(step, name).numel()
        assert torch.equal(getattr(padded, name)[:live], getattr(step, name)), name
    first = NUM_BLOCKS * BLOCK_SIZE
    assert padded.positions[9:].tolist() == [0, 1, 2] * 2 and padded.input_ids[9:].tolist() == [0] * 6
    assert padded.slot_mapping[9:].tolist() == [first, first + 1, first + 2] * 2
    assert padded.seq_lens[3:].tolist() == [3, 3] and (padded.block_tables[3:] == NUM_BLOCKS).all()
    assert torch.equal(padded.block_tables[:3, :3], step.block_tables) and (padded.block_tables[:3, 3:] == 0).all()
    assert padded.query_start_loc.tolist() == list(range(0, 16, 3))
    assert padded.logits_indices.tolist() == list(range(15))


def test_padding_refuses_what_it_cannot_pad():
    blocks, seqs = _setup()
    step = build_step_inputs(_verify_chunks(seqs, [3, 3, 3], 7), blocks)
    refused = {
        "fewer rows than sequences": (step, 2, 6, 3),
        "a narrower block table": (step, 4, 2, 3),
        "another width": (step, 4, 6, 2),
        "wider than a block": (step, 4, 6, BLOCK_SIZE + 1),
    }
    for s in seqs:
        s.output_ids.pop()
    mixed = build_step_inputs(_verify_chunks(seqs, [2, 3, 4], 7), blocks)
    refused["mixed widths"] = (mixed, 4, 6, 3)
    for s in seqs:
        s.output_ids.pop()
    chunks = _verify_chunks(seqs, [3, 3, 3], 7)
    chunks[1] = Chunk(chunks[1].seq, chunks[1].start, chunks[1].end, num_logits=1)     # a prompt-like chunk
    refused["a row asking fewer logits than tokens"] = (build_step_inputs(chunks, blocks), 4, 6, 3)
    for why, (bad, batch, width, tokens) in refused.items():
        with pytest.raises(ValueError, match="cannot pad"):
            pad_decode_step(bad, batch, width, NUM_BLOCKS, BLOCK_SIZE, tokens=tokens)
            pytest.fail(why)


@pytest.fixture(scope="module")
def artifact(tiny_family):
    return load_artifact(tiny_family("llama_gqa")[2])


def _runners(artifact, blocks, seqs, max_verify_width: int = 5, max_num_seqs: int = 4, backend: str = "torch"):
    """An eager runner (torch reference) and one on `backend` replaying (stand-in) graphs, prefilled
    alike; the graphs' run records (entry, tokens) of every step it runs."""
    reference = {"cuda_graphs": False, "kernels": "reference"}
    eager = ModelRunner.for_backend(artifact, NUM_BLOCKS, BLOCK_SIZE, "torch", reference)
    options = reference if backend == "torch" else {"cuda_graphs": False}
    graphs = ModelRunner.for_backend(artifact, NUM_BLOCKS, BLOCK_SIZE, backend, options)
    prefill = build_step_inputs([Chunk(s, 0, s.num_tokens) for s in seqs], blocks)
    for runner in (eager, graphs):
        runner.run("prefill", prefill)
    graphs.executor.capture_decode_graphs(max_num_seqs, max_blocks=4, stand_in=True,
                                          max_verify_width=max_verify_width)
    runs: list[tuple[str, int]] = []
    inner = graphs.executor.run_step
    graphs.executor.run_step = lambda entry, step: runs.append((entry, step.input_ids.numel())) or inner(entry, step)
    return eager, graphs, runs


@pytest.mark.parametrize("live, width, batch", [(3, 2, 4), (1, 5, 1), (2, 3, 2), (3, 4, 4), (3, 5, 4)])
def test_a_padded_verify_step_gives_the_eager_prefill_logits_and_cache(artifact, live, width, batch):
    blocks, seqs = _setup()
    eager, graphs, runs = _runners(artifact, blocks, seqs)
    scratch = graphs.executor.scratch_block
    for token in (7, 8):
        step = build_step_inputs(_verify_chunks(seqs[:live], [width] * live, token), blocks)
        graphs.kv_cache[:, :, scratch] = float("nan")       # whatever a live row read from it would show
        before = graphs.kv_cache.clone()
        want, got = eager.run("prefill", step), graphs.run("prefill", step)
        assert runs[-1] == ("prefill", batch * width), "the step did not replay the (batch, width) graph"
        assert got.shape == want.shape == (live * width, artifact.config.vocab_size)
        assert torch.equal(got, want)
        assert torch.equal(graphs.kv_cache[:, :, :scratch], eager.kv_cache[:, :, :scratch])
        _assert_only_live_slots_changed(graphs.kv_cache, before, step.slot_mapping, scratch)
        nan = graphs.kv_cache[:, :, scratch].isnan()
        assert nan[:, :, :, width:].all(), "the padding rows wrote past the scratch block's first w slots"
        if batch > live:
            assert not nan[0, :, :, :width].any(), "the padding rows did not write the scratch block's first w slots"
        for s in seqs[:live]:
            s.draft_ids.clear()


def _assert_only_live_slots_changed(cache, before, slots, scratch):
    """Every live block's slot outside `slots` is as it was (cache [L, 2, NB, KVH, BS, D])."""
    live = cache[:, :, :scratch].transpose(3, 4).flatten(2, 3)             # [L, 2, NB * BS, KVH, D]
    was = before[:, :, :scratch].transpose(3, 4).flatten(2, 3)
    kept = torch.ones(live.shape[2], dtype=torch.bool)
    kept[slots] = False
    assert torch.equal(live[:, :, kept], was[:, :, kept]), "a step wrote a live slot it does not own"


def test_triton_kernels_take_a_padded_verify_step(tiny_family, tmp_path):
    """The generated Triton kernels (in the interpreter here) on a verify step of 3 sequences of
    width 3 padded to 4 rows, NaN in the scratch block: live logits and cache match the torch
    reference's unpadded prefill step (other kernels: within tolerance)."""
    from llmc.compiler.driver import CompileConfig, compile_model

    cuda = load_artifact(compile_model(tiny_family("llama_gqa")[1], tmp_path / "cuda", CompileConfig(target="cuda")))
    blocks, seqs = _setup()
    eager, graphs, runs = _runners(cuda, blocks, seqs, max_verify_width=3, backend="triton")
    graphs.kv_cache[:, :, graphs.executor.scratch_block] = float("nan")
    step = build_step_inputs(_verify_chunks(seqs, [3, 3, 3], 11), blocks)
    tol = tolerance(torch.float32, cuda.config.intermediate_size, scale=4.0)
    torch.testing.assert_close(graphs.run("prefill", step), eager.run("prefill", step), **tol)
    assert runs[-1] == ("prefill", 12)
    torch.testing.assert_close(graphs.kv_cache[:, :, :NUM_BLOCKS], eager.kv_cache[:, :, :NUM_BLOCKS], **tol)


@pytest.mark.parametrize("case", ["mixed widths", "wider than captured", "verify beside a plain decode",
                                  "more sequences than captured", "fewer logit rows than tokens"])
def test_a_verify_step_the_graphs_cannot_take_runs_eagerly(artifact, case):
    blocks, seqs = _setup()
    eager, graphs, runs = _runners(artifact, blocks, seqs, max_verify_width=3, max_num_seqs=2)
    widths = {"mixed widths": [2, 3], "wider than captured": [4, 4], "verify beside a plain decode": [1, 3],
              "more sequences than captured": [2, 2, 2], "fewer logit rows than tokens": [3, 3]}[case]
    chunks = _verify_chunks(seqs[:len(widths)], widths, 9)
    if case == "fewer logit rows than tokens":
        chunks[0] = Chunk(chunks[0].seq, chunks[0].start, chunks[0].end, num_logits=2)
    step = build_step_inputs(chunks, blocks)
    got, want = graphs.run("prefill", step), eager.run("prefill", step)
    assert runs == [("prefill", sum(widths))], "the step was padded instead of running eagerly"
    assert torch.equal(got, want)


def test_the_engine_captures_verify_widths_up_to_one_plus_its_drafts(artifact, monkeypatch):
    asked = []
    monkeypatch.setattr(Executor, "capture_decode", lambda self, seqs, width=1: asked.append((seqs, width)))
    Engine(artifact, EngineConfig(kv_cache_bytes=2**20, max_num_seqs=8,
                                  speculative=SpeculativeConfig("ngram", 3, adaptive=False)))
    Engine(artifact, EngineConfig(kv_cache_bytes=2**20, max_num_seqs=8))
    assert asked == [(8, 4), (8, 1)]


def test_an_engine_replaying_verify_graphs_emits_plain_greedy(artifact):
    """The target drafts for itself, so every decode verifies 3 drafts (width 4): those steps replay
    the verify graphs, and the tokens are plain greedy's."""
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 3, [9, 10, 11], [12] * 7]
    config = EngineConfig(kv_cache_bytes=2**20, max_num_seqs=4)
    want = [o.token_ids for o in Engine(artifact, config).generate(prompts, greedy)]
    spec = Engine(artifact, EngineConfig(kv_cache_bytes=2**20, max_num_seqs=4,
                                         speculative=SpeculativeConfig(f"draft:{artifact.path}", 3, adaptive=False)))
    executor = spec.runner.executor
    context = artifact.config.max_position_embeddings
    report = executor.capture_decode_graphs(4, min(executor.scratch_block, -(-context // executor.block_size)),
                                            stand_in=True, max_verify_width=4)
    assert report.verify == tuple((w, (1, 2, 4)) for w in (2, 3, 4))
    assert "verify step for widths 2..4" in report.describe()
    replayed = []
    replay = executor.graphs.replay
    executor.graphs.replay = lambda step, key: replayed.append(key) or replay(step, key)
    assert [o.token_ids for o in spec.generate(prompts, greedy)] == want
    assert (4, 4) in replayed, f"no verify step of 3 sequences replayed the (4, 4) graph: {replayed}"
    assert spec.blocks.num_free_blocks == spec.blocks.num_blocks
