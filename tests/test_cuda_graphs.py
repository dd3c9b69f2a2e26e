"""CUDA-graph decode, the parts a CPU can check: batch sizes, padding, the metadata buffers, and
that a padded decode step (replayed by the eager stand-in of a graph) writes only the scratch
block and gives the unpadded step's logits. On a GPU the same path replays captured graphs
(`llmc.tools.gpu_check` measures it)."""

from __future__ import annotations

import pytest
import torch

from llmc.runtime.artifact import load_artifact
from llmc.runtime.block_manager import BlockManager
from llmc.runtime.cuda_graphs import addresses, decode_batch_sizes, pad_decode_step
from llmc.runtime.engine import EngineConfig
from llmc.runtime.backends import resolve_backend
from llmc.runtime.model_runner import ModelRunner
from llmc.runtime.sampling_params import RequestError, SamplingParams
from llmc.runtime.scheduler import Chunk
from llmc.runtime.sequence import Sequence
from llmc.runtime.step_inputs import StepBuffers, build_step_inputs
from tolerances import tolerance

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NUM_BLOCKS, BLOCK_SIZE = 12, 16


def test_batch_sizes_cover_every_batch_up_to_the_largest():
    assert decode_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert decode_batch_sizes(5) == [1, 2, 4, 5]
    assert decode_batch_sizes(1) == [1]
    big = decode_batch_sizes(300)
    assert big[-3:] == [256, 288, 300] and big == sorted(set(big))
    with pytest.raises(ValueError, match="max_num_seqs"):
        decode_batch_sizes(0)


def _decode_step(lens: list[int], tables: list[list[int]]):
    seqs = [Sequence(i, list(range(3, 3 + n)), SamplingParams()) for i, n in enumerate(lens)]
    blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    for seq, n in zip(seqs, lens):
        blocks.allocate(seq.seq_id, seq.prompt_ids)
    step = build_step_inputs([Chunk(s, n - 1, n) for s, n in zip(seqs, lens)], blocks)
    assert step.block_tables.tolist() == tables
    return step


def test_padding_rows_point_at_the_scratch_block_only():
    step = _decode_step([20, 3, 40], [[0, 1, 0], [2, 0, 0], [3, 4, 5]])
    padded = pad_decode_step(step, 8, 6, scratch_block=NUM_BLOCKS, block_size=BLOCK_SIZE)
    for name in ("input_ids", "positions", "seq_lens", "slot_mapping"):
        assert torch.equal(getattr(padded, name)[:3], getattr(step, name)), name
    assert padded.slot_mapping[3:].tolist() == [NUM_BLOCKS * BLOCK_SIZE] * 5
    assert padded.seq_lens[3:].tolist() == [1] * 5 and padded.positions[3:].tolist() == [0] * 5
    assert torch.equal(padded.block_tables[:3, :3], step.block_tables)
    assert (padded.block_tables[:3, 3:] == 0).all() and (padded.block_tables[3:] == NUM_BLOCKS).all()
    assert padded.query_start_loc.tolist() == list(range(9)) and padded.logits_indices.tolist() == list(range(8))
    with pytest.raises(ValueError, match="cannot pad"):
        pad_decode_step(step, 2, 6, NUM_BLOCKS, BLOCK_SIZE)          # fewer rows than sequences
    with pytest.raises(ValueError, match="cannot pad"):
        pad_decode_step(step, 4, 2, NUM_BLOCKS, BLOCK_SIZE)          # a narrower table


