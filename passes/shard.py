"""Shard a graph over N tensor-parallel ranks: the graph ONE rank runs (every rank runs the same one).

Matches: the GEMMs of a decoder (linear or qlinear), by what they read and feed: the merged QKV
  (read by rope_kv_write), gate_up (read by silu_mul / gelu_tanh_mul), the output projection (reads
  an attention), down_proj (reads silu_mul / gelu_tanh_mul) and the LM head (feeds the graph's
  output); the attention ops, rope_kv_write and the `kv_cache` input; and every weight node.
Produces: column-parallel QKV (each rank H / N query heads and its KV heads: KV / N of them, or,
  with fewer KV heads than ranks, KV head r * KV // N on rank r, replicated) and gate_up (gate and
  up halves split alike, so silu_mul's halves follow); row-parallel o_proj and down_proj, each then
  `all_reduce(size=N)`; the LM head split by vocabulary, then `all_gather(size=N)` (a vocabulary N
  does not divide keeps the whole LM head on every rank, said at INFO and shown by `llmc inspect`);
  num_heads / num_kv_heads attrs and the kv_cache's head axis per rank. The embedding is replicated:
  its gather reads only the step's rows, so splitting it would save memory, not time, and cost an
  all_reduce. A tied table's LM head reads a weight `<table>.vocab_split` cut from the table.
  Column-parallel biases are split with their rows; a row-parallel bias (no supported family has
  one) is refused. OLMo-2's q/k norm over all heads (rope_kv_write qk_norm='all') becomes
  `qk_sum_squares` -> `all_reduce` -> `qk_rms_norm` before a rope_kv_write without the norm; per-head
  norms (Qwen3, Gemma 3) need nothing. `ctx.records["shard"]` holds the plan
  (compiler/tensor_parallel.py): a rule for every weight the graph declares. The hit counter counts
  the rewritten nodes.
Requires: merge_qkv, merge_gate_up, fuse_rope_kv_write, fold_weights, quantize_weights (it cuts the
  merged weights, and quantized ones along their groups) and dce (every GEMM left has a role).
Preserves: the unsharded graph's numerics up to the order of the all_reduces' sums (each rank
  computes its share; the sum over ranks is the whole).
Off unless `ctx.options["tp"]` is 2 or more. Head, intermediate or group counts N does not divide
  are refused in one sentence naming the counts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from llmc.compiler.ir import Graph, Node, Value
from llmc.compiler.ops import operands_of
from llmc.compiler.tensor_parallel import cut_shape, replicate, segments, split

from .rewrite import PassContext, PassError, RewriteState, rewrite

log = logging.getLogger(__name__)
GATED = ("silu_mul", "gelu_tanh_mul")
ATTENTIONS = ("paged_attention", "paged_decode_attention")
HEAD_OPS = (*ATTENTIONS, "rope_kv_write")
LOGIT_OPS = ("softcap", "scale", "cast")        # elementwise ops that may follow the LM head
WEIGHT_OPERANDS = ("weight", "codes", "scales", "mins", "bias")
QK_NORM_ATTRS = ("qk_norm", "norm_eps", "norm_rounding")


@dataclass
class ShardLayout:
    """What the pass found in one graph: each GEMM's role, each weight's rule, derived weights."""

    n: int
    roles: dict[str, str] = field(default_factory=dict)          # GEMM node name -> role
    rules: dict[str, dict] = field(default_factory=dict)         # weight name -> rule
    gemm_attrs: dict[str, dict] = field(default_factory=dict)    # GEMM node name -> its attrs per rank
    derived: dict[str, str] = field(default_factory=dict)        # source weight name -> LM head's own name


def _feeds_output(graph: Graph, value: Value, users: dict) -> bool:
    """Whether `value` reaches a graph output through LOGIT_OPS alone."""
    while value not in graph.outputs:
        readers = users.get(value, [])
        if len(readers) != 1 or readers[0].op not in LOGIT_OPS:
            return False
        value = readers[0].value()
    return True


def gemm_role(graph: Graph, node: Node, nodes: dict, users: dict) -> str | None:
    """qkv, gate_up, o_proj, down_proj, lm_head or None: what a GEMM is to the decoder."""
    readers = {u.op for u in users.get(node.value(), [])}
    source = nodes[operands_of(node).x.node].op
    if readers == {"rope_kv_write"}:
        return "qkv"
    if readers and readers <= set(GATED):
        return "gate_up"
    if source in ATTENTIONS:
        return "o_proj"
    if source in GATED:
        return "down_proj"
    return "lm_head" if _feeds_output(graph, node.value(), users) else None


def heads_per_rank(attrs: dict, n: int) -> dict:
    """num_heads and num_kv_heads of one rank; PassError naming the counts N does not divide."""
    heads, kv = attrs["num_heads"], attrs.get("num_kv_heads", attrs["num_heads"])
    if heads % n:
        fits = [str(d) for d in range(2, heads + 1) if heads % d == 0 and (kv % d == 0 or d % kv == 0)]
        raise PassError(f"--tp {n} does not divide the model's {heads} attention heads; choose a --tp that divides "
                        f"{heads} ({', '.join(fits) or 'none: run this model on one rank'})")
    if kv % n and n % kv:
        raise PassError(f"--tp {n} neither divides the model's {kv} KV heads nor is a multiple of them; choose a "
                        f"--tp that divides {kv} or is a multiple of it")
    return {"num_heads": heads // n, "num_kv_heads": max(kv // n, 1)}


def _names(node: Node) -> dict[str, str]:
    """operand name -> weight name of a GEMM's weight operands (weight or codes/scales/mins, bias)."""
    x = operands_of(node)
    return {k: x[k].node[2:] for k in WEIGHT_OPERANDS if k in x}


