"""Skip decoder layers: derive the self-speculative `draft` entry graph from the traced prefill.

Matches: a traced (cache-less) prefill graph; ctx.options["draft_skip"], the decoder layers to
  skip (indices into the target's layers). A layer is the run of ops from the first op reading one
  of its weights (`w.layers.<i>.`) to the op before the first that reads another layer's weight
  (or a non-layer weight: the final norm, the LM head); the ops before layer 0 are the head
  (embedding, Gemma's scale), those after the last layer the tail. Exactly one op value flows
  into each layer and into the tail from before it: the residual stream (llmc's families read
  positions and query_start_loc as graph inputs, so nothing else crosses). That is checked, and a
  graph where it does not hold is an IRError naming the layer, so a family with another layout
  fails here and not in the draft's numbers.
Produces: the graph named `draft`: the ops and weights of each skipped layer i are gone, and the
  readers of layer i's output residual read its input residual instead (a chain of skipped layers
  resolves to the residual before the first of them). Pre-norm (Llama, Qwen, Mistral, Phi-3),
  four-norm (Gemma 2/3) and post-norm (OLMo 2) layers are all `r_out = f_i(r_in)`, so the bypass
  is the same for each. The kept layers' weight nodes keep their names, so the artifact stores
  them once for all graphs. ctx.options["kv_layers"] is set to the kept layers' indices in order:
  insert_paged_attention gives each kept attention its target layer's KV-cache layer, so the draft
  writes its drafted positions into the target's own cache slots, which the verify pass (prefill
  over the same positions) overwrites before anything reads them as verified.
Requires: the traced graph (before insert_paged_attention: attention is still pure, no kv_write
  side effect to keep). Runs before the pipeline, which then lowers the draft like prefill.
Preserves: the inputs and output type of prefill; with an empty skip set, the graph node for node.
"""

from __future__ import annotations

import re

from llmc.compiler.ir import Graph, IRError, Node, Value

from .rewrite import PassContext, RewriteState, rewrite

_LAYER_WEIGHT = re.compile(r"^w\.layers\.(\d+)\.")
TAIL = -1           # the region after the last decoder layer


def _owner(nodes: dict[str, Node], node: Node) -> int | None:
    """The decoder layer whose weight `node` reads; TAIL for another weight; None for no weight."""
    for v in node.inputs:
        if nodes[v.node].op == "weight":
            m = _LAYER_WEIGHT.match(v.node)
            return int(m.group(1)) if m else TAIL
    return None


def layer_regions(graph: Graph) -> dict[str, int | None]:
    """Each op node's region: its decoder layer, TAIL after the last one, None in the head (a
    draft's layers, with gaps, too)."""
    nodes = graph.node_map()
    regions: dict[str, int | None] = {}
    current: int | None = None
    for node in graph.nodes:
        if node.op in ("input", "weight"):
            continue
        owner = _owner(nodes, node)
        if current is None and owner == TAIL:
            owner = None                              # the embedding: a non-layer weight before layer 0
        if owner is not None and owner != current:
            if current == TAIL or (owner != TAIL and current is not None and owner < current):
                raise IRError(f"node %{node.name} reads layer {owner}'s weights after region {current}; "
                              "the draft pass needs the decoder layers in order, each one contiguous")
            current = owner
        regions[node.name] = current
    return regions


def residual_streams(graph: Graph) -> dict[int, Value]:
    """The residual value entering each decoder layer and (under TAIL) the tail."""
    nodes, regions = graph.node_map(), layer_regions(graph)
    crossing: dict[int, set[Value]] = {}
    for node in graph.nodes:
        region = regions.get(node.name)
        if region is None:
            continue
        for v in node.inputs:
            if v.node in regions and regions[v.node] != region:
                crossing.setdefault(region, set()).add(v)
    for region, values in crossing.items():
        if len(values) != 1:
            what = "the tail" if region == TAIL else f"layer {region}"
            names = ", ".join(sorted(str(v) for v in values))
            raise IRError(f"{len(values)} values ({names}) flow into {what}, not one residual stream; "
                          f"the draft pass cannot bypass layers of this graph")
    streams = {region: next(iter(values)) for region, values in crossing.items()}
    if TAIL not in streams or any(nodes[v.node].types[v.index] != nodes[streams[TAIL].node].types[streams[TAIL].index]
                                  for v in streams.values()):
        raise IRError("the residual streams of the layers and the tail differ in type (or there is no tail); "
                      "the draft pass cannot bypass layers of this graph")
    return streams


def _bypass(streams: dict[int, Value], skip: set[int]) -> dict[Value, Value]:
    """Skipped layer i's output residual -> the input residual of the first skipped layer of its run."""
    layers = sorted(r for r in streams if r != TAIL)
    outputs = {i: streams[layers[k + 1]] if k + 1 < len(layers) else streams[TAIL] for k, i in enumerate(layers)}
    bypass: dict[Value, Value] = {}
    for i in layers:                                  # in order, so a run resolves to its first input
        if i in skip:
            source = streams[i]
            bypass[outputs[i]] = bypass.get(source, source)
    return bypass


def skip_layers(graph: Graph, ctx: PassContext) -> Graph:
    """The draft graph: `graph` without the layers in ctx.options["draft_skip"] (module docstring)."""
    skip = set(ctx.options.get("draft_skip", ()))
    streams = residual_streams(graph)
    layers = sorted(r for r in streams if r != TAIL)
    if not skip <= set(layers):
        raise IRError(f"draft_skip {sorted(skip)} names layers outside the graph's {len(layers)} layers")
    regions, bypass = layer_regions(graph), _bypass(streams, skip)

    def bypass_layer(node: Node, state: RewriteState):
        m = _LAYER_WEIGHT.match(node.name) if node.op == "weight" else None
        if (m and int(m.group(1)) in skip) or regions.get(node.name) in skip:
            return ()                                 # a skipped layer's op or weight: not copied
        if not any(v in bypass for v in node.inputs):
            return None
        new = state.emit(node.op, [state.get(bypass.get(v, v)) for v in node.inputs], **node.attrs)
        return tuple(new.value(i) for i in range(len(new.types)))

    draft = rewrite(graph, [bypass_layer], "skip_layers", ctx)
    draft.name = "draft"
    ctx.options["kv_layers"] = tuple(i for i in layers if i not in skip)
    ctx.options["kv_cache_layers"] = len(layers)
    return draft
