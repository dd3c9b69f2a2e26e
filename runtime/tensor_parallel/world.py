"""Starting the ranks of a tensor-parallel run and joining them into torch.distributed's groups.

`start_ranks(tp, artifact)` is what `llmc serve|generate|bench --tp N` call before anything loads:
- under torchrun, or with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set on each machine, this
  process is the rank the environment says (WORLD_SIZE must equal --tp);
- otherwise, with N > 1, this process is rank 0 and starts ranks 1..N-1 on this machine
  (`python -m llmc.runtime.tensor_parallel.worker ARTIFACT`, the environment set for each, MASTER_PORT
  a free port of 127.0.0.1).
Every rank then joins two groups: torch.distributed's default group (gloo on a CPU, NCCL for CUDA
tensors where a GPU is), which the graph's collectives use, created with `timeout` seconds so that
every collective fails instead of hanging when a rank is gone; and a gloo group for rank 0's step
broadcasts (protocol.py), whose timeout is a week: a worker waits there for the next step as long as
the server idles (a rank 0 that dies closes its sockets, which ends the wait at once).

Threads: each rank takes cores // (ranks on this machine), at least 1 (torch's intra-op threads, which
the step plan's team uses too), so the ranks never oversubscribe the cores; the ranks on this machine
are LOCAL_WORLD_SIZE where torchrun sets it, else all of them.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch

from ..sampling_params import RequestError

log = logging.getLogger("llmc")

DEFAULT_TIMEOUT = 60.0                     # seconds a collective may wait for the other ranks
IDLE_TIMEOUT = timedelta(days=7)           # the step channel: a worker waits while the server idles
STOP_GRACE = 10.0                          # seconds the started workers get to exit after "stop"


@dataclass
class Ranks:
    """This process's place in a tensor-parallel run: its rank, the world's size, the step channel's
    group, and (rank 0 on one machine) the worker processes it started."""

    rank: int
    size: int
    timeout: float
    channel: object                                  # the gloo group of rank 0's step broadcasts
    workers: list[subprocess.Popen] = field(default_factory=list)
    failure: str | None = None                       # why the run stopped, once a rank has
    on_failure: Callable[[], None] = lambda: None    # rank 0: what a rank's stopping sets off (serve: SIGTERM)
    local_ranks: int = 1                             # the ranks sharing this machine's cores, this one included

    def stop(self) -> None:
        """Rank 0: tell the others to stop (unless one has already), wait for the started workers to exit,
        end any left; then leave the groups. Every rank: leave the groups."""
        import torch.distributed as dist

        from .protocol import StepChannel

        if self.rank == 0 and self.failure is None:
            try:
                StepChannel(self.channel, []).send_stop()
            except RuntimeError as exc:                # a worker already gone: the kill below ends the rest
                log.warning("tensor-parallel: telling the ranks to stop failed (%s)", exc)
        for proc in self.workers:
            try:
                proc.wait(timeout=STOP_GRACE)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


def error_line(exc: BaseException) -> str:
    """The first line of an error (gloo's run long), for the one sentence that quotes it."""
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def threads_per_rank(local_ranks: int) -> int:
    """Intra-op threads for each of `local_ranks` ranks sharing this machine's cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_ranks))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn_workers(tp: int, artifact: Path, port: int, timeout: float, threads: int) -> list[subprocess.Popen]:
    """Ranks 1..tp-1 on this machine, each running the worker loop on `artifact`."""
    procs = []
    for rank in range(1, tp):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(tp), LOCAL_WORLD_SIZE=str(tp), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads))
        procs.append(subprocess.Popen([sys.executable, "-m", "llmc.runtime.tensor_parallel.worker", str(artifact),
                                       "--timeout", str(timeout)], env=env))
    return procs


def _env_world(tp: int) -> tuple[int, int] | None:
    """(rank, size) the torch.distributed environment gives, None where it gives none."""
    if "WORLD_SIZE" not in os.environ and "RANK" not in os.environ:
        return None
    try:
        rank, size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise RequestError(f"RANK={os.environ.get('RANK')!r} and WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} "
                           "must be integers (torch.distributed's environment)") from None
    if size < tp:
        raise RequestError(f"--tp {tp} needs {tp} ranks but WORLD_SIZE is {size}: start {tp} (torchrun "
                           f"--nproc-per-node {tp}, or RANK 0..{tp - 1} with WORLD_SIZE={tp} on each machine)")
    if size > tp:
        raise RequestError(f"WORLD_SIZE is {size} but --tp is {tp}: give every rank --tp {size}")
    if not 0 <= rank < size:
        raise RequestError(f"RANK={rank} is not one of 0..{size - 1} (WORLD_SIZE={size})")
    return rank, size


def _join(rank: int, size: int, addr: str, port: int | str, timeout: float) -> object:
    """Join the default group and the step channel; the channel group."""
    import torch.distributed as dist

    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout))
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def start_ranks(tp: int, artifact: Path, timeout: float = DEFAULT_TIMEOUT) -> Ranks | None:
    """This process's rank of a `tp`-way run (module docstring); None for one rank and no environment."""
    if tp < 1:
        raise RequestError(f"--tp {tp} must be at least 1")
    if timeout <= 0:
        raise RequestError(f"--tp-timeout {timeout} must be positive seconds")
    given = _env_world(tp)
    if given is None and tp == 1:
        return None
    if given is not None:
        (rank, size), workers = given, []
        if size == 1:
            return None
        addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "29500")
        if not port.isdigit():
            raise RequestError(f"MASTER_PORT={port!r} is not a port number; give every rank the same one")
        local = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    else:
        rank, size, addr, port, local = 0, tp, "127.0.0.1", _free_port(), tp
        workers = _spawn_workers(tp, artifact, port, timeout, threads_per_rank(local))
    threads = threads_per_rank(local)
    torch.set_num_threads(threads)
    log.info("tensor-parallel rank %d of %d: %d threads", rank, size, threads)
    try:
        channel = _join(rank, size, addr, port, timeout)
    except (RuntimeError, ValueError) as exc:
        for proc in workers:
            proc.kill()
        raise RequestError(f"tensor-parallel rank {rank} could not join the {size} ranks at {addr}:{port} "
                           f"within {timeout:g} s ({error_line(exc)}); start every rank with the same "
                           "MASTER_ADDR and MASTER_PORT") from None
    return Ranks(rank, size, timeout, channel, workers, local_ranks=local)
