"""The step plan's lowerings of the collective ops (compiler/ops/collectives.py): `all_reduce` and
`all_gather` as the plan instructions of the same names (kernels/cpu/plan_collectives.h), so a
tensor-parallel step on the CPU is still one native call: the team's first thread calls torch's
c10d functional collectives through the dispatcher on torch.distributed's default process group
(named to the plan once, `set_group`), the other threads wait at the barrier after it.

Contract: a collective reads an activation [rows, W] the plan holds and writes a new one ([rows,
W], or [rows, size * W] for all_gather) in the plan's dtype; the default group must be up with
`size` ranks when the plan is built (else RequestError: the sentence the op's reference says).
runtime/step_plan.py's LOWERINGS holds these beside the template ops'.
"""

from __future__ import annotations

from llmc.compiler.ir import Node
from llmc.compiler.ops import operands_of
from llmc.kernels.step_plan_isa import Encoded, encode

from ..sampling_params import RequestError


def default_group_name(size: int) -> str:
    """c10d's name of torch.distributed's default group, which must have `size` ranks."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world != size:
        raise RequestError(f"this graph is sharded for {size} ranks but the process group has {world}: "
                           f"run it with --tp {size}")
    return dist.group.WORLD.group_name


def _lower_collective(lo, node: Node) -> Encoded:
    """all_reduce(x) or all_gather(x) of `size` ranks, on the default group."""
    x, size = operands_of(node).x, node.attrs["size"]
    lo.plan.set_group(default_group_name(size))
    width = lo.width(x, node)
    return encode(node.op, out=lo.result(node), x=lo.activation(x, node), width=width, size=size)


COLLECTIVE_LOWERINGS = {"all_reduce": _lower_collective, "all_gather": _lower_collective}
