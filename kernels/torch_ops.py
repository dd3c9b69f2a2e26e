"""The torch reference implementation of every IR op: the meaning of the IR, and the op table
the torch backend runs by default (kernels/native_ops.py swaps native CPU kernels in).

Each entry takes the op's input tensors (in IR order) and its attributes, and returns its
result or results. A test checks that this table, `compiler.ops.OPS` and the codegen's coverage
name the same ops.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from llmc.compiler.dtypes import to_torch

from .activation import silu_mul_ref
from .attention import attention_ref, kv_write_ref, paged_attention_ref, paged_decode_attention_ref
from .rmsnorm import add_rmsnorm_ref, rmsnorm_ref
from .quant import qembedding_ref, qlinear_ref, split_qlinear_inputs
from .rope import rope_ref
from .rope_kv_write import rope_kv_write_ref

OpImpl = Callable[[list[torch.Tensor], dict[str, Any]], "torch.Tensor | tuple[torch.Tensor, ...]"]
ROPE_KV_ATTRS = ("layer", "num_heads", "num_kv_heads", "head_dim", "theta", "scaling")

OP_IMPLS: dict[str, OpImpl] = {
    "embedding": lambda x, a: F.embedding(x[1], x[0]),
    "rmsnorm": lambda x, a: rmsnorm_ref(x[0], x[1], a["eps"]),
    "linear": lambda x, a: F.linear(*x),
    "add": lambda x, a: x[0] + x[1],
    "mul": lambda x, a: x[0] * x[1],
    "silu": lambda x, a: F.silu(x[0]),
    "cast": lambda x, a: x[0].to(to_torch(a["dtype"])),
    "rope": lambda x, a: rope_ref(x[0], x[1], a["head_dim"], a["theta"], a["scaling"]),
    "attention": lambda x, a: attention_ref(*x, a["head_dim"], a["scale"]),
    "index_select": lambda x, a: torch.index_select(x[0], 0, x[1]),
    "kv_write": lambda x, a: kv_write_ref(*x, a["layer"]),
    "paged_attention": lambda x, a: paged_attention_ref(*x, a["layer"], a["head_dim"], a["scale"]),
    "paged_decode_attention": lambda x, a: paged_decode_attention_ref(*x, a["layer"], a["head_dim"], a["scale"]),
    "concat": lambda x, a: torch.cat(x, dim=a["dim"]),
    "split": lambda x, a: tuple(torch.split(x[0], a["sizes"], dim=-1)),
    "add_rmsnorm": lambda x, a: add_rmsnorm_ref(*x, a["eps"]),
    "silu_mul": lambda x, a: silu_mul_ref(*x),
    "rope_kv_write": lambda x, a: rope_kv_write_ref(*x, **{k: a[k] for k in ROPE_KV_ATTRS}),
    "qlinear": lambda x, a: qlinear_ref(*split_qlinear_inputs(x, a["bits"]), bits=a["bits"]),
    "qembedding": lambda x, a: qembedding_ref(*x[:-1], *([None] if a["bits"] == 8 else []), x[-1], bits=a["bits"],
                                              dtype=to_torch(a["dtype"])),
}
