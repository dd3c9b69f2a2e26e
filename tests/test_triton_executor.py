"""End to end: tiny models of every family compiled with --target cuda, their generated kernels run
by the triton executor (in Triton's interpreter here) through a prefill, a chunked prefill mixed
with a decode, and 8 decode steps, give the torch executor's logits within fp32 tolerance."""

from __future__ import annotations

import pytest
import torch

from llmc.compiler.driver import CompileConfig, compile_model
from llmc.runtime.artifact import Artifact, load_artifact
from llmc.runtime.block_manager import BlockManager
from llmc.runtime.model_runner import ModelRunner
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.scheduler import Chunk
from llmc.runtime.sequence import Sequence
from llmc.runtime.step_inputs import build_step_inputs
from tiny_models import FAMILIES
from tolerances import tolerance

NUM_BLOCKS, BLOCK_SIZE = 24, 16


@pytest.fixture(scope="module")
def cuda_artifact(tiny_family, tmp_path_factory):
    """family -> the tiny model compiled for the cuda target (built once each)."""
    cache = {}

    def get(family: str):
        if family not in cache:
            folder = tiny_family(family)[1]
            cache[family] = compile_model(folder, tmp_path_factory.mktemp(family) / "cuda",
                                          CompileConfig(target="cuda"))
        return cache[family]

    return get


def steps(seqs: list[Sequence], decodes: int):
    """(entry, chunks) of each step: a prefill, a chunked prefill with a decode, then decodes."""
    long, short, one = seqs
    yield "prefill", [Chunk(long, 0, 10), Chunk(short, 0, short.num_tokens)]
    short.output_ids.append(5)
    yield "prefill", [Chunk(long, 10, long.num_tokens), Chunk(short, short.num_tokens - 1, short.num_tokens),
                      Chunk(one, 0, 1)]
    for i in range(decodes):
        for s in seqs:
            s.output_ids.append(7 + 13 * i)
        yield "decode", [Chunk(s, s.num_tokens - 1, s.num_tokens) for s in seqs]


def run_backend(artifact, backend: str, decodes: int = 8) -> list[torch.Tensor]:
    """Logits of every step of `steps` (artifact: a path, or an Artifact already loaded)."""
    art = artifact if isinstance(artifact, Artifact) else load_artifact(artifact)
    options = {"kernels": "reference"} if backend == "torch" else {}
    runner, blocks = ModelRunner.for_backend(art, NUM_BLOCKS, BLOCK_SIZE, backend, options), BlockManager(NUM_BLOCKS,
                                                                                                        BLOCK_SIZE)
    assert runner.backend == backend and type(runner.executor).backend == backend
    g = torch.Generator().manual_seed(0)
    seqs = [Sequence(i, torch.randint(3, 300, (n,), generator=g).tolist(), SamplingParams(max_tokens=9))
            for i, n in enumerate((37, 5, 1))]
    for s in seqs:
        blocks.allocate(s.seq_id, s.prompt_ids)
        blocks.append(s.seq_id, s.num_tokens + 9)
    logits = []
    for entry, chunks in steps(seqs, decodes):
        logits.append(runner.run(entry, build_step_inputs(chunks, blocks)))
    return logits


@pytest.mark.parametrize("family", list(FAMILIES))
def test_triton_executor_gives_the_torch_executors_logits(cuda_artifact, family):
    artifact = cuda_artifact(family)
    config = load_artifact(artifact).config
    want, got = run_backend(artifact, "torch"), run_backend(artifact, "triton")
    tol = tolerance(torch.float32, config.intermediate_size, scale=4.0)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert not g.isnan().any(), f"step {step}"
        torch.testing.assert_close(g, w, **tol, msg=lambda m: f"step {step}: {m}")
