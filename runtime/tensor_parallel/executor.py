"""Rank 0's executor of a tensor-parallel run: the chosen backend's executor on rank 0's shard, and
every step, copy-on-write and stop broadcast to the other ranks first (protocol.py), which run the
same step on their shards and their own KV caches (worker.py); the graph's collectives join them
inside the step. The registry builds it (backends.py: a BackendChoice with ranks), so the runner
and the engine see one executor and know nothing of the ranks.

Startup: rank 0 tells the others the artifact's content hash, the backend, its device and options
and the KV cache's blocks; each answers ready, or that its artifact differs (then rank 0 refuses in
one sentence), or that it failed. A rank that stops later (killed, crashed, gone past the collective
timeout) makes rank 0's broadcast or collective fail: the executor says once at ERROR
"tensor-parallel rank R stopped (...): the server stops", calls the ranks' `on_failure` (the server
stops on it), and fails that step and every later one at once, so every stream ends with an error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict
from typing import Callable, TypeVar

import torch

from ..artifact import Artifact
from ..executor import Capabilities, Executor, KVCacheSpec, StepOutput
from ..sampling_params import RequestError
from ..step_inputs import StepBuffers, StepInputs
from .protocol import MISMATCH, READY, StepChannel
from .world import Ranks, error_line

log = logging.getLogger("llmc")
T = TypeVar("T")
WORKER_EXIT = 2.0        # seconds a failed step waits to see which started worker exited


class RankStopped(RuntimeError):
    """A rank of the run is gone; the message is the one sentence that says which and what follows."""


def content_hash(artifact: Artifact) -> str:
    """A hash of every file the artifact's manifest lists (their sha256s): equal artifacts, equal hashes."""
    return hashlib.sha256(json.dumps(artifact.manifest["files"], sort_keys=True).encode()).hexdigest()[:16]


def startup_facts(local: Executor, kv: KVCacheSpec) -> dict:
    """What the other ranks need to build their executors as rank 0 built its own."""
    return {"artifact_hash": content_hash(local.artifact), "backend": local.backend, "device": local.device.type,
            "options": asdict(local.options), "num_blocks": kv.num_blocks, "block_size": kv.block_size}


class TensorParallelExecutor:
    """`local` (rank 0's executor) behind the step broadcast; reads through to it for everything else."""

    def __init__(self, local: Executor, ranks: Ranks, kv: KVCacheSpec):
        self.local, self.ranks = local, ranks
        self.channel = StepChannel(ranks.channel, list(local.artifact.graphs))
        self.failure: str | None = None
        self.channel.send_startup(startup_facts(local, kv))
        statuses = self.channel.gather_status(READY)
        if MISMATCH in statuses:
            rank = statuses.index(MISMATCH)
            raise RequestError(f"tensor-parallel rank {rank}'s artifact differs from rank 0's (content hash "
                               f"{content_hash(local.artifact)}): give every rank the same artifact")
        if any(statuses):
            bad = [r for r, s in enumerate(statuses) if s]
            raise RequestError(f"tensor-parallel rank {bad[0]} could not build its executor (its log says why); "
                               "fix it and start every rank again")
        log.info("tensor-parallel: %d ranks ready, each on its shard of %s", ranks.size, local.artifact.path.name)

    # -- what the runner reads ----------------------------------------------------------------

    @property
    def backend(self) -> str:
        return self.local.backend

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.local.kv_cache

    @property
    def programs(self) -> dict:
        return self.local.programs

    @property
    def graphs(self):
        return self.local.graphs

    @property
    def graph_error(self) -> str | None:
        return self.local.graph_error

    def capabilities(self) -> Capabilities:
        return self.local.capabilities()

    def capture_decode(self, max_num_seqs: int, max_verify_width: int = 1) -> None:
        """Nothing: a captured step would run its collectives without the other ranks (said once on a GPU)."""
        if self.local.device.type == "cuda" and self.local.options.cuda_graphs is not False:
            log.info("tensor-parallel decode steps are not captured as CUDA graphs yet; every step runs eagerly")

    def on_device(self, host: StepInputs, buffers: StepBuffers) -> StepInputs:
        return self.local.on_device(host, buffers)

    # -- what every rank does -----------------------------------------------------------------

    def step(self, entry: str, host: StepInputs, buffers: StepBuffers) -> StepOutput:
        return self._together(lambda: self.channel.send_step(entry, host),
                              lambda: self.local.step(entry, host, buffers))

    def run(self, entry: str, step: StepInputs) -> torch.Tensor:
        return self._together(lambda: self.channel.send_step(entry, step), lambda: self.local.run(entry, step))

    def run_timed(self, entry: str, step: StepInputs):
        return self._together(lambda: self.channel.send_step(entry, step), lambda: self.local.run_timed(entry, step))

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._together(lambda: self.channel.send_copy(src, dst), lambda: self.local.copy_blocks(src, dst))

    def _together(self, send: Callable[[], None], compute: Callable[[], T]) -> T:
        """Tell the other ranks, then compute here; a rank gone fails this and every later call (RankStopped)."""
        if self.failure is not None:
            raise RankStopped(self.failure)
        try:
            send()
            return compute()
        except RuntimeError as exc:
            self.failure = self._failed(exc)
            raise RankStopped(self.failure) from None

    def _failed(self, exc: RuntimeError) -> str:
        gone = self._gone_worker()
        what = f"tensor-parallel rank {gone} stopped" if gone else "a tensor-parallel step failed"
        failure = f"{what} ({error_line(exc)}): the server stops"
        log.error("%s", failure)
        self.ranks.failure = failure
        self.ranks.on_failure()
        return failure

    def _gone_worker(self) -> int | None:
        """The rank of a worker this process started that has exited: a killed one closes its sockets (which
        failed the collective) a moment before it can be reaped, so look for WORKER_EXIT seconds."""
        deadline = time.monotonic() + WORKER_EXIT if self.ranks.workers else 0.0
        while True:
            gone = [rank for rank, proc in enumerate(self.ranks.workers, 1) if proc.poll() is not None]
            if gone or time.monotonic() >= deadline:
                return gone[0] if gone else None
            time.sleep(0.05)
