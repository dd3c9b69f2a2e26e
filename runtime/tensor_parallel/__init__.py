"""Tensor parallelism's runtime (DESIGN decision 9): N ranks run one artifact compiled with `--tp N`
(passes/shard.py: the graph one rank runs, with all_reduce / all_gather ops; the shard plan in the
manifest), rank 0 owning the engine, scheduler, sampler and server.

  world.py             starting the ranks (local workers, or torchrun / torch.distributed's environment),
                       the default process group with a timeout on every collective, threads per rank
  protocol.py          rank 0's broadcasts: startup (artifact hash, backend, KV blocks), each step's
                       StepInputs, copy-on-write block copies, stop
  executor.py          rank 0's executor: the backend's own behind the broadcast (the registry builds it)
  worker.py            ranks > 0: the same steps on their shards and their own KV caches
  plan_collectives.py  all_reduce / all_gather inside the CPU step plan (one native call per step)

`rank_executor` is the registry's seam (backends.py: BackendChoice.build).
"""

from __future__ import annotations

from dataclasses import replace

from llmc.compiler.tensor_parallel import TensorParallelPlan

from ..artifact import Artifact
from ..sampling_params import RequestError
from .world import Ranks, start_ranks

__all__ = ["Ranks", "plan_size", "rank_artifact", "rank_executor", "start_ranks"]


def plan_size(artifact: Artifact) -> int:
    """The ranks the artifact is sharded for (1: not sharded)."""
    return TensorParallelPlan.from_manifest(artifact.manifest).size


def rank_artifact(artifact: Artifact, rank: int, size: int) -> Artifact:
    """`artifact` with rank `rank`'s weights (views of the whole ones) for a run of `size` ranks; an
    unsharded artifact stays whole on every rank (each computes the whole model)."""
    plan = TensorParallelPlan.from_manifest(artifact.manifest)
    if plan.size == 1:
        return artifact
    if plan.size != size:
        raise RequestError(f"{artifact.path.name} is sharded for {plan.size} ranks but this run has {size}: "
                           f"run it with --tp {plan.size}")
    return replace(artifact, weights=plan.rank_weights(artifact.weights, rank))


def rank_executor(choice, artifact: Artifact, kv, ranks: Ranks | None):
    """The executor `choice` (a BackendChoice) builds for this rank: rank 0's behind the step broadcast."""
    if ranks is None:
        raise RequestError(f"{artifact.path.name} is sharded for {plan_size(artifact)} ranks: run it with llmc serve, "
                           f"generate or bench --tp {plan_size(artifact)}")
    from .executor import TensorParallelExecutor

    local = choice.executor(rank_artifact(artifact, ranks.rank, ranks.size), choice.device, kv, choice.options)
    return TensorParallelExecutor(local, ranks, kv)
