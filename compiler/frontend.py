"""torch.fx frontend: trace the model definition into llmc IR.

The model (its family's `causal_lm`, models/families, built from models/blocks.py) is built on
the `meta` device, so tracing touches no weight data, and traced with torch.fx once per entry graph:

  prefill  input_ids i64[T], positions i64[T], query_start_loc i32[S+1], logits_indices i64[R]
           -> logits [R, vocab] (the token rows logits_indices names: R logit rows, a dim of their
              own, since a chunk may ask for logits at several positions, its last K+1 tokens for
              speculative verification or every prompt token for prompt logprobs)
  decode   input_ids i64[S], positions i64[S], query_start_loc i32[S+1]
           -> logits [S, vocab] (one token per sequence, so no gather: R is S, and no R is declared)

Each fx node becomes one IR node; its result type comes from the op's type rule, never from the
frontend, so a mistrace fails `verify` at the node that caused it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from llmc.models import blocks
from llmc.models.config import ModelConfig
from llmc.models.families import family_of

from .dtypes import from_torch, to_torch
from .ir import Graph, IRError, Node, TensorType, Value
from .ops import OPS, infer_types, verify
from .ops.norms import rounding_attr

ENTRIES = ("prefill", "decode")


def entry_inputs(entry: str) -> dict[str, TensorType]:
    """The graph inputs of an entry, before any pass adds cache metadata."""
    tokens = "T" if entry == "prefill" else "S"
    inputs = {
        "input_ids": TensorType("i64", (tokens,)),
        "positions": TensorType("i64", (tokens,)),
        "query_start_loc": TensorType("i32", ("S+1",)),
    }
    if entry == "prefill":
        inputs["logits_indices"] = TensorType("i64", ("R",))      # logit rows, not sequences
    return inputs


class _Builder:
    """Accumulates IR nodes while walking the fx graph."""

    def __init__(self, name: str, module: nn.Module):
        self.graph = Graph(name)
        self.module = module
        self.values: dict[str, Value] = {}     # fx node name -> IR value
        self.types: dict[Value, TensorType] = {}
        self.weights: dict[str, Value] = {}
        self.next_id = 0

    def add(self, name: str, op: str, inputs: list[Value], attrs: dict[str, Any],
            types: tuple[TensorType, ...] | None = None) -> Value:
        if types is None:
            types = infer_types(op, [self.types[v] for v in inputs], attrs)
        node = Node(name, op, tuple(inputs), attrs, types)
        self.graph.nodes.append(node)
        self.types[node.value()] = types[0]
        return node.value()

    def op(self, op: str, inputs: list[Value], **attrs: Any) -> Value:
        self.next_id += 1
        return self.add(str(self.next_id - 1), op, inputs, attrs)

    def weight(self, path: str) -> Value:
        if path not in self.weights:
            param = self.module.get_parameter(path)
            t = TensorType(from_torch(param.dtype), tuple(param.shape))
            self.weights[path] = self.add(f"w.{path}", "weight", [], {}, (t,))
        return self.weights[path]


def _linear(b: _Builder, x: Value, weight: Value, bias: Value | None) -> Value:
    return b.op("linear", [x, weight] + ([bias] if bias is not None else []))


def _arg(b: _Builder, a: Any) -> Any:
    if isinstance(a, torch.fx.Node):
        if a.op == "get_attr":
            return b.weight(a.target)
        return b.values[a.name]
    return a


def _call_module(b: _Builder, node: torch.fx.Node) -> Value:
    sub = b.module.get_submodule(node.target)
    x = _arg(b, node.args[0])
    if isinstance(sub, nn.Linear):
        bias = b.weight(f"{node.target}.bias") if sub.bias is not None else None
        return _linear(b, x, b.weight(f"{node.target}.weight"), bias)
    if isinstance(sub, nn.Embedding):
        return b.op("embedding", [b.weight(f"{node.target}.weight"), x])
    raise IRError(f"the frontend cannot lower module {node.target} of type {type(sub).__name__}")


def _fn_rmsnorm(b, x, w, eps, rounding="normed"):
    # rounding is an optional attr (compiler/ops/norms.py): written only when it is not "normed"
    return b.op("rmsnorm", [x, w], eps=float(eps), **rounding_attr(rounding))


def _fn_head_rmsnorm(b, x, w, eps, head_dim, rounding="normed"):
    return b.op("head_rmsnorm", [x, w], eps=float(eps), head_dim=head_dim, **rounding_attr(rounding))


def _fn_rope(b, x, pos, head_dim, theta, scaling, rotary_dim=None):
    # rotary_dim is an optional attr (partial rotary): written only when it is not head_dim
    partial = {"rotary_dim": int(rotary_dim)} if rotary_dim is not None and rotary_dim != head_dim else {}
    return b.op("rope", [x, pos], head_dim=head_dim, theta=float(theta), scaling=scaling, **partial)


def _fn_attention(b, q, k, v, qsl, num_heads, num_kv_heads, head_dim, scale, window=0, softcap=0.0):
    # window and softcap are optional attrs (compiler/ops/attention.py): written only when on, so
    # a model without them prints and verifies as before
    options = {"window": int(window)} if window else {}
    options |= {"softcap": float(softcap)} if softcap else {}
    return b.op("attention", [q, k, v, qsl], num_heads=num_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim, scale=float(scale), **options)


def _fn_softcap(b, x, cap):
    return b.op("softcap", [x], cap=float(cap))


def _fn_index_select(b, x, dim, idx):
    if dim != 0:
        raise IRError(f"index_select along dim {dim} is not supported; llmc gathers token rows only")
    return b.op("index_select", [x, idx])


_FUNCTIONS: dict[Any, Callable[..., Value]] = {
    blocks.rmsnorm: _fn_rmsnorm,
    blocks.head_rmsnorm: _fn_head_rmsnorm,
    blocks.rope: _fn_rope,
    blocks.causal_attention: _fn_attention,
    blocks.softcap: _fn_softcap,
    F.linear: lambda b, x, w, bias=None: _linear(b, x, w, bias),
    torch.index_select: _fn_index_select,
}


def _traced_elementwise(target: Any) -> Callable[..., Value] | None:
    """The lowering of a call to `target` into the elementwise op whose record lists it among the
    torch functions it traces from. Tensor arguments are the op's operands in order; a call with
    one number among its arguments (`x * 2.0`) becomes the listing op with one attribute (`scale`),
    the number its value; one with tensors only, the listing op with none (`mul`). Keywords must
    be the record's `traced_kwargs` (an `inplace=False` is ignored)."""
    records = [r for r in OPS.values() if target in r.traced]
    if not records:
        return None

    def lower(b: _Builder, *args: Any, inplace: bool = False, **kwargs: Any) -> Value:
        if inplace:
            raise IRError(f"the frontend cannot lower an in-place {target}; the model must not write in place")
        name = getattr(target, "__name__", str(target))
        numbers = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
        record = next((r for r in records if len(r.attrs) == len(numbers) <= 1), None)
        if record is None or len(numbers) + sum(isinstance(a, Value) for a in args) != len(args):
            takes = ", ".join(f"{r.name} takes {'tensors and one number' if r.attrs else 'tensors only'}"
                              for r in records)
            raise IRError(f"the frontend cannot lower {name} with arguments {args!r}: {takes}")
        want = record.traced_kwargs
        got = {k: kwargs.get(k, "(default)") for k in {*want, *kwargs}}
        if got != want:
            raise IRError(f"the frontend lowers {name} only with {want} (op {record.name}), got {got}; "
                          f"llmc has no op for that call")
        attrs = {record.attrs[0]: float(numbers[0])} if numbers else {}
        return b.op(record.name, [a for a in args if isinstance(a, Value)], **attrs)
    return lower


