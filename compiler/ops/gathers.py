"""Data movement ops: row gathers (embedding, qembedding, index_select), concat, and the leaves
(graph inputs and weights)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..dtypes import to_torch
from ..ir import TensorType
from ..quant_format import dequantize_weight
from .checks import FLOAT_DTYPES, expect, index_tensor
from .gemm import QUANTIZED, quantized_weight
from .record import Declined, Lowered, Operand, Operands, OpRecord, operands


def qembedding_ref(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, ids: torch.Tensor, *,
                   bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a quantized table [V, D], dequantized in fp32, as `dtype` [T, D]."""
    rows = ids.long()
    return dequantize_weight(codes[rows], scales[rows], None if mins is None else mins[rows], bits).to(dtype)


def _embedding_types(ts: Operands, attrs: dict):
    expect(len(ts.table.shape) == 2, f"embedding table must be 2-D, got {ts.table}")
    index_tensor(ts.ids, "embedding ids")
    return (TensorType(ts.table.dtype, (ts.ids.shape[0], ts.table.shape[1])),)


def _qembedding_types(ts: Operands, attrs: dict):
    n, k = quantized_weight(ts, attrs)
    index_tensor(ts.ids, "embedding ids")
    expect(attrs["dtype"] in FLOAT_DTYPES, f"qembedding dtype must be a float type, got {attrs['dtype']!r}")
    return (TensorType(attrs["dtype"], (ts.ids.shape[0], k)),)


def _index_select_types(ts: Operands, attrs: dict):
    index_tensor(ts.indices, "index_select indices")
    return (ts.x.with_shape(ts.indices.shape[0], *ts.x.shape[1:]),)


def _concat_types(ts: Operands, attrs: dict):
    parts, dim = ts.parts, attrs["dim"]
    first = parts[0]
    expect(isinstance(dim, int) and 0 <= dim < len(first.shape), f"concat dim {dim} is outside {first}")
    for t in parts[1:]:
        expect(t.dtype == first.dtype and len(t.shape) == len(first.shape)
               and all(a == b for i, (a, b) in enumerate(zip(t.shape, first.shape)) if i != dim),
               f"concat operands {first} and {t} differ outside dim {dim}")
    expect(all(isinstance(t.shape[dim], int) for t in parts), f"concat along a symbolic dim {dim}")
    return (first.with_shape(*first.shape[:dim], sum(t.shape[dim] for t in parts), *first.shape[dim + 1:]),)


def _declared(ts: Operands, attrs: dict):  # input / weight: the node's own declaration is its type
    return ()


_GATHER = Lowered("template kernels/triton/gather.py")
_LEAF = Declined("a leaf: fed at every call (inputs) or held by the program (weights), not computed")
_FOLDED = "a concat the fold_weights pass computes at compile time; keep that pass"

RECORDS = [
    OpRecord("input", (), (), _declared, "leaf", "a graph input, fed at every call",
             backends={b: _LEAF for b in ("native", "step_plan", "triton")}),
    OpRecord("weight", (), (), _declared, "leaf", "a model parameter, stored in weights.safetensors",
             backends={b: _LEAF for b in ("native", "step_plan", "triton")}),
    OpRecord("embedding", (operands("table", "ids"),), (), _embedding_types, "data_movement",
             "rows of the table w[V,D] at ids[T]", reference=lambda x, a: F.embedding(x.ids, x.table),
             backends={"native": Lowered("rows of a table, or of a tied table kept as panels"),
                       "step_plan": Lowered("instruction embedding"), "triton": _GATHER}),
    OpRecord("qembedding", ((*QUANTIZED, Operand("ids")),), ("bits", "group_size", "dtype"), _qembedding_types,
             "data_movement", "dequantized rows of a quantized table at ids",
             reference=lambda x, a: qembedding_ref(x.codes, x.scales, x.get("mins"), x.ids, bits=a["bits"],
                                                   dtype=to_torch(a["dtype"])),
             backends={"native": Lowered("rows of a quantized table, or of a tied one kept as panels"),
                       "step_plan": Lowered("instruction qembedding (the artifact's rows, or a tied table's "
                                            "quantized panels)"),
                       "triton": Lowered("template kernels/triton/qembedding.py")}),
    OpRecord("index_select", (operands("x", "indices"),), (), _index_select_types, "data_movement",
             "rows of x at indices", reference=lambda x, a: torch.index_select(x.x, 0, x.indices),
             backends={"native": Lowered("the torch reference"), "step_plan": Lowered("instruction index_select"),
                       "triton": _GATHER}),
    OpRecord("concat", (operands("parts..."),), ("dim",), _concat_types, "data_movement",
             "operands joined along dim (weights, before fold_weights)",
             reference=lambda x, a: torch.cat(x.parts, dim=a["dim"]),
             backends={"native": Lowered("the torch reference"), "step_plan": Declined(_FOLDED),
                       "triton": Declined(_FOLDED)}),
]
