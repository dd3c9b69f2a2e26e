"""A rank of tests/test_shard_pass.py's gloo check, in its own module so a spawned process imports
only torch and the collectives' records, not the test module's model stack."""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmc.compiler.ops.collectives import all_gather_ref, all_reduce_ref


def gloo_rank(rank: int, n: int, port: int, folder: str) -> None:
    """Join an n-rank gloo group, run both references on x = 10 * rank + [[0, 1, 2], [3, 4, 5]], save them."""
    dist.init_process_group("gloo", rank=rank, world_size=n, init_method=f"tcp://127.0.0.1:{port}")
    x = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * rank
    torch.save({"sum": all_reduce_ref(x, n), "joined": all_gather_ref(x, n), "x": x}, f"{folder}/{rank}.pt")
    dist.destroy_process_group()