def _lower_node(b: _Builder, node: torch.fx.Node, inputs: dict[str, TensorType]) -> None:
    if node.op == "placeholder":
        if node.name in inputs:
            b.values[node.name] = b.add(node.name, "input", [], {}, (inputs[node.name],))
    elif node.op == "get_attr":
        b.values[node.name] = b.weight(node.target)
    elif node.op == "call_module":
        b.values[node.name] = _call_module(b, node)
    elif node.op == "call_function" and getattr(node.target, "__name__", "") == "_assert_is_none":
        return  # fx's guard for the concrete `logits_indices=None` of the decode trace
    elif node.op == "call_function":
        lower = _FUNCTIONS.get(node.target) or _traced_elementwise(node.target)
        if lower is None:
            raise IRError(f"the frontend has no lowering for {node.target} (fx node {node.name})")
        args = [_arg(b, a) for a in node.args]
        kwargs = {k: _arg(b, a) for k, a in node.kwargs.items()}
        b.values[node.name] = lower(b, *args, **kwargs)
    elif node.op == "output":
        b.graph.outputs = (_arg(b, node.args[0]),)
    else:
        raise IRError(f"the frontend cannot lower fx node {node.name} ({node.op} {node.target})")


def trace(cfg: ModelConfig, entry: str, dtype: str = "f32") -> Graph:
    """Trace the model of `cfg`, as its family builds it, into the IR of one entry graph (verified)."""
    if entry not in ENTRIES:
        raise IRError(f"entry graph {entry!r} is unknown; llmc builds {ENTRIES}")
    with torch.device("meta"):
        module = family_of(cfg.architecture).causal_lm(cfg).to(to_torch(dtype))
    concrete = {"logits_indices": None} if entry == "decode" else None
    fx_graph = torch.fx.Tracer().trace(module, concrete_args=concrete)
    builder = _Builder(entry, module)
    inputs = entry_inputs(entry)
    for node in fx_graph.nodes:
        _lower_node(builder, node, inputs)
    # Inputs first, then weights, then ops: the order passes and printers rely on.
    order = {"input": 0, "weight": 1}
    builder.graph.nodes.sort(key=lambda n: order.get(n.op, 2))
    verify(builder.graph)
    return builder.graph
