"""The op set of llmc IR and its verifier.

Every op has an `OpDef`: how many inputs it takes, which attributes it requires, and a type
rule that computes its result types from its input types (raising `IRError` with the broken
rule). `verify(graph)` is that rule set applied to every node, plus graph-level checks: names
unique, values defined before use, results as declared.

Token tensors are flattened: hidden states are `[T, hidden]`, attention heads are packed as
`[T, heads * head_dim]`; the KV cache is `[layers, 2, NB, BS, kv_heads, head_dim]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .ir import Graph, IRError, Node, TensorType

TypeRule = Callable[[list[TensorType], dict], tuple[TensorType, ...]]
FLOAT_DTYPES = ("f32", "f16", "bf16")
INDEX_DTYPES = ("i64", "i32")


OP_KINDS = ("leaf", "gemm", "elementwise", "rowwise", "attention", "data_movement")


@dataclass(frozen=True)
class OpDef:
    """Signature of one op: input count range, required attributes, type rule, kind, purity.

    `kind` is what fusion_grouping, codegen and graph export read: a gemm; an elementwise op;
    a rowwise op (a reduction over each token's row); attention; data movement (gathers, cache
    writes, concat/split); or a leaf (graph inputs and weights)."""

    name: str
    min_inputs: int
    max_inputs: int
    attrs: tuple[str, ...]
    infer: TypeRule
    doc: str
    kind: str
    side_effects: bool = False

    def __post_init__(self) -> None:
        assert self.kind in OP_KINDS, f"op {self.name} has unknown kind {self.kind!r}"


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise IRError(message)


def _float(t: TensorType, what: str) -> None:
    _expect(t.dtype in FLOAT_DTYPES, f"{what} must be a float tensor, got {t}")


def _index(t: TensorType, what: str, rank: int = 1) -> None:
    _expect(t.dtype in INDEX_DTYPES and len(t.shape) == rank,
            f"{what} must be an integer tensor of rank {rank}, got {t}")


def _same(a: TensorType, b: TensorType, what: str) -> None:
    _expect(a == b, f"{what}: operand types differ, {a} vs {b}")


def _embedding(ts, attrs):
    w, ids = ts
    _expect(len(w.shape) == 2, f"embedding table must be 2-D, got {w}")
    _index(ids, "embedding ids")
    return (TensorType(w.dtype, (ids.shape[0], w.shape[1])),)


def _rmsnorm(ts, attrs):
    x, w = ts
    _float(x, "rmsnorm input")
    _expect(w.shape == (x.shape[-1],), f"rmsnorm weight {w} does not match hidden size of {x}")
    return (x,)


def _linear(ts, attrs):
    x, w = ts[0], ts[1]
    _float(x, "linear input")
    _expect(len(x.shape) == 2 and len(w.shape) == 2, f"linear takes [T,K] x [N,K], got {x} x {w}")
    _expect(x.shape[1] == w.shape[1], f"linear reduction dims differ: {x} x {w}")
    if len(ts) == 3:
        _expect(ts[2].shape == (w.shape[0],), f"linear bias {ts[2]} does not match weight {w}")
    return (TensorType(x.dtype, (x.shape[0], w.shape[0])),)


def _quantized_weight(ts, attrs) -> tuple:
    """(N, K) of a quantized weight: codes, scales[, mins] at the front of `ts` (kernels/quant.py)."""
    bits, group = attrs["bits"], attrs["group_size"]
    _expect(bits in (8, 4), f"bits must be 8 or 4, got {bits!r}")
    codes, scales = ts[0], ts[1]
    _expect(codes.dtype == ("i8" if bits == 8 else "u4x2") and len(codes.shape) == 2,
            f"{bits}-bit codes must be {'i8' if bits == 8 else 'u4x2'}[N,{'K' if bits == 8 else 'K/2'}], got {codes}")
    n, k = codes.shape[0], codes.shape[1] * (1 if bits == 8 else 2)
    _expect(isinstance(group, int) and group > 0 and isinstance(k, int) and k % group == 0,
            f"group_size={group!r} does not divide the {k} input features")
    _expect(bits == 8 or group % 32 == 0, f"int4 group_size={group} is not a multiple of 32")
    _expect(scales == TensorType("f16", (n, k // group)), f"scales must be f16[{n},{k // group}], got {scales}")
    if bits == 4:
        _expect(ts[2] == scales, f"int4 mins must be f16[{n},{k // group}], got {ts[2]}")
    return n, k


def _qlinear(ts, attrs):
    x, weight = ts[0], ts[1:]
    _float(x, "qlinear input")
    n, k = _quantized_weight(weight, attrs)
    parts = 3 if attrs["bits"] == 4 else 2
    _expect(len(weight) in (parts, parts + 1), f"{attrs['bits']}-bit qlinear takes x, codes, scales"
            f"{', mins' if parts == 3 else ''} and an optional bias, got {len(ts)} inputs")
    _expect(len(x.shape) == 2 and x.shape[1] == k, f"qlinear input {x} does not have the weight's {k} features")
    if len(weight) > parts:
        _expect(weight[parts].shape == (n,), f"qlinear bias {weight[parts]} does not match {n} outputs")
    return (TensorType(x.dtype, (x.shape[0], n)),)


def _qembedding(ts, attrs):
    ids = ts[-1]
    n, k = _quantized_weight(ts[:-1], attrs)
    _expect(len(ts) == (4 if attrs["bits"] == 4 else 3), f"{attrs['bits']}-bit qembedding takes codes, scales"
            f"{', mins' if attrs['bits'] == 4 else ''} and ids, got {len(ts)} inputs")
    _index(ids, "embedding ids")
    _expect(attrs["dtype"] in FLOAT_DTYPES, f"qembedding dtype must be a float type, got {attrs['dtype']!r}")
    return (TensorType(attrs["dtype"], (ids.shape[0], k)),)


def _binary(ts, attrs):
    _same(ts[0], ts[1], "elementwise op")
    _float(ts[0], "elementwise operand")
    return (ts[0],)


def _unary_float(ts, attrs):
    _float(ts[0], "operand")
    return (ts[0],)


def _heads_width(t: TensorType, heads: int, head_dim: int, what: str) -> None:
    _expect(len(t.shape) == 2 and t.shape[1] == heads * head_dim,
            f"{what} must be [T, {heads}*{head_dim}], got {t}")


def _rope(ts, attrs):
    x, pos = ts
    _float(x, "rope input")
    _index(pos, "rope positions")
    _expect(isinstance(x.shape[1], int) and x.shape[1] % attrs["head_dim"] == 0,
            f"rope input width {x.shape[1]} is not a multiple of head_dim={attrs['head_dim']}")
    _expect(x.shape[0] == pos.shape[0], f"rope positions {pos} do not match tokens of {x}")
    return (x,)


def _check_heads(q, k, v, attrs):
    _heads_width(q, attrs["num_heads"], attrs["head_dim"], "attention query")
    _heads_width(k, attrs["num_kv_heads"], attrs["head_dim"], "attention key")
    _same(k, v, "attention key/value")
    _expect(attrs["num_heads"] % attrs["num_kv_heads"] == 0, "num_heads must be a multiple of num_kv_heads")


def _attention(ts, attrs):
    q, k, v, qsl = ts
    _check_heads(q, k, v, attrs)
    _index(qsl, "query_start_loc")
    return (q,)


KV_SCALE_BYTES = 4      # an i8 cache row: head_dim codes, then its fp32 scale (kernels/quant.py)


def _check_cache(cache: TensorType, attrs) -> None:
    _expect(len(cache.shape) == 6 and cache.shape[1] == 2, f"kv cache must be [L,2,NB,KVH,BS,D], got {cache}")
    _expect(cache.dtype in FLOAT_DTYPES or cache.dtype == "i8", f"kv cache must be float or i8, got {cache}")
    row = attrs["head_dim"] + (KV_SCALE_BYTES if cache.dtype == "i8" else 0)
    _expect(cache.shape[3] == attrs["num_kv_heads"] and cache.shape[5] == row,
            f"kv cache {cache} does not match num_kv_heads={attrs['num_kv_heads']}, head_dim={attrs['head_dim']}"
            + (" (+4 scale bytes per i8 row)" if cache.dtype == "i8" else ""))
    layers = cache.shape[0]
    _expect(not isinstance(layers, int) or 0 <= attrs["layer"] < layers,
            f"layer {attrs['layer']} is outside a kv cache of {layers} layers")


def _kv_write(ts, attrs):
    cache, k, v, slots = ts
    _check_cache(cache, attrs)
    _heads_width(k, attrs["num_kv_heads"], attrs["head_dim"], "kv_write key")
    _same(k, v, "kv_write key/value")
    _index(slots, "slot_mapping")
    return (cache,)


def _paged_attention(ts, attrs):
    q, cache, tables, seq_lens = ts[:4]
    _check_cache(cache, attrs)
    _heads_width(q, attrs["num_heads"], attrs["head_dim"], "paged attention query")
    _index(tables, "block_tables", rank=2)
    _index(seq_lens, "seq_lens")
    if len(ts) == 5:
        _index(ts[4], "query_start_loc")
    return (q,)


def _index_select(ts, attrs):
    x, idx = ts
    _index(idx, "index_select indices")
    return (x.with_shape(idx.shape[0], *x.shape[1:]),)


def _cast(ts, attrs):
    return (TensorType(attrs["dtype"], ts[0].shape),)


def _declared(ts, attrs):  # input / weight: the node's own declaration is its type
    return ()


# ------------------------------------------------------------------ fused and structural ops


def _add_rmsnorm(ts, attrs):
    x, r, w = ts
    _same(x, r, "add_rmsnorm")
    (normed,) = _rmsnorm([x, w], attrs)
    return (normed, x)


def _silu_mul(ts, attrs):
    if len(ts) == 2:
        return _binary(ts, attrs)
    (x,) = ts
    _float(x, "silu_mul input")
    width = x.shape[-1]
    _expect(isinstance(width, int) and width % 2 == 0,
            f"one-input silu_mul needs an even last dim (gate and up halves), got {x}")
    return (x.with_shape(*x.shape[:-1], width // 2),)


def _split(ts, attrs):
    (x,) = ts
    sizes = attrs["sizes"]
    _expect(isinstance(sizes, list) and sizes and all(isinstance(s, int) and s > 0 for s in sizes),
            f"split sizes must be a list of positive ints, got {sizes!r}")
    _expect(sum(sizes) == x.shape[-1], f"split sizes {sizes} do not add up to the last dim of {x}")
    return tuple(x.with_shape(*x.shape[:-1], s) for s in sizes)


def _concat(ts, attrs):
    dim, first = attrs["dim"], ts[0]
    _expect(isinstance(dim, int) and 0 <= dim < len(first.shape), f"concat dim {dim} is outside {first}")
    for t in ts[1:]:
        _expect(t.dtype == first.dtype and len(t.shape) == len(first.shape)
                and all(a == b for i, (a, b) in enumerate(zip(t.shape, first.shape)) if i != dim),
                f"concat operands {first} and {t} differ outside dim {dim}")
    _expect(all(isinstance(t.shape[dim], int) for t in ts), f"concat along a symbolic dim {dim}")
    return (first.with_shape(*first.shape[:dim], sum(t.shape[dim] for t in ts), *first.shape[dim + 1:]),)


def _rope_kv_write(ts, attrs):
    heads, kv_heads, head_dim = attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"]
    _expect(len(ts) in (4, 6), f"rope_kv_write takes (qkv, positions, cache, slots) or "
                                f"(q, k, v, positions, cache, slots), got {len(ts)} inputs")
    if len(ts) == 4:
        qkv, pos, cache, slots = ts
        _heads_width(qkv, heads + 2 * kv_heads, head_dim, "rope_kv_write packed qkv")
        q = qkv.with_shape(qkv.shape[0], heads * head_dim)
    else:
        q, k, v, pos, cache, slots = ts
        _heads_width(q, heads, head_dim, "rope_kv_write query")
        _kv_write([cache, k, v, slots], attrs)
    _float(q, "rope_kv_write query")
    _index(pos, "rope_kv_write positions")
    _index(slots, "slot_mapping")
    _expect(pos.shape[0] == q.shape[0], f"rope positions {pos} do not match tokens of {q}")
    _check_cache(cache, attrs)
    return (q, cache)


ATTN_ATTRS = ("num_heads", "num_kv_heads", "head_dim", "scale")

OPS: dict[str, OpDef] = {op.name: op for op in [
    OpDef("input", 0, 0, (), _declared, "a graph input, fed at every call", kind="leaf"),
    OpDef("weight", 0, 0, (), _declared, "a model parameter, stored in weights.safetensors", kind="leaf"),
    OpDef("embedding", 2, 2, (), _embedding, "rows of the table w[V,D] at ids[T]", kind="data_movement"),
    OpDef("rmsnorm", 2, 2, ("eps",), _rmsnorm, "x / sqrt(mean(x^2) + eps) * w, in fp32", kind="rowwise"),
    OpDef("linear", 2, 3, (), _linear, "x @ w.T (+ b)", kind="gemm"),
    OpDef("add", 2, 2, (), _binary, "a + b", kind="elementwise"),
    OpDef("mul", 2, 2, (), _binary, "a * b", kind="elementwise"),
    OpDef("silu", 1, 1, (), _unary_float, "x * sigmoid(x)", kind="elementwise"),
    OpDef("cast", 1, 1, ("dtype",), _cast, "convert element type", kind="elementwise"),
    OpDef("rope", 2, 2, ("head_dim", "theta", "scaling"), _rope,
          "rotary embedding (rotate-half layout) of every head of x at positions", kind="rowwise"),
    OpDef("attention", 4, 4, ATTN_ATTRS, _attention,
          "causal attention within each sequence of packed tokens, no cache", kind="attention"),
    OpDef("index_select", 2, 2, (), _index_select, "rows of x at indices", kind="data_movement"),
    OpDef("kv_write", 4, 4, ("layer", "num_kv_heads", "head_dim"), _kv_write,
          "store k, v of each token at its slot of the paged cache; returns the cache", kind="data_movement",
          side_effects=True),
    OpDef("paged_attention", 5, 5, ("layer",) + ATTN_ATTRS, _paged_attention,
          "causal attention of packed query chunks over the paged cache (prefill and mixed steps)", kind="attention"),
    OpDef("paged_decode_attention", 4, 4, ("layer",) + ATTN_ATTRS, _paged_attention,
          "attention of one query token per sequence over the paged cache", kind="attention"),
    # --- produced by passes
    OpDef("concat", 1, 64, ("dim",), _concat, "operands joined along dim (weights, before fold_weights)",
          kind="data_movement"),
    OpDef("split", 1, 1, ("sizes",), _split, "x cut along its last dim into parts of these widths", kind="elementwise"),
    OpDef("add_rmsnorm", 3, 3, ("eps",), _add_rmsnorm,
          "s = x + r; returns (rmsnorm(s, w), s): the residual add fused with the next norm", kind="rowwise"),
    OpDef("silu_mul", 1, 2, (), _silu_mul,
          "silu(gate) * up; with one input x [T, 2N], gate and up are its two halves", kind="elementwise"),
    OpDef("qlinear", 3, 5, ("bits", "group_size"), _qlinear,
          "x @ dequant(w).T (+ b): int8 or int4 weight codes with per-group scales (kernels/quant.py)", kind="gemm"),
    OpDef("qembedding", 3, 4, ("bits", "group_size", "dtype"), _qembedding,
          "dequantized rows of a quantized table at ids", kind="data_movement"),
    OpDef("rope_kv_write", 4, 6, ("layer", "num_heads", "num_kv_heads", "head_dim", "theta", "scaling"),
          _rope_kv_write, "rope q and k, store k and v at their slots; returns (roped q, cache)",
          kind="data_movement", side_effects=True),
]}


def infer_types(op: str, input_types: list[TensorType], attrs: dict) -> tuple[TensorType, ...]:
    """Result types of `op` applied to inputs of these types (IRError if the rule fails)."""
    opdef = OPS.get(op)
    if opdef is None:
        raise IRError(f"unknown op {op!r}")
    if not opdef.min_inputs <= len(input_types) <= opdef.max_inputs:
        expected = (str(opdef.min_inputs) if opdef.min_inputs == opdef.max_inputs
                    else f"{opdef.min_inputs}..{opdef.max_inputs}")
        raise IRError(f"{op} takes {expected} inputs, got {len(input_types)}")
    missing = [a for a in opdef.attrs if a not in attrs]
    if missing:
        raise IRError(f"{op} is missing attribute(s) {missing}")
    return opdef.infer(input_types, attrs)


def _verify_node(node: Node, types: dict) -> None:
    for v in node.inputs:
        if (v.node, v.index) not in types:
            raise IRError(f"uses {v}, which is not defined before it")
    if node.op in ("input", "weight"):
        if node.inputs or len(node.types) != 1:
            raise IRError(f"{node.op} nodes take no inputs and have one type")
        return
    expected = infer_types(node.op, [types[(v.node, v.index)] for v in node.inputs], node.attrs)
    if tuple(expected) != tuple(node.types):
        raise IRError(f"declared type {', '.join(map(str, node.types))} but the {node.op} rule gives "
                      f"{', '.join(map(str, expected))}")


def verify(graph: Graph) -> None:
    """Check every node against its op's rule; raise IRError naming the node and the rule."""
    from .ir import format_node

    types: dict[tuple[str, int], TensorType] = {}
    for node in graph.nodes:
        try:
            if any((node.name, i) in types for i in range(len(node.types))):
                raise IRError(f"node name %{node.name} is defined twice")
            _verify_node(node, types)
        except IRError as exc:
            raise IRError(f"{exc} (in graph {graph.name}: {format_node(node)})") from None
        for i, t in enumerate(node.types):
            types[(node.name, i)] = t
    for v in graph.outputs:
        if (v.node, v.index) not in types:
            raise IRError(f"graph {graph.name} returns {v}, which is not defined")
