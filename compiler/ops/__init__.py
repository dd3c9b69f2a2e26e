"""The op set of llmc IR: one record per op (record.py), grouped by kind in one module each,
the registry every part of llmc reads (registry.py), and the verifier (verify.py).

Token tensors are flattened: hidden states are `[T, hidden]`, attention heads are packed as
`[T, heads * head_dim]`; the KV cache is `[layers, 2, NB, KV heads, BS, head_dim]`.
"""

from .checks import FLOAT_DTYPES, INDEX_DTYPES
from .record import BACKENDS, OP_KINDS, Declined, Lowered, Operand, Operands, OpRecord, bind, operands
from .registry import OPS, registered
from .verify import infer_types, operands_of, verify

__all__ = ["BACKENDS", "FLOAT_DTYPES", "INDEX_DTYPES", "OPS", "OP_KINDS", "Declined", "Lowered", "Operand",
           "Operands", "OpRecord", "bind", "infer_types", "operands", "operands_of", "registered", "verify"]
