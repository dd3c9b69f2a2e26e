"""Collective ops of a tensor-parallel graph (passes/shard.py), and the two halves of a norm whose
row spans the ranks.

A sharded graph is the graph ONE rank runs; every rank runs the same graph on its own slices of
the weights (compiler/tensor_parallel.py). The collectives join the ranks' values through
torch.distributed's DEFAULT process group (gloo on CPUs, NCCL on GPUs), which the runtime starts
(runtime/tensor_parallel/) before the first step:
- `all_reduce(x, size=N)`: the sum of the N ranks' x, same shape (after a row-parallel GEMM);
- `all_gather(x, size=N)`: the ranks' x joined along the last dim, rank order: [.., N * width]
  (after the LM head split by vocabulary).
Their references check that the default group exists and has N ranks, else ValueError naming both.

OLMo-2 norms each token's whole q row (H heads) and k row: at TP each rank holds a slice of it, so
the norm runs in two ops around an all_reduce:
- `qk_sum_squares(qkv)` -> f32[T, 2]: the sums of squares of the q and of the k columns of a packed
  qkv (attrs num_heads, num_kv_heads, head_dim: this rank's counts);
- `qk_rms_norm(qkv, sum_squares, q_norm, k_norm)`: q and k normed by the summed squares, each mean
  taken over `size` times this rank's width (with fewer KV heads than ranks, each KV head sits on
  size / KV ranks, so both sum and count hold it that many times: the mean is the model's), then
  times the weights, rounded as rmsnorm (attrs eps, rounding); v unchanged.
"""

from __future__ import annotations

import torch

from ..ir import TensorType
from .checks import expect, float_, heads_width
from .norms import ROUNDINGS, rounding_of
from .record import Declined, Lowered, Operands, OpRecord, operands


def process_group_size(size: int) -> None:
    """ValueError unless torch.distributed's default group is up with `size` ranks."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world != size:
        raise ValueError(f"this graph is sharded for {size} ranks but the process group has {world}: "
                         f"run it with --tp {size}")


def all_reduce_ref(x: torch.Tensor, size: int) -> torch.Tensor:
    """The sum of every rank's x (a new tensor; x is left as it was)."""
    import torch.distributed as dist

    process_group_size(size)
    total = x.clone()
    dist.all_reduce(total)
    return total


def all_gather_ref(x: torch.Tensor, size: int) -> torch.Tensor:
    """Every rank's x [.., W] joined along the last dim in rank order: [.., size * W]."""
    import torch.distributed as dist

    process_group_size(size)
    parts = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)   # [N * rows, .., W]
    dist.all_gather_into_tensor(parts, x.contiguous())                # gloo takes the ranks' parts stacked on dim 0
    parts = parts.view(size, *x.shape)                                # [N, .., W]
    return torch.movedim(parts, 0, -2).reshape(*x.shape[:-1], size * x.shape[-1])


