"""A tensor-parallel rank other than 0: it loads its shard of the artifact, builds the executor rank
0 names at startup, then runs every step rank 0 broadcasts (protocol.py) on its shard and its own
KV cache, dropping the logits, until rank 0 says stop. It never runs a server, a scheduler or a
sampler.

`python -m llmc.runtime.tensor_parallel.worker ARTIFACT [--timeout S]` with torch.distributed's
environment set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) is how rank 0 starts one on its machine
(world.py); `llmc serve|generate|bench ARTIFACT --tp N` under torchrun or that environment runs the
same loop on ranks > 0. Exit status: 0 after "stop"; 1 when its artifact differs from rank 0's, its
executor cannot be built, or rank 0 (or a collective) stops first, each said in one line.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch

from ..artifact import Artifact, ArtifactError, load_artifact
from ..backends import BACKENDS
from ..executor import Executor, KVCacheSpec
from ..sampling_params import RequestError
from ..step_inputs import StepBuffers
from .executor import content_hash
from .protocol import COPY, FAILED, MISMATCH, READY, STEP, STOP, StepChannel
from . import rank_artifact
from .world import DEFAULT_TIMEOUT, Ranks, error_line, start_ranks

log = logging.getLogger("llmc")


def build_worker_executor(artifact: Artifact, facts: dict) -> Executor:
    """The executor rank 0's startup facts name, over this rank's shard and a cache of rank 0's blocks."""
    executor = BACKENDS[facts["backend"]]
    cache_type = artifact.graphs["prefill"].node_map()["kv_cache"].type
    kv = KVCacheSpec.from_graph_type(cache_type, facts["num_blocks"], facts["block_size"])
    return executor(artifact, torch.device(facts["device"]), kv, executor.options_type(**facts["options"]))


def _startup(channel: StepChannel, artifact: Artifact | None, rank: int) -> Executor | None:
    """Rank 0's startup facts, this rank's executor built from them and every rank's answer; None: stop
    (also where this rank's artifact could not load: said already)."""
    message = channel.receive()
    if message.kind == STOP:
        return None
    facts, executor, status = message.startup, None, READY
    if artifact is None:
        status = FAILED
    elif facts["artifact_hash"] != content_hash(artifact):
        status = MISMATCH
        print(f"llmc: tensor-parallel rank {rank}'s artifact {artifact.path} (content hash {content_hash(artifact)}) "
              f"differs from rank 0's ({facts['artifact_hash']}): give every rank the same artifact", file=sys.stderr)
    else:
        try:
            executor = build_worker_executor(artifact, facts)
        except Exception as exc:      # said here, and rank 0 refuses to start
            status = FAILED
            print(f"llmc: tensor-parallel rank {rank} could not build its executor: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
    statuses = channel.gather_status(status)
    return executor if not any(statuses) else None


def run_worker(artifact_path: Path, ranks: Ranks) -> int:
    """Serve rank 0's steps on this rank until it says stop; the exit status (module docstring)."""
    try:
        artifact = rank_artifact(load_artifact(artifact_path), ranks.rank, ranks.size)
    except (ArtifactError, RequestError) as exc:
        print(f"llmc: tensor-parallel rank {ranks.rank}: {exc}", file=sys.stderr)
        artifact = None
    channel = StepChannel(ranks.channel, list(artifact.graphs) if artifact else [])
    executor = _startup(channel, artifact, ranks.rank)
    if executor is None:
        return 1
    buffers = StepBuffers(executor.device)
    while True:
        try:
            message = channel.receive()
            if message.kind == STOP:
                return 0
            if message.kind == COPY:
                executor.copy_blocks(*(t.to(executor.device) for t in message.copies))
            elif message.kind == STEP:
                executor.step(message.entry, message.step, buffers)
        except RuntimeError as exc:
            print(f"llmc: tensor-parallel rank {ranks.rank} stops: rank 0 or another rank stopped ({error_line(exc)})",
                  file=sys.stderr)
            return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmc.runtime.tensor_parallel.worker",
                                     description="a tensor-parallel rank > 0 (rank 0 starts it)")
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="llmc rank worker: %(message)s")
    ranks = start_ranks(int(os.environ.get("WORLD_SIZE", "1")), args.artifact, args.timeout)
    if ranks is None:
        print("llmc: a tensor-parallel worker needs RANK and WORLD_SIZE (> 1) set; rank 0 sets them", file=sys.stderr)
        return 1
    try:
        return run_worker(args.artifact, ranks)
    finally:
        ranks.stop()


if __name__ == "__main__":
    sys.exit(main())