def test_step_buffers_hold_a_step_in_one_buffer_at_fixed_addresses():
    buffers = StepBuffers(torch.device("cpu"), capacity=64)
    step = pad_decode_step(_decode_step([20, 3, 40], [[0, 1, 0], [2, 0, 0], [3, 4, 5]]), 4, 5, NUM_BLOCKS,
                           BLOCK_SIZE)
    views = buffers.load(step)
    for name in step.__dataclass_fields__:
        got, want = getattr(views, name), getattr(step, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    other = pad_decode_step(_decode_step([5, 17], [[0, 0], [1, 2]]), 4, 5, NUM_BLOCKS, BLOCK_SIZE)
    again = buffers.load(other)
    assert addresses(again) == addresses(views)                        # same shape, same addresses
    assert torch.equal(again.seq_lens, other.seq_lens)
    assert buffers.capacity == 64
    huge = pad_decode_step(step, 64, 40, NUM_BLOCKS, BLOCK_SIZE)
    assert torch.equal(buffers.load(huge).block_tables, huge.block_tables)
    assert buffers.capacity == StepBuffers.elements(huge) == 4 * 64 + (65 + 64 + 64 * 40 + 1) // 2


# ------------------------------------------------------------------ padded decode on the torch backend


def _prefilled_runner(artifact, backend: str = "torch") -> tuple[ModelRunner, list[torch.Tensor], BlockManager,
                                                                   list[Sequence]]:
    options = {"cuda_graphs": False, **({"kernels": "reference"} if backend == "torch" else {})}
    runner = ModelRunner.for_backend(artifact, NUM_BLOCKS, BLOCK_SIZE, backend, options)
    blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    g = torch.Generator().manual_seed(0)
    seqs = [Sequence(i, torch.randint(3, 300, (n,), generator=g).tolist(), SamplingParams())
            for i, n in enumerate((37, 5, 20))]
    for s in seqs:
        blocks.allocate(s.seq_id, s.prompt_ids)
        blocks.append(s.seq_id, s.num_tokens + 4)
    runner.run("prefill", build_step_inputs([Chunk(s, 0, s.num_tokens) for s in seqs], blocks))
    return runner, blocks, seqs


def _decode(runner, blocks, seqs, token: int) -> torch.Tensor:
    for s in seqs:
        s.output_ids.append(token)
    return runner.run("decode", build_step_inputs([Chunk(s, s.num_tokens - 1, s.num_tokens) for s in seqs], blocks))


@pytest.fixture(scope="module")
def artifact(tiny_family):
    return load_artifact(tiny_family("llama_gqa")[2])


def test_padded_decode_writes_only_the_scratch_block_and_gives_the_unpadded_logits(artifact):
    eager, blocks, seqs = _prefilled_runner(artifact)
    padded, _, padded_seqs = _prefilled_runner(artifact)
    scratch = padded.executor.scratch_block
    before = padded.kv_cache.clone()
    padded.executor.capture_decode_graphs(max_num_seqs=8, max_blocks=4, stand_in=True)
    live = [b for b in range(NUM_BLOCKS + 1) if b != scratch]
    assert torch.equal(padded.kv_cache[:, :, live], before[:, :, live]), "warm-up wrote outside the scratch block"
    padded.kv_cache[:, :, scratch] = float("nan")       # whatever a live row read from it would show
    rows = []
    padded.executor.run_step = _recording(padded.executor.run_step, rows)
    tol = tolerance(torch.float32, artifact.config.intermediate_size, scale=4.0)
    for i in range(3):
        want, got = _decode(eager, blocks, seqs, 7 + i), _decode(padded, blocks, padded_seqs, 7 + i)
        assert rows[-1] == 4, "the step did not take the batch-4 graph"
        torch.testing.assert_close(got, want, **tol)
        torch.testing.assert_close(padded.kv_cache[:, :, live], eager.kv_cache[:, :, live], **tol)
        untouched = [b for b in live if b not in {blocks.block_table(s.seq_id)[-1] for s in seqs}]
        assert torch.equal(padded.kv_cache[:, :, untouched], eager.kv_cache[:, :, untouched])
    # the padding rows wrote layer 0's K/V at their slot (later layers hold what NaN made of them)
    assert not padded.kv_cache[0, :, scratch, :, 0].isnan().any(), "the padding rows wrote no scratch slot"


def _recording(run, rows: list[int]):
    def wrapped(entry, step):
        rows.append(step.input_ids.numel())
        return run(entry, step)
    return wrapped


def test_timing_a_replay_runs_padding_rows_only(artifact):
    runner, _, _ = _prefilled_runner(artifact)
    runner.executor.capture_decode_graphs(max_num_seqs=2, max_blocks=4, stand_in=True)
    before = runner.kv_cache[:, :, :NUM_BLOCKS].clone()
    assert runner.executor.graphs.replay_seconds(2, repeats=2) > 0
    assert torch.equal(runner.kv_cache[:, :, :NUM_BLOCKS], before)


def test_a_step_the_graphs_cannot_take_runs_eagerly(artifact):
    runner, blocks, seqs = _prefilled_runner(artifact)
    runner.executor.capture_decode_graphs(max_num_seqs=2, max_blocks=4, stand_in=True)
    rows = []
    runner.executor.run_step = _recording(runner.executor.run_step, rows)
    logits = _decode(runner, blocks, seqs, 9)                  # 3 sequences > the largest size, 2
    assert rows == [3] and logits.shape[0] == 3


def test_device_and_graph_options_are_checked(artifact):
    with pytest.raises(RequestError, match="device 'tpu' is unknown"):
        EngineConfig(device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(RequestError, match="no CUDA GPU"):
            resolve_backend("torch", artifact, "cuda")
        runner = ModelRunner.for_backend(artifact, NUM_BLOCKS, BLOCK_SIZE, "torch",
                                         {"kernels": "reference", "cuda_graphs": True})
        assert not runner.cuda_graphs and runner.graph_report is None


def test_triton_kernels_take_the_padded_step_and_leave_live_blocks_alone(tiny_family, tmp_path):
    """The generated Triton kernels (in the interpreter here) on a decode step padded from 3 to 4
    rows, NaN in the scratch block: live logits match the torch backend's unpadded step."""
    from llmc.compiler.driver import CompileConfig, compile_model

    cuda = load_artifact(compile_model(tiny_family("llama_gqa")[1], tmp_path / "cuda", CompileConfig(target="cuda")))
    eager, blocks, seqs = _prefilled_runner(cuda, "torch")
    padded, _, padded_seqs = _prefilled_runner(cuda, "triton")
    padded.executor.capture_decode_graphs(max_num_seqs=4, max_blocks=4, stand_in=True)
    padded.kv_cache[:, :, padded.executor.scratch_block] = float("nan")
    tol = tolerance(torch.float32, cuda.config.intermediate_size, scale=4.0)
    torch.testing.assert_close(_decode(padded, blocks, padded_seqs, 11), _decode(eager, blocks, seqs, 11), **tol)
    live = list(range(NUM_BLOCKS))
    torch.testing.assert_close(padded.kv_cache[:, :, live], eager.kv_cache[:, :, live], **tol)


def test_cuda_graphs_flag_on_a_cpu_says_it_does_nothing(tiny_family):
    from typer.testing import CliRunner

    from llmc.tools.cli import app

    artifact = tiny_family("llama_gqa")[2]
    result = CliRunner().invoke(app, ["generate", str(artifact), "hi", "--max-tokens", "2", "--no-chat",
                                      "--cuda-graphs"])
    assert result.exit_code == 0, result.output
    assert "--cuda-graphs does nothing here: without a CUDA GPU there is nothing to capture" in result.stderr
    quiet = CliRunner().invoke(app, ["generate", str(artifact), "hi", "--max-tokens", "2", "--no-chat",
                                     "--no-cuda-graphs"])
    assert quiet.exit_code == 0 and "cuda-graphs" not in quiet.stderr


@pytest.mark.gpu
def test_captured_graphs_replay_the_eager_triton_step_on_a_gpu(tiny_family, tmp_path):
    """On a GPU: real CUDA graphs (batch 3 replayed as 4) give the eager launches' logits and cache."""
    from llmc.compiler.driver import CompileConfig, compile_model

    cuda = load_artifact(compile_model(tiny_family("llama_gqa")[1], tmp_path / "cuda", CompileConfig(target="cuda")))
    eager, blocks, seqs = _prefilled_runner(cuda, "triton")
    graphs = ModelRunner.for_backend(cuda, NUM_BLOCKS, BLOCK_SIZE, "triton", {"cuda_graphs": True}, max_num_seqs=8)
    assert graphs.cuda_graphs and graphs.graph_report.batch_sizes == (1, 2, 4, 8)
    replayed = _Follower(graphs, blocks, seqs)
    tol = tolerance(torch.float32, cuda.config.intermediate_size, scale=4.0)
    for i in range(3):
        want = _decode(eager, blocks, seqs, 7 + i)
        torch.testing.assert_close(replayed.decode(), want, **tol)
    live = list(range(NUM_BLOCKS))
    torch.testing.assert_close(graphs.kv_cache[:, :, live], eager.kv_cache[:, :, live], **tol)


class _Follower:
    """Replays on `runner` the steps another runner just ran: the same chunks, on `runner`'s cache
    (prefilled here from the same prompts)."""

    def __init__(self, runner: ModelRunner, blocks: BlockManager, seqs: list[Sequence]):
        self.runner, self.blocks, self.seqs = runner, blocks, seqs
        prompts = [Chunk(s, 0, len(s.prompt_ids)) for s in seqs]
        runner.run("prefill", build_step_inputs(prompts, blocks))

    def decode(self) -> torch.Tensor:
        chunks = [Chunk(s, s.num_tokens - 1, s.num_tokens) for s in self.seqs]
        return self.runner.run("decode", build_step_inputs(chunks, self.blocks))