def qk_sum_squares_ref(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """f32 [T, 2]: each token's sum of squares over its q columns, then over its k columns."""
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    q, k, _ = qkv.float().split([q_width, kv_width, kv_width], dim=-1)
    return torch.stack([q.pow(2).sum(-1), k.pow(2).sum(-1)], dim=-1)


def qk_rms_norm_ref(qkv: torch.Tensor, sum_squares: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, *,
                    num_heads: int, num_kv_heads: int, head_dim: int, size: int, eps: float,
                    rounding: str = "normed") -> torch.Tensor:
    """qkv with q and k normed as rmsnorm_ref norms them, the mean of squares from `sum_squares`
    (summed over the ranks) over `size` times this rank's width."""
    widths = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    q, k, v = qkv.split(widths, dim=-1)
    normed = []
    for part, weight, total in ((q, q_norm, sum_squares[:, :1]), (k, k_norm, sum_squares[:, 1:])):
        x32 = part.to(torch.promote_types(part.dtype, torch.float32))
        scaled = x32 * torch.rsqrt(total / (size * part.shape[-1]) + eps)
        normed.append((scaled * weight.to(x32.dtype)).to(part.dtype) if rounding == "product"
                      else weight * scaled.to(part.dtype))
    return torch.cat([*normed, v], dim=-1)


def _size(attrs: dict) -> int:
    size = attrs["size"]
    expect(isinstance(size, int) and size >= 2, f"a collective's size={size!r} is not a rank count of 2 or more")
    return size


def _all_reduce_types(ts: Operands, attrs: dict):
    _size(attrs)
    float_(ts.x, "all_reduce input")
    return (ts.x,)


def _all_gather_types(ts: Operands, attrs: dict):
    size, width = _size(attrs), ts.x.shape[-1]
    float_(ts.x, "all_gather input")
    expect(isinstance(width, int), f"all_gather along a symbolic dim of {ts.x}")
    return (ts.x.with_shape(*ts.x.shape[:-1], size * width),)


def _qkv_heads(ts: Operands, attrs: dict) -> None:
    float_(ts.qkv, "qk norm qkv")
    heads_width(ts.qkv, attrs["num_heads"] + 2 * attrs["num_kv_heads"], attrs["head_dim"], "qk norm packed qkv")


def _qk_sum_squares_types(ts: Operands, attrs: dict):
    _qkv_heads(ts, attrs)
    return (TensorType("f32", (ts.qkv.shape[0], 2)),)


def _qk_rms_norm_types(ts: Operands, attrs: dict):
    _qkv_heads(ts, attrs)
    _size(attrs)
    expect(rounding_of(attrs) in ROUNDINGS, f"qk_rms_norm rounding={rounding_of(attrs)!r} is not one of {ROUNDINGS}")
    expect(isinstance(attrs.get("eps"), float), "qk_rms_norm needs a float attr eps")
    expect(ts.sum_squares.shape == (ts.qkv.shape[0], 2) and ts.sum_squares.dtype == "f32",
           f"qk_rms_norm sum_squares {ts.sum_squares} is not f32[{ts.qkv.shape[0]},2]")
    for name, heads in (("q_norm", attrs["num_heads"]), ("k_norm", attrs["num_kv_heads"])):
        want = (heads * attrs["head_dim"],)
        expect(ts[name].shape == want and ts[name].dtype == ts.qkv.dtype,
               f"qk_rms_norm {name} {ts[name]} is not {ts.qkv.dtype}{list(want)}")
    return (ts.qkv,)


_NO_NCCL = Declined("NCCL collectives in the Triton executor are not built yet; run a sharded artifact on the torch "
                    "backend")
_NO_ONNX = Declined("a collective joins ranks, which one ONNX graph has no word for; export an unsharded compile")
_TP_NORM = "a norm split around an all_reduce (sharded OLMo-2 only)"
_HEADS = ("num_heads", "num_kv_heads", "head_dim")

RECORDS = [
    OpRecord("all_reduce", (operands("x"),), ("size",), _all_reduce_types, "collective",
             "the sum of the ranks' x (torch.distributed's default group)",
             reference=lambda x, a: all_reduce_ref(x.x, a["size"]),
             backends={"native": Lowered("the torch reference"), "step_plan": Lowered("instruction all_reduce"),
                       "triton": _NO_NCCL, "onnx": _NO_ONNX}),
    OpRecord("all_gather", (operands("x"),), ("size",), _all_gather_types, "collective",
             "the ranks' x joined along the last dim, in rank order",
             reference=lambda x, a: all_gather_ref(x.x, a["size"]),
             backends={"native": Lowered("the torch reference"), "step_plan": Lowered("instruction all_gather"),
                       "triton": _NO_NCCL, "onnx": _NO_ONNX}),
    OpRecord("qk_sum_squares", (operands("qkv"),), _HEADS, _qk_sum_squares_types, "rowwise",
             "f32 [T, 2]: sums of squares of q's and of k's columns of a packed qkv",
             reference=lambda x, a: qk_sum_squares_ref(x.qkv, a["num_heads"], a["num_kv_heads"], a["head_dim"]),
             backends={"native": Lowered("the torch reference"), "step_plan": Declined(f"{_TP_NORM}: op by op"),
                       "triton": Declined(f"{_TP_NORM}: {_NO_NCCL.reason}")}),
    OpRecord("qk_rms_norm", (operands("qkv", "sum_squares", "q_norm", "k_norm"),), (*_HEADS, "size", "eps"),
             _qk_rms_norm_types, "rowwise", "q and k of a packed qkv normed by squares summed over the ranks",
             reference=lambda x, a: qk_rms_norm_ref(x.qkv, x.sum_squares, x.q_norm, x.k_norm, num_heads=a["num_heads"],
                                                    num_kv_heads=a["num_kv_heads"], head_dim=a["head_dim"],
                                                    size=a["size"], eps=a["eps"], rounding=rounding_of(a)),
             backends={"native": Lowered("the torch reference"), "step_plan": Declined(f"{_TP_NORM}: op by op"),
                       "triton": Declined(f"{_TP_NORM}: {_NO_NCCL.reason}")}),
]
