"""`--tp N` of `llmc serve`, `generate` and `bench`: the ranks of a tensor-parallel run around one command.

`tensor_parallel(tp, timeout, artifact)` checks that the artifact was compiled for `tp` ranks, starts
or joins them (runtime/tensor_parallel/world.py: local workers, or torchrun / torch.distributed's
environment), and on a rank other than 0 runs the worker loop and exits with its status: such a rank
never runs the command's server or workload. On rank 0 it yields the ranks for EngineConfig(ranks=...)
and, when the command ends (done, SIGTERM, an error), tells the other ranks to stop and waits for them;
a rank that stopped during the run makes the command exit 1 after its one line.
"""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import typer

from llmc.compiler.artifact_format import read_manifest
from llmc.compiler.tensor_parallel import TensorParallelPlan
from llmc.runtime.sampling_params import RequestError
from llmc.runtime.tensor_parallel import Ranks, start_ranks
from llmc.runtime.tensor_parallel.world import DEFAULT_TIMEOUT

TP_OPTION = typer.Option(1, "--tp", help="tensor-parallel ranks: the N the artifact was compiled with "
                         "(llmc compile --tp N); ranks 1..N-1 start on this machine, or come from torchrun / "
                         "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT")
TP_TIMEOUT_OPTION = typer.Option(DEFAULT_TIMEOUT, "--tp-timeout", help="seconds a collective waits for the other "
                                 "ranks before the run stops (a rank gone)")


def check_plan_size(artifact: Path, tp: int) -> None:
    """RequestError unless `artifact` was compiled for `tp` ranks."""
    size = TensorParallelPlan.from_manifest(read_manifest(artifact)).size
    if size != tp:
        raise RequestError(f"{artifact.name} is compiled for {size} tensor-parallel rank{'s' * (size > 1)} but --tp "
                           f"is {tp}: run it with --tp {size}, or compile it again with llmc compile --tp {tp}")


@contextmanager
def tensor_parallel(tp: int, timeout: float, artifact: Path, stop_server_on_failure: bool = False
                    ) -> Iterator[Ranks | None]:
    """This command's ranks (None: one process); see the module docstring."""
    check_plan_size(artifact, tp)
    ranks = start_ranks(tp, artifact, timeout)
    if ranks is not None and ranks.rank > 0:
        from llmc.runtime.tensor_parallel.worker import run_worker

        try:
            status = run_worker(artifact, ranks)
        finally:
            ranks.stop()
        raise typer.Exit(status)
    if ranks is not None and stop_server_on_failure:
        ranks.on_failure = lambda: os.kill(os.getpid(), signal.SIGTERM)     # the server shuts down on it
    try:
        yield ranks
    finally:
        if ranks is not None:
            ranks.stop()
    if ranks is not None and ranks.failure is not None:
        print(f"llmc: {ranks.failure}", file=sys.stderr)
        raise typer.Exit(1)