def _divides(n: int, count: int, what: str) -> None:
    if count % n:
        raise PassError(f"--tp {n} does not divide the model's {count} {what}; choose a --tp that divides {count}")


def _column_rules(node: Node, role: str, graph: Graph, users: dict, n: int) -> dict[str, dict]:
    """qkv: q | k | v rows by heads; gate_up: gate | up rows; every weight operand alike."""
    if role == "qkv":
        rope = users[node.value()][0].attrs
        heads_per_rank(rope, n)
        h, kv, d = rope["num_heads"], rope["num_kv_heads"], rope["head_dim"]
        rule = segments(0, [h * d, kv * d, kv * d], [h, kv, kv])
    else:
        inter = graph.type_of(node.value()).shape[1] // 2
        _divides(n, inter, "intermediate (MLP) features")
        rule = segments(0, [inter, inter], [inter, inter])
    return {name: rule for name in _names(node).values()}


def _row_rules(node: Node, graph: Graph, n: int, layout: ShardLayout) -> dict[str, dict]:
    """o_proj / down_proj: input features split. int4 scales and mins split by groups (refused where
    N does not divide the groups); int8's per-row scale is one group kept whole on every rank, its
    group_size then this rank's features (each rank's partial sum takes the same scale)."""
    names = _names(node)
    if "bias" in names:
        raise PassError(f"{names['bias']} is the bias of a row-parallel projection, which --tp does not split (no "
                        f"supported family has one); compile without --tp")
    k = graph.type_of(operands_of(node).x).shape[1]
    _divides(n, k, f"input features of {names.get('weight', names.get('codes'))}")
    rules = {names.get("weight", names.get("codes")): split(1)}
    if node.op == "qlinear":
        group = node.attrs["group_size"]
        groups = k // group
        if groups % n == 0:
            rules |= {names[p]: split(1) for p in ("scales", "mins") if p in names}
        elif groups == 1 and node.attrs["bits"] == 8:
            rules |= {names["scales"]: replicate()}
            layout.gemm_attrs[node.name] = {**node.attrs, "group_size": k // n}
        else:
            weight = names["codes"].removesuffix(".codes")
            raise PassError(f"--tp {n} would cut the quantization groups of {weight}: its {k} input features hold "
                            f"{groups} groups of {group}, which {n} ranks cannot share; choose a --tp that divides "
                            f"{groups} or another --quant group size")
    return rules


def _lm_head_rules(node: Node, graph: Graph, users: dict, layout: ShardLayout) -> dict[str, dict]:
    """The LM head split by vocabulary (a tied table through a derived name), or kept whole."""
    n, names = layout.n, _names(node)
    vocab = graph.type_of(node.value()).shape[1]
    if vocab % n:
        log.info("--tp %d does not divide the vocabulary of %d: every rank computes the whole LM head", n, vocab)
        layout.roles[node.name] = "lm_head_replicated"
        return {name: replicate() for name in names.values()}
    rules = {}
    for name in names.values():
        shared = any(u.name != node.name for u in users.get(Value("w." + name, 0), []))
        if shared:                   # a tied table: the embedding reads all of it
            layout.derived[name] = f"{name}.vocab_split"
            rules[f"{name}.vocab_split"] = {**split(0), "source": name}
        else:
            rules[name] = split(0)
    return rules


def _norm_rules(node: Node, n: int) -> dict[str, dict]:
    """OLMo-2's q/k norm weights [H*D], [KV*D] follow the heads; per-head norms [D] are replicated."""
    x = operands_of(node)
    if node.attrs.get("qk_norm") != "all":
        return {}
    kv = node.attrs["num_kv_heads"]
    return {x.q_norm.node[2:]: split(0), x.k_norm.node[2:]: segments(0, [kv * node.attrs["head_dim"]], [kv])}


def shard_layout(graph: Graph, n: int) -> ShardLayout:
    """Roles and weight rules of `graph` for `n` ranks (PassError for what cannot shard)."""
    layout, nodes, users = ShardLayout(n), graph.node_map(), graph.users()
    for node in graph.nodes:
        if node.op in HEAD_OPS:
            heads_per_rank(node.attrs, n)
        if node.op == "rope_kv_write":
            layout.rules |= _norm_rules(node, n)
        if node.op not in ("linear", "qlinear"):
            continue
        role = gemm_role(graph, node, nodes, users)
        if role is None:
            raise PassError(f"--tp cannot tell how to split %{node.name} = {node.op}(...): it is not a QKV, gate/up, "
                            f"output, down or LM head projection; compile without --tp")
        layout.roles[node.name] = role
        if role in ("qkv", "gate_up"):
            layout.rules |= _column_rules(node, role, graph, users, n)
        elif role in ("o_proj", "down_proj"):
            layout.rules |= _row_rules(node, graph, n, layout)
        else:
            layout.rules |= _lm_head_rules(node, graph, users, layout)
    return layout


def _all_head_qk_norm(node: Node, attrs: dict, n: int, state: RewriteState) -> tuple[Value, Value]:
    """rope_kv_write(qkv, ..., qk_norm='all') -> qk_sum_squares, all_reduce, qk_rms_norm, rope_kv_write."""
    x = operands_of(node)
    heads = {k: attrs[k] for k in ("num_heads", "num_kv_heads", "head_dim")}
    qkv = state.get(x.qkv)
    sums = state.emit("qk_sum_squares", [qkv], **heads).value()                # [T, 2]: this rank's q, k
    total = state.emit("all_reduce", [sums], size=n).value()                   # [T, 2]: every rank's
    rounding = {"rounding": attrs["norm_rounding"]} if "norm_rounding" in attrs else {}
    normed = state.emit("qk_rms_norm", [qkv, total, state.get(x.q_norm), state.get(x.k_norm)], **heads,
                        size=n, eps=attrs["norm_eps"], **rounding).value()
    inputs = [normed, *(state.get(x[k]) for k in ("positions", "kv_cache", "slot_mapping"))]
    new = state.emit("rope_kv_write", inputs, **{k: v for k, v in attrs.items() if k not in QK_NORM_ATTRS})
    return new.value(0), new.value(1)


class ShardRules:
    """The pass's rules over one graph (bound methods, so a rule's errors name it); `plan` (weight
    name -> rule) collects the rule of every weight the new graph declares."""

    def __init__(self, layout: ShardLayout, plan: dict):
        self.layout, self.plan, self.n = layout, plan, layout.n

    def rules(self) -> list:
        return [self.shard_weight, self.shard_kv_cache, self.shard_heads, self.shard_gemm]

    def _declare(self, name: str, source: Node, state: RewriteState) -> Value:
        rule = self.plan[name] = self.layout.rules.get(name, replicate())
        return state.declare(f"w.{name}", "weight", source.type.with_shape(*cut_shape(source.type.shape, rule, self.n)))

    def shard_weight(self, node: Node, state: RewriteState):
        if node.op != "weight":
            return None
        name = node.name[2:]
        if name in self.layout.derived:
            self._declare(self.layout.derived[name], node, state)
        if name not in self.layout.rules:
            self.plan[name] = replicate()
            return None
        return (self._declare(name, node, state),)

    def shard_kv_cache(self, node: Node, state: RewriteState):
        if node.op != "input" or node.name != "kv_cache":
            return None
        shape = list(node.type.shape)
        shape[3] = max(shape[3] // self.n, 1)                          # [L, 2, NB, KVH, BS, D]: heads per rank
        return (state.declare(node.name, "input", node.type.with_shape(*shape)),)

    def shard_heads(self, node: Node, state: RewriteState):
        if node.op not in HEAD_OPS:
            return None
        attrs = node.attrs | heads_per_rank(node.attrs, self.n)
        if node.op == "rope_kv_write" and attrs.get("qk_norm") == "all":
            return _all_head_qk_norm(node, attrs, self.n, state)
        new = state.emit(node.op, [state.get(v) for v in node.inputs], **attrs)
        return tuple(new.value(i) for i in range(len(new.types)))

    def shard_gemm(self, node: Node, state: RewriteState):
        role, derived = self.layout.roles.get(node.name), self.layout.derived
        if role not in ("o_proj", "down_proj", "lm_head"):
            return None
        inputs = [state.new_nodes[f"w.{derived[v.node[2:]]}"].value() if v.node[2:] in derived else state.get(v)
                  for v in node.inputs]
        out = state.emit(node.op, inputs, **self.layout.gemm_attrs.get(node.name, node.attrs)).value()
        joined = "all_gather" if role == "lm_head" else "all_reduce"
        return (state.emit(joined, [out], size=self.n).value(),)


def shard(graph: Graph, ctx: PassContext) -> Graph:
    """The graph one of N ranks runs (see module docstring)."""
    n = ctx.options.get("tp", 1)
    if n < 2:
        return graph
    plan = ctx.records.setdefault("shard", {"size": n, "weights": {}})
    return rewrite(graph, ShardRules(shard_layout(graph, n), plan["weights"]).rules(), "shard", ctx)
